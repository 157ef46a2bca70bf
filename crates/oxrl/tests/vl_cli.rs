//! `oxrl score` and `oxrl generate` with images, on the Qwen3-VL fixture: scores equal
//! transformers', greedy generation follows the training path's argmax, bad images are errors.

use candle_core::{DType, Device};
use oxrl_fixtures::{fixture, floats, ids, jsonl, temp_dir};
use oxrl_models::{ImageSource, Qwen3};
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Output};

fn oxrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("oxrl runs")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn score_with_images_matches_transformers_within_1e_4() {
    let dir = temp_dir("vl-cli-score");
    let out = dir.join("out.jsonl");
    let cases = fixture("qwen3-vl-tiny/cases.jsonl");
    let model = fixture("qwen3-vl-tiny");
    let r = oxrl(&[
        "score",
        "--model",
        s(&model),
        "--input",
        s(&cases),
        "--output",
        s(&out),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let (got, want) = (jsonl(&out), jsonl(&cases));
    assert_eq!(got.len(), want.len());
    for (n, (g, w)) in got.iter().zip(&want).enumerate() {
        let (lp, expected) = (floats(&g["logprobs"]), floats(&w["expected_logprobs"]));
        assert_eq!(lp.len(), expected.len(), "case {n}");
        for (a, b) in lp.iter().zip(&expected) {
            assert!((a - b).abs() <= 1e-4, "case {n}: {a} vs {b}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Greedy decoding of image prompts through the KV-cache engine picks, at every step, the
/// argmax of the training path's logits over the whole sequence so far.
#[test]
fn greedy_generation_with_images_follows_the_training_path() {
    let dir = temp_dir("vl-cli-generate");
    let fx = fixture("qwen3-vl-tiny");
    let cases = jsonl(&fx.join("cases.jsonl"));
    let input = dir.join("prompts.jsonl");
    let lines: Vec<String> = cases
        .iter()
        .filter(|c| c.get("images").is_some())
        .map(|c| {
            let images: Vec<String> = c["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| fx.join(n.as_str().unwrap()).display().to_string())
                .collect();
            json!({"prompt_ids": c["prompt_ids"], "images": images}).to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("out.jsonl");
    let r = oxrl(&[
        "generate",
        "--model",
        s(&fx),
        "--input",
        s(&input),
        "--output",
        s(&out),
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let got = jsonl(&out);
    assert_eq!(got.len(), lines.len());
    let model = Qwen3::load(&fx, DType::F32, &Device::Cpu).unwrap();
    for (line, g) in lines.iter().zip(&got) {
        let line: Value = serde_json::from_str(line).unwrap();
        let sources: Vec<ImageSource> = line["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| ImageSource::Path(p.as_str().unwrap().into()))
            .collect();
        let images = model.prepare_images(&sources).unwrap();
        let mut seq = model
            .expand_image_pads(&ids(&line["prompt_ids"]), &images)
            .unwrap();
        let response = ids(&g["response_ids"]);
        assert_eq!(response.len(), 6);
        for &t in &response {
            let logits = model.forward_with_images(&seq, &images).unwrap();
            let last = logits.get(seq.len() - 1).unwrap().to_vec1::<f32>().unwrap();
            let best = (0..last.len())
                .max_by(|&a, &b| last[a].total_cmp(&last[b]))
                .unwrap();
            assert_eq!(t as usize, best);
            seq.push(t);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_images_are_one_line_errors_that_name_the_line() {
    let dir = temp_dir("vl-cli-bad");
    let input = dir.join("bad.jsonl");
    let out = dir.join("out.jsonl");
    let run = |model: &Path, line: Value| {
        std::fs::write(&input, format!("{line}\n")).unwrap();
        let r = oxrl(&[
            "score",
            "--model",
            s(model),
            "--input",
            s(&input),
            "--output",
            s(&out),
        ]);
        assert!(!r.status.success());
        assert!(!out.exists(), "no output file on error");
        String::from_utf8_lossy(&r.stderr).to_string()
    };
    let vl = fixture("qwen3-vl-tiny");
    let e = run(
        &vl,
        json!({"prompt_ids": [1, 1002, 1000, 1003], "response_ids": [2], "images": ["missing.png"]}),
    );
    assert!(
        e.contains("bad.jsonl:1") && e.contains("missing.png"),
        "{e}"
    );
    let e = run(
        &vl,
        json!({"prompt_ids": [1, 1002, 1000, 1003, 1000], "response_ids": [2],
        "images": [fixture("qwen3-vl-tiny/img0.png")]}),
    );
    assert!(e.contains("image tokens"), "{e}");
    let e = run(
        &fixture("qwen3-tiny"),
        json!({"prompt_ids": [1], "response_ids": [2],
        "images": [fixture("qwen3-vl-tiny/img0.png")]}),
    );
    assert!(e.contains("no vision tower"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
