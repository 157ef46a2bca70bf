//! GRPO with `[model.lora]` on the arithmetic demo: only the adapters train, the KL reference is
//! the base model with the adapters off, checkpoints hold the adapter in PEFT's format (no full
//! weights), `--resume` continues exactly, and `oxrl score --adapter` / `oxrl export --merge`
//! use the checkpoint as it is.

use oxrl_fixtures::temp_dir;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn oxrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn lora_config(dir: &Path, steps: usize, lora: &str) -> PathBuf {
    oxrl_fixtures::demo_config(
        "arithmetic",
        &dir.join("grpo.toml"),
        &[
            ("batch_size = 32", "batch_size = 4"),
            ("max_steps = 200", &format!("max_steps = {steps}")),
            ("save_every = 20", "save_every = 2"),
            ("eval_every = 20", "eval_every = 0"),
            ("kl_coef = 0.0", "kl_coef = 0.05"),
            ("lr = 1e-3", "lr = 2e-2"),
            ("[data]", &format!("{lora}\n[data]")),
        ],
    )
}

fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|m: &Value| m.get("reward_mean").is_some())
        .collect()
}

fn adapter(dir: &Path) -> std::collections::HashMap<String, Vec<f32>> {
    let path = dir.join("adapter_model.safetensors");
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

const LORA: &str = "[model.lora]\nrank = 4\nalpha = 8\ntarget_modules = \"all-linear\"\n";

#[test]
fn a_lora_run_trains_adapters_saves_them_as_peft_does_and_resumes_exactly() {
    let dir = temp_dir("lora-run");
    let config = lora_config(&dir, 4, LORA);
    let (whole, split) = (dir.join("whole"), dir.join("split"));
    ok(&oxrl(&[
        "train",
        "--config",
        s(&config),
        "--output-dir",
        s(&whole),
    ]));
    ok(&oxrl(&[
        "train",
        "--config",
        s(&config),
        "--output-dir",
        s(&split),
        "--max-steps",
        "2",
    ]));
    ok(&oxrl(&[
        "train",
        "--config",
        s(&config),
        "--output-dir",
        s(&split),
        "--resume",
    ]));
    let checkpoint = whole.join("checkpoint-4");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
        "tokenizer.json",
    ] {
        assert!(checkpoint.join(f).exists(), "{f}");
    }
    assert!(
        !checkpoint.join("model.safetensors").exists(),
        "a LoRA checkpoint holds the adapter, not the weights"
    );
    assert_eq!(
        adapter(&checkpoint),
        adapter(&split.join("checkpoint-4")),
        "the resumed adapter differs from the uninterrupted run's"
    );
    let (a, b) = (metrics(&whole), metrics(&split));
    assert_eq!(a.len(), 4);
    let key =
        |m: &[Value], k: &str| -> Vec<f64> { m.iter().map(|x| x[k].as_f64().unwrap()).collect() };
    assert_eq!(key(&a, "reward_mean"), key(&b, "reward_mean"));
    assert_eq!(key(&a, "kl"), key(&b, "kl"));
    // B starts at zero: the first step's policy is the base, which is the reference. After
    // updates the adapters move the policy away from it.
    let kl = key(&a, "kl");
    assert!(kl[0].abs() < 1e-7, "step 1 KL against the base: {kl:?}");
    assert!(kl[3] > 1e-6, "the adapters never moved the policy: {kl:?}");

    // Every B trained (they all started at zero).
    let trained = adapter(&checkpoint);
    assert_eq!(
        trained.len(),
        2 * 7 * 2,
        "2 layers × 7 projections × (A, B)"
    );
    for (name, values) in &trained {
        if name.ends_with("lora_B.weight") {
            assert!(values.iter().any(|v| *v != 0.0), "{name} never trained");
        }
    }

    // The checkpoint is a PEFT adapter of the base: score it as one, and merge it.
    let base = oxrl_fixtures::repo().join("examples/arithmetic/policy");
    let cases = dir.join("cases.jsonl");
    std::fs::write(
        &cases,
        "{\"prompt\": \"3+4=\", \"response\": \"7\"}\n{\"prompt\": \"9+9=\", \"response\": \"18\"}\n",
    )
    .unwrap();
    let score = |model: &Path, adapter: Option<&Path>| -> Vec<f64> {
        let mut args = vec!["score", "--model", s(model), "--input", s(&cases)];
        if let Some(a) = adapter {
            args.extend(["--adapter", s(a)]);
        }
        ok(&oxrl(&args))
            .lines()
            .flat_map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                v["logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let adapted = score(&base, Some(&checkpoint));
    let plain = score(&base, None);
    assert_ne!(adapted, plain);
    let merged = dir.join("merged");
    ok(&oxrl(&[
        "export",
        "--model",
        s(&base),
        "--adapter",
        s(&checkpoint),
        "--merge",
        "--output",
        s(&merged),
    ]));
    for (x, y) in score(&merged, None).iter().zip(&adapted) {
        assert!((x - y).abs() < 1e-5, "merged {x} vs adapted {y}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `oxrl sft` takes the same `[model.lora]` (here with dropout): its checkpoints are adapters
/// too, their `lora_dropout` recorded for PEFT.
#[test]
fn sft_trains_lora_adapters() {
    let dir = temp_dir("lora-sft");
    let example = oxrl_fixtures::repo().join("examples/arithmetic");
    let config = dir.join("sft.toml");
    let text = std::fs::read_to_string(example.join("sft.toml"))
        .unwrap()
        .replace("__INIT__", s(&example.join("policy")))
        .replace("data/sft.jsonl", s(&example.join("data/sft.jsonl")))
        .replace("max_steps = 300", "max_steps = 2")
        .replace("batch_size = 64", "batch_size = 8");
    std::fs::write(&config, format!("{text}\n{LORA}dropout = 0.1\n")).unwrap();
    let out = dir.join("out");
    ok(&oxrl(&[
        "sft",
        "--config",
        s(&config),
        "--output-dir",
        s(&out),
    ]));
    let checkpoint = out.join("checkpoint-2");
    assert!(!checkpoint.join("model.safetensors").exists());
    let trained = adapter(&checkpoint);
    assert!(trained
        .iter()
        .filter(|(n, _)| n.ends_with("lora_B.weight"))
        .all(|(_, v)| v.iter().any(|x| *x != 0.0)));
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoint.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(written["lora_dropout"], 0.1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn lora_settings_are_checked_with_file_line_and_key() {
    let dir = temp_dir("lora-config");
    for (lora, expected) in [
        ("[model.lora]\nrank = 0\n", "model.lora.rank"),
        (
            "[model.lora]\nrank = 4\ntarget_modules = [\"qkv\"]\n",
            "qkv",
        ),
        (
            "[model.lora]\nrank = 4\ndropout = 1.0\n",
            "model.lora.dropout",
        ),
        ("[model.lora]\nalpha = 8.0\n", "without [model.lora] rank"),
        ("[model.lora]\nrank = 4\nranks = 2\n", "model.lora.ranks"),
    ] {
        let config = lora_config(&dir, 1, lora);
        let out = oxrl(&["config", "--check", s(&config)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{lora}");
        assert!(err.contains(expected), "{lora}: {err}");
        assert!(err.contains("grpo.toml:"), "{lora}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
