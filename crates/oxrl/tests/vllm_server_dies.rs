//! A rollout server that dies in the middle of a run: the step fails with an `error:` naming
//! the server, the checkpoints already written stay complete, and once the server is back
//! `--resume` finishes the run. The server is a small stand-in for vLLM's routes (health,
//! token-in generation with weight-version stamps, pause / reload / resume / version).

use oxrl_fixtures::{demo_config, read_http_request, temp_dir, write_http_json};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The stand-in server's state: alive or not, the weight version it stamps, requests seen.
#[derive(Default)]
struct Fake {
    down: AtomicBool,
    version: Mutex<String>,
    generations: AtomicU64,
}

impl Fake {
    fn answer(&self, path: &str, body: &Value) -> Value {
        if path.starts_with("/update_weight_version") {
            *self.version.lock().unwrap() = body["new_version"].as_str().unwrap().to_string();
        }
        if !path.starts_with("/inference/v1/generate") {
            return json!({"success": true});
        }
        let k = self.generations.fetch_add(1, Ordering::SeqCst);
        let n = body["sampling_params"]["n"].as_u64().unwrap();
        let version = self.version.lock().unwrap().clone();
        let choices: Vec<Value> = (0..n)
            .map(|i| {
                // Digits and '=' of the demo's byte-level vocabulary, varied per sample.
                let ids: Vec<u64> = vec![48 + (k + i) % 10, 48 + (k * 3 + i) % 10];
                json!({"index": i, "finish_reason": "length", "token_ids": ids,
                       "logprobs": {"content": ids.iter().map(|t| json!({"token_id": t, "logprob": -1.0})).collect::<Vec<_>>()},
                       "weight_versions": [{"version": version, "start": 0, "end": 2}]})
            })
            .collect();
        json!({ "choices": choices })
    }
}

fn serve() -> (String, Arc<Fake>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let fake = Arc::new(Fake::default());
    let state = fake.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let state = state.clone();
            std::thread::spawn(move || {
                if state.down.load(Ordering::SeqCst) {
                    return; // Dropped unanswered: the client sees the connection close.
                }
                let Some((path, body)) = read_http_request(&stream) else {
                    return;
                };
                let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
                write_http_json(&stream, "200 OK", &state.answer(&path, &body).to_string());
            });
        }
    });
    (url, fake)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_server_that_dies_mid_run_fails_the_step_and_resume_finishes() {
    let dir = temp_dir("vllm-dies");
    let (url, fake) = serve();
    let rollout = format!(
        "[rollout]\nbackend = \"vllm\"\nserver_urls = [\"{url}\"]\nmax_retries = 1\n\
         request_timeout_s = 5.0\n"
    );
    let config = demo_config(
        "arithmetic",
        &dir.join("grpo.toml"),
        &[
            ("[rollout]\n", &rollout),
            ("batch_size = 32", "batch_size = 2"),
            ("max_steps = 200", "max_steps = 4"),
            ("save_every = 20", "save_every = 1"),
        ],
    );
    let out = dir.join("run");
    let train = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_oxrl"))
            .args(["train", "--config", s(&config), "--output-dir", s(&out)])
            .args(extra)
            .output()
            .unwrap()
    };
    let first = train(&["--max-steps", "2"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    fake.down.store(true, Ordering::SeqCst);
    let failed = train(&["--resume"]);
    let err = String::from_utf8_lossy(&failed.stderr);
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert_eq!(failed.status.code(), Some(1), "{err}");
    assert!(last.starts_with("error: ") && last.contains(&url), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for step in 1..=2 {
        assert!(
            out.join(format!("checkpoint-{step}/trainer_state.json"))
                .exists(),
            "checkpoint-{step} is incomplete"
        );
    }
    assert!(!out.join("checkpoint-3").exists());
    fake.down.store(false, Ordering::SeqCst);
    let resumed = train(&["--resume"]);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert!(out.join("checkpoint-4/trainer_state.json").exists());
    assert_eq!(*fake.version.lock().unwrap(), "v4");
    std::fs::remove_dir_all(&dir).unwrap();
}
