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
        let prompt = model
            .expand_image_pads(&ids(&line["prompt_ids"]), &images)
            .unwrap();
        let response = ids(&g["response_ids"]);
        assert_eq!(response.len(), 6);
        // Any generated image pad is text: the training path is told where the prompt ends.
        for k in 0..response.len() {
            let logits = model
                .forward_with_images(&prompt, &response[..k], &images)
                .unwrap();
            let last = logits
                .get(prompt.len() + k - 1)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let best = (0..last.len())
                .max_by(|&a, &b| last[a].total_cmp(&last[b]))
                .unwrap();
            assert_eq!(response[k] as usize, best);
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

fn safetensors(path: &Path) -> std::collections::HashMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// `oxrl train --rollouts` on image trajectories (the compact pad form, images by path): one
/// update moves the vision tower's weights too, unless `freeze_vision` keeps them.
#[test]
fn a_vl_replay_step_trains_the_vision_tower_unless_frozen() {
    let dir = temp_dir("vl-replay");
    let fx = fixture("qwen3-vl-tiny");
    let rollouts = dir.join("rollouts.jsonl");
    let mut lines = Vec::new();
    for (k, c) in jsonl(&fx.join("cases.jsonl")).iter().enumerate() {
        let images: Vec<String> = c
            .get("images")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|n| fx.join(n.as_str().unwrap()).display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        lines.push(
            json!({"uid": format!("g{}", k / 2), "prompt_ids": c["prompt_ids"],
                "response_ids": c["response_ids"], "reward": (k % 2) as f64, "images": images})
            .to_string(),
        );
    }
    std::fs::write(&rollouts, lines.join("\n")).unwrap();
    let before = safetensors(&fx.join("model.safetensors"));
    for freeze in [false, true] {
        let config = dir.join(format!("grpo-{freeze}.toml"));
        std::fs::write(
            &config,
            format!(
                "[model]\npath = \"{}\"\nfreeze_vision = {freeze}\n[algorithm]\nkl_coef = 0.01\n\
                 [trainer]\nmicro_batch_size = 2\nlr = 1e-3\n",
                s(&fx)
            ),
        )
        .unwrap();
        let out = dir.join(format!("out-{freeze}"));
        let r = oxrl(&[
            "train",
            "--config",
            s(&config),
            "--rollouts",
            s(&rollouts),
            "--max-steps",
            "1",
            "--output-dir",
            s(&out),
        ]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let metrics: Value = serde_json::from_str(
            std::fs::read_to_string(out.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        assert!(metrics["loss"].as_f64().unwrap().is_finite());
        assert!(metrics["grad_norm"].as_f64().unwrap() > 0.0);
        let after = safetensors(&out.join("checkpoint-1/model.safetensors"));
        assert_eq!(after.len(), before.len());
        let moved = |name: &str| after[name] != before[name];
        assert!(moved("model.language_model.layers.0.mlp.up_proj.weight"));
        assert_eq!(
            moved("model.visual.blocks.0.attn.qkv.weight"),
            !freeze,
            "freeze_vision = {freeze}"
        );
        assert_eq!(moved("model.visual.patch_embed.proj.weight"), !freeze);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The vision demo's config with absolute paths, `steps` steps and `edits` applied.
fn shapes_config(dir: &Path, steps: usize, edits: &[(&str, &str)]) -> std::path::PathBuf {
    let shapes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/shapes");
    let mut text = std::fs::read_to_string(shapes.join("grpo.toml"))
        .unwrap()
        .replace(
            "path = \"policy\"",
            &format!("path = \"{}\"", s(&shapes.join("policy"))),
        )
        .replace(
            "\"data/prompts.jsonl\"",
            &format!("\"{}\"", s(&shapes.join("data/prompts.jsonl"))),
        )
        .replace("max_steps = 60", &format!("max_steps = {steps}"));
    for (from, to) in edits {
        text = text.replace(from, to);
    }
    let config = dir.join("grpo.toml");
    std::fs::write(&config, text).unwrap();
    config
}

fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A short run of the vision demo: sampling, rewards and updates on image prompts raise the
/// reward, and greedy validation on the pictures ran before and after.
#[test]
fn the_shapes_demo_learns() {
    let dir = temp_dir("shapes-demo");
    let config = shapes_config(&dir, DEMO_TEST_STEPS, &[]);
    let out = dir.join("run");
    let r = oxrl(&["train", "--config", s(&config), "--output-dir", s(&out)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let lines = metrics(&out);
    let rewards: Vec<f64> = lines
        .iter()
        .filter_map(|l| l["reward_mean"].as_f64())
        .collect();
    assert_eq!(rewards.len(), DEMO_TEST_STEPS);
    let first: f64 = rewards[..10].iter().sum::<f64>() / 10.0;
    let last: f64 = rewards[rewards.len() - 10..].iter().sum::<f64>() / 10.0;
    assert!(last - first >= 0.1, "reward {first:.3} → {last:.3}");
    assert!(lines[0]["val/reward_mean"].is_number());
    assert!(lines.last().unwrap()["val/reward/correct"].is_number());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A VL run of 4 steps equals one of 2 steps resumed for 2 more: weights (vision tower
/// included) and rewards; checkpoints carry the image processor's settings.
#[test]
fn a_vl_run_resumes_exactly() {
    let dir = temp_dir("vl-resume");
    let config = shapes_config(
        &dir,
        4,
        &[
            ("batch_size = 16", "batch_size = 4"),
            ("save_every = 20", "save_every = 2"),
            ("eval_every = 20", "eval_every = 100"),
        ],
    );
    let (whole, split) = (dir.join("whole"), dir.join("split"));
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["train", "--config", s(&config), "--output-dir", s(out)];
        args.extend(extra);
        let r = oxrl(&args);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    };
    run(&whole, &[]);
    run(&split, &["--max-steps", "2"]);
    run(&split, &["--resume"]);
    let ckpt = |d: &Path| safetensors(&d.join("checkpoint-4/model.safetensors"));
    assert_eq!(ckpt(&whole), ckpt(&split), "resumed weights differ");
    let rewards = |d: &Path| -> Vec<f64> {
        metrics(d)
            .iter()
            .filter_map(|l| l["reward_mean"].as_f64())
            .collect()
    };
    assert_eq!(rewards(&whole), rewards(&split));
    assert!(whole.join("checkpoint-4/preprocessor_config.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Steps of the demo's test run: the whole demo. The seeded run's path depends on the CPU's
/// matmul kernels (AVX-512 rounds differently from AVX2); on an AVX-512 machine the reward only
/// starts to climb after step 40 (0.17 → 0.23 over 40 steps, 0.17 → 0.44 over 60).
const DEMO_TEST_STEPS: usize = 60;
