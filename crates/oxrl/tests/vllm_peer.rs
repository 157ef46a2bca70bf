//! GRPO with rollouts on a real vLLM server (`backend = "vllm"`): the community CPU build of
//! vLLM 0.32 from the pinned venv (`.ci/python-env`) serves a small Qwen3; oxrl trains three
//! steps against it. With `sync = "disk"` every step's `rollout_logprob_diff` (vLLM's log-probs
//! against the trainer's for the same tokens) stays ≤ 1e-5 and the samples carry the advancing
//! weight versions; with `sync = "none"` the server keeps the start weights and the diff grows,
//! which shows the sync really moved the weights. Two data-parallel ranks share the server, rank
//! 0 moving its weights. A LoRA run syncs the merged weights: its diff stays ≤ 1e-5 too.

use candle_core::{DType, Device};
use oxrl_fixtures::{repo, temp_dir, VllmProcess};
use oxrl_models::Qwen3;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A random Qwen3 with the arithmetic demo's tokenizer: head_dim 32, which vLLM's CPU attention
/// supports (the demo's own 16 is not).
fn policy(root: &Path) -> PathBuf {
    let dir = root.join("policy");
    let config = json!({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "dtype": "float32", "eos_token_id": 258,
        "pad_token_id": 256});
    let model = Qwen3::random(config, 5, DType::F32, &Device::Cpu).unwrap();
    model
        .save(&dir, Some(&repo().join("examples/arithmetic/policy")))
        .unwrap();
    dir
}

fn config(dir: &Path, name: &str, policy: &Path, url: &str, sync: &str) -> PathBuf {
    let data = repo().join("examples/arithmetic/data/prompts.jsonl");
    let text = format!(
        "[model]\npath = \"{}\"\n[data]\ntrain_files = \"{}\"\nprompt_key = \"prompt\"\n\
         [rollout]\nbackend = \"vllm\"\nserver_urls = [\"{url}\"]\nsync = \"{sync}\"\n\
         n_samples_per_prompt = 4\nmax_new_tokens = 6\ntemperature = 1.0\n\
         [[reward.functions]]\ntype = \"regex_match\"\nname = \"alnum\"\npattern = \"[0-9a-z]\"\n\
         [algorithm]\nkl_coef = 0.0\n\
         [trainer]\nbatch_size = 4\nmicro_batch_size = 16\nmax_steps = 3\nlr = 0.05\n\
         weight_decay = 0.0\nsave_every = 0\nmax_staleness = 10\nseed = 3\n",
        s(policy),
        s(&data)
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn train(config: &Path, out: &Path) -> Vec<Value> {
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["train", "--config", s(config), "--output-dir", s(out)])
        .arg("--save-rollouts")
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    metrics(out)
}

#[test]
fn grpo_on_a_vllm_server_syncs_weights_through_disk() {
    let python = oxrl_fixtures::peer_python();
    let dir = temp_dir("vllm-peer");
    let policy = policy(&dir);
    let log = dir.join("vllm.log");
    let flags = ["--skip-tokenizer-init", "--max-model-len", "128"];
    let server = VllmProcess::start(&python, &policy, &log, &flags);

    // Without sync the server samples from the start weights while the trainer moves on.
    let stale = train(
        &config(&dir, "none", &policy, &server.url, "none"),
        &dir.join("none"),
    );
    let stale_diff: Vec<f64> = stale
        .iter()
        .map(|m| m["rollout_logprob_diff"].as_f64().unwrap())
        .collect();
    assert!(
        stale_diff[0] <= 1e-5,
        "step 1 shares the start weights: {stale_diff:?}"
    );
    assert!(
        stale_diff[2] > 1e-3,
        "the unsynced diff should grow as the trainer moves: {stale_diff:?}"
    );

    // With sync, the server reloads every update: its log-probs are the trainer's.
    let synced_out = dir.join("disk");
    let synced = train(
        &config(&dir, "disk", &policy, &server.url, "disk"),
        &synced_out,
    );
    for (i, m) in synced.iter().enumerate() {
        let diff = m["rollout_logprob_diff"].as_f64().unwrap();
        assert!(diff <= 1e-5, "step {}: rollout_logprob_diff {diff}", i + 1);
        assert!(m["time/weight_sync"].as_f64().unwrap() > 0.0);
        let url = &server.url;
        assert_eq!(m[format!("server_errors/{url}")].as_f64(), Some(0.0), "{m}");
        assert!(m[format!("server_latency_s/{url}")].as_f64().unwrap() > 0.0);
    }
    for step in 1..=3u64 {
        let text = std::fs::read_to_string(synced_out.join(format!("rollouts/step-{step}.jsonl")))
            .unwrap();
        for line in text.lines() {
            let t: Value = serde_json::from_str(line).unwrap();
            assert_eq!(t["weight_version"].as_u64(), Some(step - 1), "{line}");
        }
    }
    // Two data-parallel ranks (torchrun) share the server: each samples its share of the
    // prompts there, rank 0 alone reloads the weights after each update and the other waits
    // for it; every sample of every rank comes from the current weights.
    let torchrun = python.with_file_name("torchrun");
    let ranks_out = dir.join("ranks");
    let r = Command::new(&torchrun)
        .args([
            "--nproc_per_node",
            "2",
            "--no-python",
            env!("CARGO_BIN_EXE_oxrl"),
        ])
        .args(["train", "--config"])
        .arg(config(&dir, "ranks", &policy, &server.url, "disk"))
        .args(["--output-dir", s(&ranks_out), "--save-rollouts"])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    for (i, m) in metrics(&ranks_out).iter().enumerate() {
        let diff = m["rollout_logprob_diff"].as_f64().unwrap();
        assert!(
            diff <= 1e-5,
            "2 ranks, step {}: rollout_logprob_diff {diff}",
            i + 1
        );
    }
    for step in 1..=3u64 {
        let text =
            std::fs::read_to_string(ranks_out.join(format!("rollouts/step-{step}.jsonl"))).unwrap();
        // Both ranks' samples (the whole batch: 4 prompts × 4), each from the current weights.
        assert_eq!(text.lines().count(), 16);
        for line in text.lines() {
            let t: Value = serde_json::from_str(line).unwrap();
            assert_eq!(t["weight_version"].as_u64(), Some(step - 1), "{line}");
        }
    }

    // LoRA: the server gets the base with the adapters merged in, step after step.
    let lora_config = config(&dir, "lora", &policy, &server.url, "disk");
    let text = std::fs::read_to_string(&lora_config).unwrap();
    std::fs::write(
        &lora_config,
        format!("{text}[model.lora]\nrank = 4\nalpha = 32\n"),
    )
    .unwrap();
    let lora = train(&lora_config, &dir.join("lora"));
    let lora_diff: Vec<f64> = lora
        .iter()
        .map(|m| m["rollout_logprob_diff"].as_f64().unwrap())
        .collect();
    assert!(lora_diff.iter().all(|d| *d <= 1e-5), "LoRA: {lora_diff:?}");
    assert!(dir
        .join("lora/checkpoint-3/adapter_model.safetensors")
        .exists());
    eprintln!(
        "rollout_logprob_diff: synced {:?}, unsynced {stale_diff:?}, LoRA {lora_diff:?}; weight_sync s {:?}",
        synced
            .iter()
            .map(|m| m["rollout_logprob_diff"].as_f64().unwrap())
            .collect::<Vec<_>>(),
        synced
            .iter()
            .map(|m| m["time/weight_sync"].as_f64().unwrap())
            .collect::<Vec<_>>()
    );
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
