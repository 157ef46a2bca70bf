//! Regenerates `examples/arithmetic/`: the demo `oxrl train` runs with no config.
//!
//! - a byte-level tokenizer (256 byte tokens + ChatML specials) with a ChatML chat template;
//! - `data/prompts.jsonl`: every single-digit sum `a+b=` with its answer (GRPO prompts);
//! - `data/sft.jsonl`: conversations answering those sums with noisy labels (right 40% of the
//!   time, off by ±1 or ±2 otherwise), so the warmed-up policy samples the right answer about
//!   40% of the time and GRPO has something to sharpen;
//! - `policy/`: a tiny Qwen3 (hidden 64, 2 layers, ~100k parameters) initialised at random and
//!   trained by `oxrl sft` on that data.
//!
//! Run from anywhere: `cargo run --release -p oxrl --example make_arithmetic_demo`.

use candle_core::DType;
use oxrl_models::{Qwen3, HOST};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::path::PathBuf;

mod common;

use common::{warm_up, write, write_tokenizer_files, TEXT_CHAT_TEMPLATE, TEXT_SPECIALS};

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/arithmetic");
    let init = std::env::temp_dir().join("oxrl-arithmetic-init");
    let _ = std::fs::remove_dir_all(&init);

    // The initial random policy with its tokenizer.
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 272, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "dtype": "float32", "initializer_range": 0.02,
        "bos_token_id": null, "eos_token_id": 258, "pad_token_id": 256,
    });
    let model = Qwen3::random(config, 0, DType::F32, &HOST).expect("random init");
    let side = std::env::temp_dir().join("oxrl-arithmetic-tokenizer");
    write_tokenizer_files(&side, &TEXT_SPECIALS, TEXT_CHAT_TEMPLATE);
    model
        .save(&init, Some(&side))
        .expect("save the initial policy");

    // Data.
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut prompts = String::new();
    let mut sft = String::new();
    for a in 0..10 {
        for b in 0..10 {
            let sum = a + b;
            prompts.push_str(&format!(
                "{}\n",
                json!({"prompt": format!("{a}+{b}="), "answer": sum.to_string()})
            ));
            for _ in 0..10 {
                let u: f64 = rng.random();
                let delta: i32 = match u {
                    u if u < 0.4 => 0,
                    u if u < 0.6 => 1,
                    u if u < 0.8 => -1,
                    u if u < 0.9 => 2,
                    _ => -2,
                };
                let said = (sum + delta).max(0);
                let conv = json!({"messages": [
                    {"role": "user", "content": format!("{a}+{b}=")},
                    {"role": "assistant", "content": said.to_string()},
                ]});
                sft.push_str(&format!("{conv}\n"));
            }
        }
    }
    write(&root.join("data/prompts.jsonl"), &prompts);
    write(&root.join("data/sft.jsonl"), &sft);

    // Warm up with SFT into policy/.
    warm_up(
        &root,
        &init,
        "arithmetic",
        &[
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ],
    );
    println!("wrote {}", root.display());
}
