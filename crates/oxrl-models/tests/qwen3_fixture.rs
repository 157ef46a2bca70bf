//! Qwen3 against the transformers reference outputs in `../shared/fixtures/qwen3-tiny/`.

use candle_core::{DType, Device, Tensor, D};
use oxrl_models::Qwen3;
use serde_json::Value;
use std::path::PathBuf;

fn fixture(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures")
        .join(rel);
    assert!(
        p.exists(),
        "fixture {} is absent: the tests need ../shared/fixtures beside the repository",
        p.display()
    );
    p
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn logprobs_match_transformers_within_1e_4() {
    let dir = fixture("qwen3-tiny");
    let model = Qwen3::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let cases = std::fs::read_to_string(dir.join("cases.jsonl")).unwrap();
    let mut n = 0;
    for line in cases.lines().filter(|l| !l.trim().is_empty()) {
        let case: Value = serde_json::from_str(line).unwrap();
        let t = case
            .get("temperature")
            .and_then(Value::as_f64)
            .unwrap_or(1.0);
        let got = model
            .score(&ids(&case["prompt_ids"]), &ids(&case["response_ids"]), t)
            .unwrap();
        let want: Vec<f64> = case["expected_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-4, "case {n}: {g} vs {w}");
        }
        n += 1;
    }
    assert_eq!(n, 5);
}

#[test]
fn greedy_path_matches_transformers() {
    let dir = fixture("qwen3-tiny");
    let model = Qwen3::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("greedy.json")).unwrap()).unwrap();
    let mut seq = ids(&g["prompt_ids"]);
    let n = g["max_new_tokens"].as_u64().unwrap() as usize;
    let mut new = Vec::new();
    for _ in 0..n {
        let input = Tensor::new(seq.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model.forward(&input).unwrap().squeeze(0).unwrap();
        let last = logits.get(seq.len() - 1).unwrap();
        let next = last.argmax(D::Minus1).unwrap().to_scalar::<u32>().unwrap();
        seq.push(next);
        new.push(next);
    }
    assert_eq!(new, ids(&g["expected_ids"]));
}
