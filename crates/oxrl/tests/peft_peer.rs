//! LoRA adapters cross between oxrl and the real PEFT package (pinned in the venv that
//! `.ci/python-env` makes) in both directions: PEFT's `PeftModel.from_pretrained` on an adapter
//! oxrl saved gives the log-probs of `oxrl score --adapter`, an adapter PEFT made scores the
//! same in oxrl, and `oxrl export --merge` writes a plain checkpoint transformers loads with
//! those log-probs, all within 1e-4, on qwen3-tiny and qwen3-vl-tiny.

use candle_core::{DType, Device, Tensor};
use oxrl_fixtures::{fixture, peer_python, repo, temp_dir};
use oxrl_models::{LoraConfig, LoraInit, Qwen3};
use serde_json::{json, Value};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Token-id cases inside both fixtures' vocabularies.
fn cases() -> String {
    [
        (vec![5, 17, 42, 99, 7], vec![12, 64, 3]),
        (vec![88, 1, 30], vec![9, 9, 250, 31, 4]),
    ]
    .iter()
    .map(|(p, r)| json!({"prompt_ids": p, "response_ids": r}).to_string() + "\n")
    .collect()
}

fn oxrl(args: &[&str]) -> String {
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(args)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    String::from_utf8(r.stdout).unwrap()
}

fn logprobs(lines: &str) -> Vec<Vec<f64>> {
    lines
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

fn oxrl_score(model: &Path, adapter: Option<&Path>, cases: &Path) -> Vec<Vec<f64>> {
    let mut args = vec!["score", "--model", s(model), "--input", s(cases)];
    if let Some(a) = adapter {
        args.extend(["--adapter", s(a)]);
    }
    logprobs(&oxrl(&args))
}

/// transformers' log-probs of the cases, through PEFT when `adapter` is given.
fn peer_score(model: &Path, adapter: Option<&Path>, cases: &str) -> Vec<Vec<f64>> {
    let script = repo().join("crates/oxrl/tests/peers/transformers_logprobs.py");
    let mut cmd = Command::new(peer_python());
    cmd.arg(script).arg(model).arg("float32");
    if let Some(a) = adapter {
        cmd.arg(a);
    }
    let mut child = cmd
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
        "the peer could not score {} (adapter {adapter:?}): {}",
        model.display(),
        String::from_utf8_lossy(&r.stderr)
    );
    logprobs(&String::from_utf8(r.stdout).unwrap())
}

fn assert_close(ours: &[Vec<f64>], theirs: &[Vec<f64>], what: &str) -> f64 {
    assert_eq!(ours.len(), theirs.len(), "{what}");
    let mut worst = 0f64;
    for (a, b) in ours.iter().zip(theirs) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst <= 1e-4, "{what}: max |Δ log-prob| {worst}");
    worst
}

/// An oxrl adapter whose `B` is not zero (a fresh one changes nothing, which would test
/// nothing).
fn oxrl_adapter(base: &Path, out: &Path, config: &LoraConfig) {
    let mut model = Qwen3::load(base, DType::F32, &Device::Cpu).unwrap();
    model.attach_lora(config, 11).unwrap();
    for layer in &mut model.model.layers {
        let adapters = layer
            .self_attn
            .lora
            .iter_mut()
            .chain(layer.mlp.lora.iter_mut());
        for (k, adapter) in adapters.flatten().enumerate() {
            let (rows, r) = adapter.b.dims2().unwrap();
            let v: Vec<f32> = (0..rows * r)
                .map(|i| (((i * 7 + k * 3) % 13) as f32 - 6.0) * 0.03)
                .collect();
            adapter.b = Tensor::from_vec(v, (rows, r), &Device::Cpu).unwrap();
        }
    }
    model.save_adapter(out, s(base)).unwrap();
}

#[test]
fn peft_loads_oxrl_adapters_with_the_same_logprobs() {
    let dir = temp_dir("peft-loads-oxrl");
    let cases_text = cases();
    let cases = dir.join("cases.jsonl");
    std::fs::write(&cases, &cases_text).unwrap();
    let all: Vec<String> = oxrl_models::LORA_TARGETS
        .iter()
        .map(|t| t.to_string())
        .collect();
    for (fixture_name, targets, rslora) in [
        ("qwen3-tiny", all, false),
        (
            "qwen3-vl-tiny",
            vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
            true,
        ),
    ] {
        let base = fixture(fixture_name);
        let adapter = dir.join(fixture_name);
        let config = LoraConfig {
            rank: 4,
            alpha: 16.0,
            dropout: 0.0,
            targets,
            init: LoraInit::Kaiming,
            rslora,
        };
        oxrl_adapter(&base, &adapter, &config);
        let ours = oxrl_score(&base, Some(&adapter), &cases);
        let theirs = peer_score(&base, Some(&adapter), &cases_text);
        let worst = assert_close(&ours, &theirs, fixture_name);
        // The adapter matters: without it the scores move.
        let plain = oxrl_score(&base, None, &cases);
        let moved = ours
            .iter()
            .flatten()
            .zip(plain.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            moved > 1e-2,
            "{fixture_name}: the adapter moved nothing ({moved})"
        );
        eprintln!(
            "{fixture_name}: oxrl adapter in PEFT: max |Δ| {worst:.2e} (adapter moved {moved:.3})"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn oxrl_applies_and_merges_pefts_adapters_with_the_same_logprobs() {
    let dir = temp_dir("oxrl-loads-peft");
    let cases_text = cases();
    let cases = dir.join("cases.jsonl");
    std::fs::write(&cases, &cases_text).unwrap();
    let script = repo().join("crates/oxrl/tests/peers/peft_adapter.py");
    for (fixture_name, rslora, targets) in [
        (
            "qwen3-tiny",
            "1",
            "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        ),
        ("qwen3-vl-tiny", "0", "k_proj,o_proj,up_proj"),
    ] {
        let base = fixture(fixture_name);
        let adapter = dir.join(format!("{fixture_name}-adapter"));
        let r = Command::new(peer_python())
            .arg(&script)
            .args([s(&base), s(&adapter), "4", "8", rslora, targets])
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let theirs = peer_score(&base, Some(&adapter), &cases_text);
        let ours = oxrl_score(&base, Some(&adapter), &cases);
        let worst = assert_close(&ours, &theirs, fixture_name);

        let merged = dir.join(format!("{fixture_name}-merged"));
        oxrl(&[
            "export",
            "--model",
            s(&base),
            "--adapter",
            s(&adapter),
            "--merge",
            "--output",
            s(&merged),
        ]);
        let merged_theirs = peer_score(&merged, None, &cases_text);
        let merged_worst = assert_close(&merged_theirs, &theirs, fixture_name);
        eprintln!(
            "{fixture_name}: PEFT adapter in oxrl: max |Δ| {worst:.2e}; merged in transformers: {merged_worst:.2e}"
        );
    }
    // An adapter directory without --merge is not an HF export.
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["export", "--model", s(&fixture("qwen3-tiny")), "--adapter"])
        .arg(dir.join("qwen3-tiny-adapter"))
        .args(["--output", s(&dir.join("refused"))])
        .output()
        .unwrap();
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("--merge"));
    assert!(!dir.join("refused").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
