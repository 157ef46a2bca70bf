//! GRPO with image prompts on a real vLLM server: the CPU build of vLLM 0.32 serves the tiny
//! Qwen3-VL fixture; oxrl sends each prompt's ids with one pad per image and the pictures as
//! `content_parts`, vLLM processes the pictures itself, and its log-probs match the trainer's
//! (which processed them in Rust) within 1e-5 at every step while `sync = "disk"` moves the
//! weights, vision tower included.

use candle_core::Device;
use oxrl_fixtures::{demo_config, fixture, repo, temp_dir, VllmProcess};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The Qwen3-VL fixture (head_dim 32, which vLLM's CPU attention takes) with a byte-level
/// tokenizer whose special tokens sit at the fixture's ids (`<|image_pad|>` = 1000, ...): vLLM
/// needs a tokenizer to process images, and the fixture ships none.
fn vl_policy(root: &Path) -> PathBuf {
    let dir = root.join("policy");
    std::fs::create_dir_all(&dir).unwrap();
    for file in [
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture(&format!("qwen3-vl-tiny/{file}")), dir.join(file)).unwrap();
    }
    let shapes = repo().join("examples/shapes/policy");
    let text = std::fs::read_to_string(shapes.join("tokenizer.json")).unwrap();
    let mut tokenizer: Value = serde_json::from_str(&text).unwrap();
    let ids = json!({"<|image_pad|>": 1000, "<|video_pad|>": 1001, "<|vision_start|>": 1002,
        "<|vision_end|>": 1003, "<|im_end|>": 1004, "<|endoftext|>": 1005, "<|im_start|>": 1006});
    for token in tokenizer["added_tokens"].as_array_mut().unwrap() {
        token["id"] = ids[token["content"].as_str().unwrap()].clone();
    }
    for (content, id) in ids.as_object().unwrap() {
        tokenizer["model"]["vocab"][content] = id.clone();
    }
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::copy(
        shapes.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    dir
}

#[test]
fn grpo_with_image_prompts_on_a_vllm_server_matches_the_trainer() {
    let python = oxrl_fixtures::peer_python();
    let dir = temp_dir("vllm-peer-vl");
    let policy = vl_policy(&dir);
    let log = dir.join("vllm.log");
    let server = VllmProcess::start(&python, &policy, &log, &["--max-model-len", "512"]);
    let rollout = format!(
        "[rollout]\nbackend = \"vllm\"\nserver_urls = [\"{}\"]\nsync = \"disk\"\n",
        server.url
    );
    let config = demo_config(
        "shapes",
        &dir.join("grpo.toml"),
        &[
            ("[rollout]\n", &rollout),
            ("n_samples_per_prompt = 8", "n_samples_per_prompt = 4"),
            ("batch_size = 16", "batch_size = 2"),
            ("max_steps = 60", "max_steps = 3"),
            ("save_every = 20", "save_every = 0"),
            ("eval_every = 20", "eval_every = 0"),
            // A random policy never names the colour: reward letters instead, so that the
            // advantages are not all zero and the weights move.
            (
                "type = \"exact_match\"",
                "type = \"regex_match\"\npattern = \"[a-m]\"",
            ),
        ],
    );
    let shapes_policy = repo().join("examples/shapes/policy").display().to_string();
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace(&shapes_policy, s(&policy));
    std::fs::write(&config, text).unwrap();

    let out = dir.join("out");
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["train", "--config", s(&config), "--output-dir", s(&out)])
        .output()
        .unwrap();
    assert!(
        r.status.success(),
        "{}\nvLLM's log:\n{}",
        String::from_utf8_lossy(&r.stderr),
        oxrl_fixtures::tail(&log)
    );
    let steps: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|m| m.get("rollout_logprob_diff").is_some())
        .collect();
    assert_eq!(steps.len(), 3);
    let diffs: Vec<f64> = steps
        .iter()
        .map(|m| m["rollout_logprob_diff"].as_f64().unwrap())
        .collect();
    eprintln!("image prompts through vLLM: rollout_logprob_diff per step {diffs:?}");
    for (step, diff) in diffs.iter().enumerate() {
        assert!(
            *diff <= 1e-5,
            "step {}: rollout_logprob_diff {diff}",
            step + 1
        );
    }
    let start = candle_core::safetensors::load(policy.join("model.safetensors"), &Device::Cpu);
    let synced =
        candle_core::safetensors::load(out.join("sync-weights/model.safetensors"), &Device::Cpu);
    let (start, synced) = (start.unwrap(), synced.unwrap());
    let moved = |name: &String| {
        let a = start[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = synced[name]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        a != b
    };
    let vision: Vec<&String> = start.keys().filter(|k| k.contains("visual.")).collect();
    assert!(!vision.is_empty());
    assert!(
        vision.iter().any(|k| moved(k)),
        "the vision tower went to vLLM unchanged"
    );
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
