//! The checkpoints oxrl writes are Hugging Face checkpoints: transformers' Auto classes load
//! them (`AutoModelForCausalLM` for Qwen3, `AutoModelForImageTextToText` for Qwen3-VL) with
//! `AutoTokenizer`, and give the same log-probs as `oxrl score` to 1e-4. The peer is the real
//! transformers in the pinned venv that `.ci/python-env` makes (run here if it is missing).

use oxrl_fixtures::temp_dir;
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One training step of a bundled demo, so the checkpoint is one oxrl wrote after an update.
fn trained_checkpoint(demo: &str, out: &Path) -> PathBuf {
    let config = oxrl_fixtures::demo_config(demo, &out.with_extension("toml"), &[]);
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["train", "--config", s(&config), "--output-dir", s(out)])
        .args(["--max-steps", "1"])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    out.join("checkpoint-1")
}

fn oxrl_logprobs(checkpoint: &Path, cases: &Path) -> Vec<Vec<f64>> {
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["score", "--model", s(checkpoint), "--input", s(cases)])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    String::from_utf8(r.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

fn transformers_logprobs(python: &Path, checkpoint: &Path, cases: &str) -> Vec<Value> {
    let script = repo().join("crates/oxrl/tests/peers/transformers_logprobs.py");
    let mut child = Command::new(python)
        .arg(script)
        .arg(checkpoint)
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(cases.as_bytes())
        .unwrap();
    let r = child.wait_with_output().unwrap();
    assert!(
        r.status.success(),
        "transformers could not load {}: {}",
        checkpoint.display(),
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8(r.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn transformers_loads_oxrl_checkpoints_with_the_same_logprobs() {
    let python = oxrl_fixtures::peer_python();
    let dir = temp_dir("transformers-peer");
    let demos = [
        (
            "arithmetic",
            "Qwen3ForCausalLM",
            vec![("3+4=", "7"), ("9+9=", "18")],
        ),
        (
            "shapes",
            "Qwen3VLForConditionalGeneration",
            vec![("What colour is the shape?", "red"), ("a shape", "blue")],
        ),
    ];
    for (demo, class, texts) in demos {
        let checkpoint = trained_checkpoint(demo, &dir.join(demo));
        let lines: Vec<String> = texts
            .iter()
            .map(|(p, r)| json!({"prompt": p, "response": r}).to_string())
            .collect();
        let cases = dir.join(format!("{demo}-cases.jsonl"));
        std::fs::write(&cases, lines.join("\n") + "\n").unwrap();
        let ours = oxrl_logprobs(&checkpoint, &cases);
        let theirs = transformers_logprobs(&python, &checkpoint, &(lines.join("\n") + "\n"));
        assert_eq!(ours.len(), theirs.len());
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(b["class"], class, "{demo}");
            let b: Vec<f64> = b["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(a.len(), b.len(), "{demo} case {i}: the tokenizers disagree");
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(worst <= 1e-4, "{demo} case {i}: max |Δ log-prob| {worst}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
