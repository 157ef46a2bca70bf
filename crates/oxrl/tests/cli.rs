//! The `oxrl` binary end to end: `score` against the transformers fixture, text and chat inputs,
//! `generate` output, and bad input that must end in a one-line error with nothing written.

use candle_core::{DType, Device};
use oxrl_fixtures::{fixture, floats, ids, jsonl, temp_dir};
use oxrl_models::Qwen3;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
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

fn write_lines(path: &Path, lines: &[Value]) {
    let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    std::fs::write(path, text.join("\n") + "\n").unwrap();
}

/// A random Qwen3 whose vocabulary covers the real Qwen tokenizer, saved by oxrl with that
/// tokenizer beside it.
fn tiny_with_tokenizer(root: &Path) -> PathBuf {
    let dir = root.join("tiny-tok");
    let config = json!({"vocab_size": 151669, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 512, "tie_word_embeddings": true, "dtype": "float32"});
    let model = Qwen3::random(config, 3, DType::F32, &Device::Cpu).unwrap();
    model.save(&dir, Some(&fixture("qwen3-tokenizer"))).unwrap();
    dir
}

#[test]
fn score_matches_transformers_within_1e_4() {
    let dir = temp_dir("cli-score");
    let out = dir.join("out.jsonl");
    let cases = fixture("qwen3-tiny/cases.jsonl");
    let r = oxrl(&[
        "score",
        "--model",
        s(&fixture("qwen3-tiny")),
        "--input",
        s(&cases),
        "--output",
        s(&out),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let got = jsonl(&out);
    let want = jsonl(&cases);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        let (lp, expected) = (floats(&g["logprobs"]), floats(&w["expected_logprobs"]));
        assert_eq!(lp.len(), expected.len());
        for (a, b) in lp.iter().zip(&expected) {
            assert!((a - b).abs() <= 1e-4, "{a} vs {b}");
        }
        assert!((g["sum"].as_f64().unwrap() - lp.iter().sum::<f64>()).abs() < 1e-6);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn text_and_chat_inputs_score_like_their_ids() {
    let dir = temp_dir("cli-text");
    let model = tiny_with_tokenizer(&dir);
    let chat_case = &jsonl(&fixture("qwen3-tokenizer/chat_template_cases.jsonl"))[0];
    let messages = chat_case["messages"].clone();
    let chat_ids = ids(&chat_case["ids"]);
    let input = dir.join("in.jsonl");
    write_lines(
        &input,
        &[
            json!({"prompt": "Hello world", "response": " again"}),
            json!({"prompt_ids": [9707, 1879], "response_ids": [1549]}),
            json!({"messages": messages, "response_ids": [20, 151645]}),
            json!({"prompt_ids": chat_ids, "response_ids": [20, 151645]}),
        ],
    );
    let r = oxrl(&["score", "--model", s(&model), "--input", s(&input)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let lines: Vec<Value> = String::from_utf8(r.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    // " again" is one token (1549) in the Qwen vocabulary.
    assert_eq!(lines[0], lines[1]);
    assert_eq!(lines[2], lines[3]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_writes_one_line_per_sample() {
    let dir = temp_dir("cli-generate");
    let input = dir.join("prompts.jsonl");
    write_lines(
        &input,
        &[
            json!({"prompt_ids": [5, 6, 7]}),
            json!({"prompt_ids": [9, 8, 7, 6, 5, 4]}),
        ],
    );
    let out = dir.join("out.jsonl");
    let r = oxrl(&[
        "generate",
        "--model",
        s(&fixture("qwen3-tiny")),
        "--input",
        s(&input),
        "--output",
        s(&out),
        "--n",
        "3",
        "--max-new-tokens",
        "5",
        "--seed",
        "1",
        "--ignore-eos",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let lines = jsonl(&out);
    assert_eq!(lines.len(), 6);
    for l in &lines {
        assert_eq!(ids(&l["response_ids"]).len(), 5);
        assert_eq!(floats(&l["logprobs"]).len(), 5);
        assert_eq!(l["finish_reason"], "length");
    }
    assert_eq!(lines[3]["index"], 1);
    assert_eq!(lines[3]["sample"], 0);
    // A text prompt prints the decoded completion.
    let model = tiny_with_tokenizer(&dir);
    let r = oxrl(&[
        "generate",
        "--model",
        s(&model),
        "--prompt",
        "Hello",
        "--chat",
        "--max-new-tokens",
        "4",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(!r.stdout.is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each bad input ends with a non-zero exit, a one-line `error:` message naming the problem, and
/// no output file.
#[test]
fn bad_input_is_a_one_line_error_and_writes_nothing() {
    let dir = temp_dir("cli-bad");
    let tiny = fixture("qwen3-tiny");
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let malformed = write(
        "malformed.jsonl",
        "{\"prompt_ids\": [1], \"response_ids\": [2]}\n{\"prompt_ids\": [1\n",
    );
    let vocab = write(
        "vocab.jsonl",
        "{\"prompt_ids\": [1, 2000], \"response_ids\": [2]}\n",
    );
    let long = write(
        "long.jsonl",
        &format!(
            "{{\"prompt_ids\": {:?}, \"response_ids\": [2]}}\n",
            vec![1; 5000]
        ),
    );
    let no_response = write("noresp.jsonl", "{\"prompt_ids\": [1, 2]}\n");
    let text_no_tok = write("text.jsonl", "{\"prompt\": \"hi\", \"response\": \"x\"}\n");
    let missing = dir.join("absent.jsonl");
    let out = dir.join("out.jsonl");
    let cases: Vec<(PathBuf, &str)> = vec![
        (missing.clone(), "absent.jsonl"),
        (malformed, "malformed.jsonl:2"),
        (vocab, "2000"),
        (long, "4096"),
        (no_response, "response"),
        (text_no_tok, "tokenizer"),
    ];
    for (input, want) in cases {
        let r = oxrl(&[
            "score",
            "--model",
            s(&tiny),
            "--input",
            s(&input),
            "--output",
            s(&out),
        ]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{want}: should fail");
        assert!(
            err.starts_with("error: ") && err.trim_end().lines().count() == 1,
            "{err}"
        );
        assert!(err.contains(want), "{err} should name {want}");
        assert!(!out.exists(), "no output file after a failure");
    }
    let r = oxrl(&[
        "score",
        "--model",
        s(&tiny),
        "--input",
        s(&missing),
        "--dtype",
        "f8",
    ]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("f8"));
    let r = oxrl(&[
        "score",
        "--model",
        s(&dir.join("no-model")),
        "--input",
        s(&missing),
    ]);
    assert!(!r.status.success());
    // A hub id that is not cached, with the machine offline, says where it looked.
    let cache = dir.join("hub-cache");
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args([
            "generate",
            "--model",
            "NoSuchOrg/no-such-model",
            "--prompt",
            "hi",
        ])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HUB_CACHE", &cache)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        err.contains("looked in") && err.contains(s(&cache)),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench grpo-step` takes the shape, device and dtype it measures and says them back with the
/// phase times and the fraction of the matmul peak (one tiny bf16 step here; the figures
/// themselves are the benchmark's, not a test's).
#[test]
fn bench_grpo_step_reports_its_setup_and_phases() {
    let r = oxrl(&[
        "bench",
        "grpo-step",
        "--steps",
        "1",
        "--prompts",
        "2",
        "--n",
        "2",
        "--new-tokens",
        "2",
        "--dtype",
        "bf16",
        "--json",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(v["setup"], "w1 cpu bf16");
    for key in [
        "seconds_per_step",
        "time/rollout",
        "time/update",
        "achieved_gflops",
        "fraction_of_peak",
        "tokens_per_s",
        "rollout_tokens_per_s",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    assert!(
        v["peak_device_memory_gib"].is_null(),
        "a CPU has no device memory to watch"
    );
    let r = oxrl(&[
        "bench",
        "grpo-step",
        "--device",
        "cuda",
        "--shape",
        "qwen3-0.6b",
    ]);
    assert!(String::from_utf8_lossy(&r.stderr).contains("--features cuda"));
}
