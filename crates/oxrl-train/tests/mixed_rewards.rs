//! A GRPO run mixing every reward type with weights from the config: a rule, the sandboxed code
//! reward, a reward model (a tiny random `Qwen3ForSequenceClassification` saved here, named by
//! the flat `reward_model` key) and a remote HTTP service (a real local server started here).
//! Each function's score, failures and per-call latency reach metrics.jsonl, and the weighted
//! total is the reward.

use oxrl_fixtures::temp_dir;
use oxrl_train::{GrpoRun, RunConfig};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Answers every POST with 0.25 per item.
fn reward_service() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(&stream);
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let n = body["items"].as_array().map_or(0, Vec::len);
            let text = json!({ "scores": vec![0.25; n] }).to_string();
            let _ = write!(
                &stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
    url
}

/// A random reward model with the demo policy's tokenizer (vocabulary 272).
fn reward_model(dir: &Path) -> PathBuf {
    let out = dir.join("rm");
    let config = json!({"vocab_size": 272, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 128, "tie_word_embeddings": true, "num_labels": 1,
        "pad_token_id": 256});
    let rm = oxrl_models::Qwen3RewardModel::random(
        config,
        5,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    rm.save(&out, Some(&repo().join("examples/arithmetic/policy")))
        .unwrap();
    out
}

fn write_config(dir: &Path, url: &str) -> PathBuf {
    let data = dir.join("rows.jsonl");
    let rows: String = (0..4)
        .map(|i| {
            json!({"prompt": format!("{i}+1="), "answer": format!("{}", i + 1), "tests": "assert True"})
                .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let config = dir.join("mixed.toml");
    let policy = repo().join("examples/arithmetic/policy");
    std::fs::write(
        &config,
        format!(
            r#"reward_model = "{rm}"
[model]
path = "{policy}"
[data]
train_files = "{data}"
[rollout]
n_samples_per_prompt = 2
max_new_tokens = 4
[reward]
failure_score = -1.0
[[reward.functions]]
type = "math_answer"
name = "correct"
weight = 1.0
[[reward.functions]]
type = "code"
weight = 0.5
workers = 2
timeout_s = 2
[[reward.functions]]
type = "http"
name = "remote"
weight = 2.0
url = "{url}"
batch_size = 3
[trainer]
batch_size = 2
micro_batch_size = 4
max_steps = 1
lr = 1e-4
output_dir = "{out}"
"#,
            policy = policy.display(),
            data = data.display(),
            out = dir.join("out").display(),
            rm = reward_model(dir).display(),
        ),
    )
    .unwrap();
    config
}

#[test]
fn a_run_mixes_rule_code_model_and_remote_rewards() {
    let dir = temp_dir("mixed-rewards");
    let config = write_config(&dir, &reward_service());
    let cfg = RunConfig::from_file(&config).unwrap();
    let mut run = GrpoRun::new(cfg, false, false).unwrap();
    run.run(1, &oxrl_train::Interrupt::default()).unwrap();
    let text = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
    let m: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let get = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {m}"));
    for name in ["correct", "code", "remote", "reward_model"] {
        assert_eq!(get(&format!("reward_failures/{name}")), 0.0, "{name}");
        assert!(get(&format!("reward_latency_s/{name}")) >= 0.0, "{name}");
    }
    // The tiny policy writes no code blocks: the code reward scores 0 without failing.
    assert_eq!(get("reward/code"), 0.0);
    assert_eq!(get("reward/remote"), 0.25);
    let rm = get("reward/reward_model");
    assert!(rm != 0.0 && rm.is_finite(), "{rm}");
    let want = get("reward/correct") + 2.0 * 0.25 + rm;
    assert!((get("reward_mean") - want).abs() < 1e-12, "{m}");
}

/// `examples/code/grpo.toml` is a valid config (what `oxrl config --check` runs), and every
/// row's reference solution passes that row's tests under its code reward.
#[test]
fn the_code_example_is_valid_and_its_references_pass() {
    use oxrl_reward::RewardFn;
    let cfg = RunConfig::from_file(&repo().join("examples/code/grpo.toml")).unwrap();
    let code = cfg
        .reward
        .functions
        .iter()
        .find_map(|f| match &f.kind {
            oxrl_train::config::RewardKind::Code(spec) => Some(spec.clone()),
            _ => None,
        })
        .unwrap();
    let reward = oxrl_reward::CodeReward::new(code).unwrap();
    let rows = std::fs::read_to_string(&cfg.data.train_files[0]).unwrap();
    for line in rows.lines() {
        let row: serde_json::Map<String, Value> = serde_json::from_str(line).unwrap();
        let reference = row["reference"].as_str().unwrap().to_string();
        let input = oxrl_reward::RewardInput {
            prompt: row["prompt"].as_str().unwrap().into(),
            response: format!("```python\n{reference}\n```"),
            row: row.clone(),
            response_tokens: 0,
        };
        assert_eq!(reward.score(&input).unwrap(), 1.0, "{line}");
        let wrong = oxrl_reward::RewardInput {
            response: "```python\nprint('?')\n```".into(),
            ..input
        };
        assert!(reward.score(&wrong).unwrap() < 1.0, "{line}");
    }
}
