//! Regenerates `examples/calculator/`: a tiny policy that learns to call a calculator tool.
//!
//! - two-digit sums `ab+cd=`, which a ~100k-parameter policy cannot add reliably, with a
//!   `calculator` tool it can call in Qwen3's format:
//!   `<tool_call>{"name": "calculator", "arguments": {"expression": "ab+cd"}}</tool_call>`;
//! - `data/sft.jsonl`: conversations that call the tool half of the time (and then copy
//!   its result as the answer) and otherwise guess an answer within ±10 of the sum, so the
//!   warmed-up policy earns a reward mostly by the few tool calls it makes and RL has a clear
//!   way up: call the tool;
//! - `data/prompts.jsonl` (256 sums) and `data/val.jsonl` (64 others) for `oxrl train`;
//! - `policy/`: a tiny Qwen3 (hidden 128, 2 layers, 256 positions) trained by `oxrl sft`.
//!
//! Run from anywhere: `cargo run --release -p oxrl --example make_calculator_demo`.

use candle_core::DType;
use oxrl_models::{Qwen3, HOST};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::path::PathBuf;

mod common;

use common::{warm_up, write, write_tokenizer_files, TEXT_CHAT_TEMPLATE, TEXT_SPECIALS};

/// The tool call for `expression`, as the policy writes it.
fn call(expression: &str) -> String {
    format!(
        "<tool_call>{}</tool_call>",
        json!({"name": "calculator", "arguments": {"expression": expression}})
    )
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/calculator");
    let init = std::env::temp_dir().join("oxrl-calculator-init");
    let _ = std::fs::remove_dir_all(&init);

    let config = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 272, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "dtype": "float32", "initializer_range": 0.02,
        "bos_token_id": null, "eos_token_id": 258, "pad_token_id": 256,
    });
    let model = Qwen3::random(config, 0, DType::F32, &HOST).expect("random init");
    let side = std::env::temp_dir().join("oxrl-calculator-tokenizer");
    write_tokenizer_files(&side, &TEXT_SPECIALS, TEXT_CHAT_TEMPLATE);
    model
        .save(&init, Some(&side))
        .expect("save the initial policy");

    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut sums: Vec<(u32, u32)> = (10..100)
        .flat_map(|a| (10..100).map(move |b| (a, b)))
        .collect();
    sums.shuffle(&mut rng);
    let row =
        |(a, b): (u32, u32)| json!({"prompt": format!("{a}+{b}="), "answer": (a + b).to_string()});
    let rows =
        |s: &[(u32, u32)]| -> String { s.iter().map(|&p| format!("{}\n", row(p))).collect() };
    write(&root.join("data/prompts.jsonl"), &rows(&sums[..256]));
    write(&root.join("data/val.jsonl"), &rows(&sums[256..320]));
    let mut sft = String::new();
    for &(a, b) in &sums[320..] {
        let question = json!({"role": "user", "content": format!("{a}+{b}=")});
        let sum = a + b;
        let conv = match rng.random::<f64>() < 0.5 {
            true => json!([
                question,
                {"role": "assistant", "content": call(&format!("{a}+{b}"))},
                {"role": "user", "content": format!("<tool_response>\n{sum}\n</tool_response>")},
                {"role": "assistant", "content": sum.to_string()},
            ]),
            false => {
                let guess = (sum as i64 + rng.random_range(-10..=10)).max(0);
                json!([question, {"role": "assistant", "content": guess.to_string()}])
            }
        };
        sft.push_str(&format!("{}\n", json!({ "messages": conv })));
    }
    write(&root.join("data/sft.jsonl"), &sft);

    warm_up(
        &root,
        &init,
        "calculator",
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
