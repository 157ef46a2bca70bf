//! Regenerates `examples/shapes/`: the vision-language demo (`oxrl train --config
//! examples/shapes/grpo.toml`).
//!
//! - a byte-level tokenizer (256 byte tokens + ChatML and vision specials) with a chat template
//!   that renders image items as `<|vision_start|><|image_pad|><|vision_end|>`;
//! - `data/images/`: 64×64 pictures of one red, green, blue or yellow square or disc on white;
//! - `data/prompts.jsonl`: "What colour is the shape?" about each picture, with its answer;
//! - `data/sft.jsonl`: the same questions answered with noisy labels (right 35% of the time,
//!   another colour otherwise), so the warmed-up policy answers right about a third of the time
//!   and GRPO has something to sharpen;
//! - `policy/`: a tiny Qwen3-VL (text hidden 64 × 2 layers, vision hidden 32 × 2 blocks with one
//!   DeepStack tap, ~0.3M parameters) initialised at random and trained by `oxrl sft` on that data.
//!
//! Run from anywhere: `cargo run --release -p oxrl --example make_shapes_demo`.

mod common;

use candle_core::DType;
use common::{warm_up, write, write_tokenizer_files};
use oxrl_models::{Qwen3, HOST};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::path::PathBuf;

const SPECIALS: [&str; 7] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
];
const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}{{- message.content }}{%- else %}{%- for item in message.content %}{%- if item.type == 'image' or 'image' in item %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif item.type == 'text' %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
const COLOURS: [(&str, [u8; 3]); 4] = [
    ("red", [220, 30, 30]),
    ("green", [30, 170, 40]),
    ("blue", [30, 60, 220]),
    ("yellow", [235, 210, 20]),
];
const IMAGES: usize = 96;
const SIDE: u32 = 64;
const QUESTION: &str = "What colour is the shape?";

/// A white picture with one square or disc of `rgb`, at a random place and size.
fn picture(rng: &mut ChaCha8Rng, rgb: [u8; 3]) -> image::RgbImage {
    let r = rng.random_range(8..20) as i64;
    let cx = rng.random_range(r..SIDE as i64 - r);
    let cy = rng.random_range(r..SIDE as i64 - r);
    let disc = rng.random_bool(0.5);
    image::RgbImage::from_fn(SIDE, SIDE, |x, y| {
        let (dx, dy) = (x as i64 - cx, y as i64 - cy);
        let inside = match disc {
            true => dx * dx + dy * dy <= r * r,
            false => dx.abs() <= r && dy.abs() <= r,
        };
        image::Rgb(if inside { rgb } else { [255; 3] })
    })
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/shapes");
    let init = std::env::temp_dir().join("oxrl-shapes-init");
    let _ = std::fs::remove_dir_all(&init);

    // The initial random policy with its tokenizer and image processor.
    let config = json!({
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": 261, "video_token_id": 262,
        "vision_start_token_id": 259, "vision_end_token_id": 260,
        "tie_word_embeddings": true, "dtype": "float32", "initializer_range": 0.02,
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": 272, "hidden_size": 64,
            "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "eos_token_id": 258, "pad_token_id": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3], "mrope_interleaved": true},
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision", "depth": 2, "hidden_size": 32,
            "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 16,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
            "num_position_embeddings": 16, "deepstack_visual_indexes": [0],
            "hidden_act": "gelu_pytorch_tanh",
        },
    });
    let model = Qwen3::random(config, 0, DType::F32, &HOST).expect("random init");
    let side = std::env::temp_dir().join("oxrl-shapes-tokenizer");
    write_tokenizer_files(&side, &SPECIALS, CHAT_TEMPLATE);
    // 64×64 pictures stay 64×64: a 4×4 patch grid, 4 image tokens after the 2×2 merge.
    write(
        &side.join("preprocessor_config.json"),
        &json!({"size": {"shortest_edge": 4096, "longest_edge": 4096}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessor"})
        .to_string(),
    );
    model
        .save(&init, Some(&side))
        .expect("save the initial policy");

    // Data.
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let images = root.join("data/images");
    let _ = std::fs::remove_dir_all(&images);
    std::fs::create_dir_all(&images).expect("images dir");
    let (mut prompts, mut sft) = (String::new(), String::new());
    for i in 0..IMAGES {
        let (name, rgb) = COLOURS[i % COLOURS.len()];
        let file = format!("images/{i:03}.png");
        picture(&mut rng, rgb)
            .save(root.join("data").join(&file))
            .expect("write a picture");
        let content = json!([{"type": "image", "image": file}, {"type": "text", "text": QUESTION}]);
        prompts.push_str(&format!(
            "{}\n",
            json!({"prompt": [{"role": "user", "content": content}], "answer": name})
        ));
        for _ in 0..8 {
            let said = match rng.random_bool(0.35) {
                true => name,
                false => {
                    let others: Vec<&str> =
                        COLOURS.iter().map(|c| c.0).filter(|c| *c != name).collect();
                    others[rng.random_range(0..others.len())]
                }
            };
            let conv = json!({"messages": [
                {"role": "user", "content": content},
                {"role": "assistant", "content": said},
            ]});
            sft.push_str(&format!("{conv}\n"));
        }
    }
    write(&root.join("data/prompts.jsonl"), &prompts);
    write(&root.join("data/sft.jsonl"), &sft);

    // Warm up with SFT into policy/.
    warm_up(
        &root,
        &init,
        "shapes",
        &[
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "preprocessor_config.json",
        ],
    );
    println!("wrote {}", root.display());
}
