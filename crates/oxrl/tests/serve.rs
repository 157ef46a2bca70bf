//! `oxrl serve` over real HTTP: OpenAI's shapes, streaming that adds up to the non-streamed
//! answer, samples and log-probs equal to the offline engine's, concurrent requests batched
//! together, images, bad requests answered 4xx while the server keeps serving, the metrics
//! endpoint, and GRPO through the vLLM token route with weight reloads.

use candle_core::{DType, Device};
use oxrl_fixtures::{repo, temp_dir, ServeProcess};
use oxrl_models::Qwen3;
use oxrl_rollout::{Engine, LocalEngine, SamplerConfig, SamplingParams};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn demo_policy() -> PathBuf {
    repo().join("examples/arithmetic/policy")
}

fn serve(args: &[&str]) -> ServeProcess {
    ServeProcess::start(Path::new(env!("CARGO_BIN_EXE_oxrl")), args)
}

/// POSTs `body`; returns the status and the JSON answer, errors included.
fn post(url: &str, body: &Value) -> (u16, Value) {
    match ureq::post(url).send_json(body.clone()) {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
        Err(e) => panic!("{url}: {e}"),
    }
}

fn post_raw(url: &str, body: &str) -> (u16, Value) {
    match ureq::post(url)
        .set("Content-Type", "application/json")
        .send_string(body)
    {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap()),
        Err(e) => panic!("{url}: {e}"),
    }
}

/// The `data:` events of a streamed answer, up to `[DONE]` (which must come).
fn stream_events(url: &str, body: &Value) -> Vec<Value> {
    let text = ureq::post(url)
        .send_json(body.clone())
        .unwrap()
        .into_string()
        .unwrap();
    let data: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn metric(url: &str, name: &str) -> f64 {
    let text = ureq::get(&format!("{url}/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
        .parse()
        .unwrap()
}

/// Waits up to 2 s for `name` to read `want`: a request is counted just after its answer goes
/// out, so a client can read the metrics a moment before they include it.
fn assert_metric(url: &str, name: &str, want: f64) {
    let start = std::time::Instant::now();
    loop {
        let got = metric(url, name);
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(2),
            "{name}: {got}, expected {want}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn chat_streaming_adds_up_to_the_answer_and_models_lists_the_model() {
    let server = serve(&["--model", s(&demo_policy()), "--served-model-name", "demo"]);
    let models: Value = ureq::get(&format!("{}/v1/models", server.url))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(models["data"][0]["id"], "demo");

    let url = format!("{}/v1/chat/completions", server.url);
    let body = json!({"model": "demo", "messages": [{"role": "user", "content": "12+30"}],
        "max_tokens": 12, "n": 2, "seed": 4, "temperature": 1.0,
        "chat_template_kwargs": {"enable_thinking": false}});
    let (status, answer) = post(&url, &body);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"].as_array().unwrap().len(), 2);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = stream_events(&url, &streamed);
    for i in 0..2 {
        let text: String = events
            .iter()
            .flat_map(|e| e["choices"].as_array().unwrap().iter())
            .filter(|c| c["index"] == i)
            .filter_map(|c| c["delta"]["content"].as_str())
            .collect();
        let choice = &answer["choices"][i];
        assert_eq!(text, choice["message"]["content"].as_str().unwrap());
        let finish = events
            .iter()
            .flat_map(|e| e["choices"].as_array().unwrap().iter())
            .find(|c| c["index"] == i && !c["finish_reason"].is_null())
            .unwrap();
        assert_eq!(finish["finish_reason"], choice["finish_reason"]);
    }
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage, &answer["usage"]);
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk"));
}

/// Sample `j` of a request with seed `s` is what the offline engine samples for one prompt
/// with seed `s`: same tokens, same log-probs.
#[test]
fn samples_and_logprobs_are_the_offline_engines() {
    let policy = demo_policy();
    let server = serve(&["--model", s(&policy)]);
    let prompt: Vec<u32> = vec![257, 49, 50, 43, 51, 52, 61];
    let (status, answer) = post(
        &format!("{}/v1/completions", server.url),
        &json!({"prompt": prompt, "max_tokens": 10, "n": 3, "seed": 9, "temperature": 0.8,
            "top_k": 50, "logprobs": 0, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{answer}");
    let model = Arc::new(Qwen3::load(&policy, DType::F32, &Device::Cpu).unwrap());
    let mut engine = LocalEngine::new(model, None, vec![258]);
    let params = SamplingParams {
        n: 3,
        max_new_tokens: 10,
        sampler: SamplerConfig {
            temperature: 0.8,
            top_k: 50,
            ..Default::default()
        },
        seed: 9,
        ignore_eos: true,
        ..Default::default()
    };
    let want = engine.generate(&[prompt], &params).unwrap();
    for (j, w) in want[0].iter().enumerate() {
        let c = &answer["choices"][j];
        let lps: Vec<f64> = c["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(lps.len(), w.response_ids.len(), "sample {j}");
        for (a, b) in lps.iter().zip(&w.logprobs) {
            assert!((a - *b as f64).abs() < 1e-6, "sample {j}: {a} vs {b}");
        }
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(answer["usage"]["prompt_tokens"], 7);
    assert_eq!(answer["usage"]["completion_tokens"], 30);
}

/// Sixteen clients at once: each gets the answer it gets alone, and the engine ran far fewer
/// steps than tokens (the requests shared its batches).
#[test]
fn concurrent_requests_share_batches_and_each_gets_its_own_answer() {
    let server = serve(&["--model", s(&demo_policy())]);
    let url = format!("{}/v1/completions", server.url);
    let body = |i: u64| {
        json!({"prompt": format!("{i}+{i}="), "max_tokens": 16, "seed": i,
            "ignore_eos": true, "temperature": 1.0})
    };
    let alone: Vec<Value> = (0..16).map(|i| post(&url, &body(i)).1).collect();
    let steps_before = metric(&server.url, "oxrl_serve_engine_steps_total");
    let together: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let url = &url;
                scope.spawn(move || post(url, &body(i)).1)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"]);
    }
    let steps = metric(&server.url, "oxrl_serve_engine_steps_total") - steps_before;
    assert!(
        steps < 16.0 * 17.0 / 2.0,
        "{steps} engine steps for 16 concurrent requests of 16 tokens: they did not share batches"
    );
}

#[test]
fn bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving() {
    let dir = temp_dir("serve-bad");
    let image = dir.join("x.png");
    std::fs::copy(repo().join("examples/shapes/data/images/000.png"), &image).unwrap();
    let server = serve(&["--model", s(&demo_policy())]);
    let completions = format!("{}/v1/completions", server.url);
    let chat = format!("{}/v1/chat/completions", server.url);
    let long: Vec<u32> = vec![50; 200];
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        (
            &completions,
            json!({"model": "gpt-9", "prompt": "1+1="}),
            404,
            "gpt-9",
        ),
        (
            &completions,
            json!({"prompt": long}),
            400,
            "maximum context length is 128",
        ),
        (
            &completions,
            json!({"prompt": "1+1=", "max_tokens": -1}),
            400,
            "max_tokens",
        ),
        (
            &completions,
            json!({"prompt": "1+1=", "max_tokens": 500}),
            400,
            "lower max_tokens",
        ),
        (&completions, json!({"prompt": [1, 99999]}), 400, "99999"),
        (&completions, json!({"max_tokens": 3}), 400, "prompt"),
        (
            &completions,
            json!({"prompt": "x", "temperature": -1}),
            400,
            "temperature",
        ),
        (&chat, json!({"messages": []}), 400, "messages"),
        (&chat, json!({"messages": "hi"}), 400, "messages"),
        (
            &chat,
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": s(&image)}},
                {"type": "text", "text": "colour?"}]}]}),
            400,
            "--allowed-media-dir",
        ),
    ];
    for (url, body, status, says) in cases {
        let (got, answer) = post(url, &body);
        assert_eq!(got, status, "{body}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
        assert_eq!(answer["error"]["code"], status);
    }
    let (got, answer) = post_raw(&completions, "{\"prompt\": ");
    assert_eq!(got, 400);
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    let wrong_method = ureq::get(&completions).call().unwrap_err();
    assert!(matches!(wrong_method, ureq::Error::Status(405, _)));
    let (got, answer) = post(&format!("{}/pause", server.url), &json!({}));
    assert_eq!(got, 404, "control routes are off by default: {answer}");
    let (got, answer) = post(&completions, &json!({"prompt": "1+1=", "max_tokens": 4}));
    assert_eq!(got, 200, "{answer}");
    assert_metric(
        &server.url,
        "oxrl_serve_requests_total{route=\"/v1/completions\",status=\"400\"}",
        7.0,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Qwen3-VL chat request with an image as a data URL and by path (inside
/// `--allowed-media-dir`) samples what `oxrl generate --chat --image` samples.
#[test]
fn an_image_prompt_samples_what_generate_samples() {
    use base64::Engine as _;
    let vl = repo().join("examples/shapes/policy");
    let images = repo().join("examples/shapes/data/images");
    let png = images.join("002.png");
    let server = serve(&["--model", s(&vl), "--allowed-media-dir", s(&images)]);
    let data_url = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(std::fs::read(&png).unwrap())
    );
    let generated = std::process::Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["generate", "--model", s(&vl), "--chat", "--image", s(&png)])
        .args(["--prompt", "What colour is the shape?", "--seed", "2"])
        .args(["--max-new-tokens", "6", "--temperature", "0"])
        .output()
        .unwrap();
    assert!(
        generated.status.success(),
        "{}",
        String::from_utf8_lossy(&generated.stderr)
    );
    let want = String::from_utf8(generated.stdout).unwrap();
    for source in [data_url.as_str(), s(&png)] {
        let (status, answer) = post(
            &format!("{}/v1/chat/completions", server.url),
            &json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": source}},
                {"type": "text", "text": "What colour is the shape?"}]}],
                "max_tokens": 6, "temperature": 0, "seed": 2}),
        );
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            answer["choices"][0]["message"]["content"].as_str().unwrap(),
            want.trim_end_matches('\n')
        );
        assert!(
            answer["usage"]["prompt_tokens"].as_u64().unwrap() > 20,
            "image tokens count"
        );
    }
}

/// Past `--max-connections` requests in progress, another is answered 503 at once, and
/// served again once one finishes.
#[test]
fn requests_past_the_connection_limit_get_503_until_one_finishes() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let server = serve(&["--model", s(&demo_policy()), "--max-connections", "1"]);
    let models = format!("{}/v1/models", server.url);
    // Every probe on a fresh connection and with a time limit, so a stuck server fails the
    // test instead of hanging it.
    let probe = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(10))
        .max_idle_connections(0)
        .build();
    let status = |r: Result<ureq::Response, ureq::Error>| match r {
        Ok(r) => (r.status(), Value::Null),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json::<Value>().unwrap()),
        Err(e) => panic!("{models}: {e}"),
    };
    assert_eq!(status(probe.get(&models).call()).0, 200);
    // A request whose body never finishes arriving holds the one connection (large enough
    // that tiny_http hands it over before the body, as it does not for bodies under 1 KiB).
    let address = server.url.trim_start_matches("http://").to_string();
    let slow_request = |address: &str| {
        let mut slow = std::net::TcpStream::connect(address).unwrap();
        write!(
            slow,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 100000\r\n\r\n{{\"prompt\": "
        )
        .unwrap();
        slow.flush().unwrap();
        slow
    };
    // The slow request may arrive before the probe's slot is given back and be refused
    // itself; then it is sent again. A probe can also be refused by its own previous request,
    // whose slot is given back only after its answer went out: the slow request holds the slot
    // when a probe a moment later is refused too and the slow request got no answer.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (slow, refused) = 'held: loop {
        let mut slow = slow_request(&address);
        slow.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        loop {
            assert!(
                Instant::now() < deadline,
                "the slow request never held the slot"
            );
            match status(probe.get(&models).call()) {
                (503, _) => {
                    std::thread::sleep(Duration::from_millis(300));
                    let again = status(probe.get(&models).call());
                    let answered = slow.read(&mut [0u8; 1]).is_ok();
                    match (again, answered) {
                        ((503, body), false) => break 'held (slow, body),
                        (_, true) => break,
                        _ => {}
                    }
                }
                (200, _) if slow.read(&mut [0u8; 1]).is_ok() => break,
                _ => {}
            }
        }
    };
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("--max-connections"), "{message}");
    // A refused request whose body never arrives does not stop the server from answering.
    let mut refused_slow = slow_request(&address);
    refused_slow
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = [0u8; 12];
    refused_slow.read_exact(&mut answer).unwrap();
    assert_eq!(
        &answer, b"HTTP/1.1 503",
        "the refused client got its answer"
    );
    let started = Instant::now();
    assert_eq!(status(probe.get(&models).call()).0, 503);
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(slow);
    let deadline = Instant::now() + Duration::from_secs(10);
    while probe.get(&models).call().is_err() {
        assert!(Instant::now() < deadline, "the slot was never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_metrics_endpoint_reports_requests_tokens_and_latency() {
    let server = serve(&["--model", s(&demo_policy())]);
    let (status, answer) = post(
        &format!("{}/v1/completions", server.url),
        &json!({"prompt": "1+1=", "max_tokens": 5, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{answer}");
    assert_metric(&server.url, "oxrl_serve_generation_tokens_total", 5.0);
    assert_metric(&server.url, "oxrl_serve_prompt_tokens_total", 4.0);
    assert_metric(
        &server.url,
        "oxrl_serve_requests_total{route=\"/v1/completions\",status=\"200\"}",
        1.0,
    );
    assert_metric(
        &server.url,
        "oxrl_serve_request_duration_seconds_count",
        1.0,
    );
    assert_metric(
        &server.url,
        "oxrl_serve_time_to_first_token_seconds_count",
        1.0,
    );
    assert_metric(&server.url, "oxrl_serve_queue_depth", 0.0);
}

/// A demo's config with rollouts on the server at `url`, `edits` applied as
/// [`oxrl_fixtures::demo_config`] does.
fn train_config(
    demo: &str,
    dir: &Path,
    name: &str,
    (url, sync): (&str, &str),
    edits: &[(&str, &str)],
) -> PathBuf {
    let rollout =
        format!("[rollout]\nbackend = \"vllm\"\nserver_urls = [\"{url}\"]\nsync = \"{sync}\"\n");
    let mut all = vec![("[rollout]\n", rollout.as_str())];
    all.extend_from_slice(edits);
    oxrl_fixtures::demo_config(demo, &dir.join(format!("{name}.toml")), &all)
}

fn train(config: &Path, out: &Path) -> Vec<Value> {
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["train", "--config", s(config), "--output-dir", s(out)])
        .args(["--max-steps", "3", "--save-rollouts"])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|m| m.get("rollout_logprob_diff").is_some())
        .collect()
}

/// `backend = "vllm"` pointed at `oxrl serve`: with `sync = "disk"` the server reloads each
/// update (pause, `reload_weights`, resume, version) and its log-probs are the trainer's; with
/// `sync = "none"` they drift, which shows the reload really moved the weights.
#[test]
fn grpo_through_the_token_route_syncs_weights_through_disk() {
    let dir = temp_dir("serve-grpo");
    let server = serve(&["--model", s(&demo_policy()), "--control-routes"]);
    let synced_out = dir.join("disk");
    let synced = train(
        &train_config("arithmetic", &dir, "disk", (&server.url, "disk"), &[]),
        &synced_out,
    );
    for (i, m) in synced.iter().enumerate() {
        let diff = m["rollout_logprob_diff"].as_f64().unwrap();
        assert!(diff <= 1e-5, "step {}: rollout_logprob_diff {diff}", i + 1);
        assert_eq!(
            m[format!("server_errors/{}", server.url)].as_f64(),
            Some(0.0),
            "{m}"
        );
    }
    for step in 1..=3u64 {
        let text = std::fs::read_to_string(synced_out.join(format!("rollouts/step-{step}.jsonl")))
            .unwrap();
        for line in text.lines() {
            let t: Value = serde_json::from_str(line).unwrap();
            assert_eq!(t["weight_version"].as_u64(), Some(step - 1), "{line}");
        }
    }
    assert_eq!(metric(&server.url, "oxrl_serve_weight_version"), 3.0);

    // A fresh server, never synced: the trainer moves away from it.
    drop(server);
    let server = serve(&["--model", s(&demo_policy()), "--control-routes"]);
    let stale_config = train_config("arithmetic", &dir, "none", (&server.url, "none"), &[]);
    let text = std::fs::read_to_string(&stale_config)
        .unwrap()
        .replace("[trainer]\n", "[trainer]\nmax_staleness = 10\n");
    std::fs::write(&stale_config, text).unwrap();
    let stale = train(&stale_config, &dir.join("none"));
    let diffs: Vec<f64> = stale
        .iter()
        .map(|m| m["rollout_logprob_diff"].as_f64().unwrap())
        .collect();
    assert!(diffs[0] <= 1e-5, "{diffs:?}");
    assert!(
        diffs[2] > 1e-3,
        "unsynced log-probs should drift: {diffs:?}"
    );
    eprintln!(
        "rollout_logprob_diff: synced {:?}, unsynced {diffs:?}; weight_sync s {:?}",
        synced
            .iter()
            .map(|m| m["rollout_logprob_diff"].as_f64().unwrap())
            .collect::<Vec<_>>(),
        synced
            .iter()
            .map(|m| m["time/weight_sync"].as_f64().unwrap())
            .collect::<Vec<_>>()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The vision demo through the token route, as vLLM is sent it: each image's pads as one pad
/// and the picture as `content_parts`; the server expands them again and its log-probs are the
/// trainer's.
#[test]
fn grpo_with_image_prompts_through_the_token_route() {
    let dir = temp_dir("serve-grpo-vl");
    let vl = repo().join("examples/shapes/policy");
    let server = serve(&["--model", s(&vl), "--control-routes"]);
    let edits = [
        ("batch_size = 16", "batch_size = 2"),
        ("eval_every = 20", "eval_every = 0"),
    ];
    let config = train_config("shapes", &dir, "vl", (&server.url, "disk"), &edits);
    let steps = train(&config, &dir.join("out"));
    assert_eq!(steps.len(), 3);
    for (i, m) in steps.iter().enumerate() {
        let diff = m["rollout_logprob_diff"].as_f64().unwrap();
        assert!(diff <= 1e-5, "step {}: rollout_logprob_diff {diff}", i + 1);
    }
    assert_eq!(metric(&server.url, "oxrl_serve_weight_version"), 3.0);

    // Weights whose checkpoint would process images differently are refused, not served.
    let bare = dir.join("no-processor");
    std::fs::create_dir_all(&bare).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(vl.join(file), bare.join(file)).unwrap();
    }
    let rpc = json!({"method": "reload_weights", "kwargs": {"weights_path": s(&bare)}});
    let (status, answer) = post(&format!("{}/collective_rpc", server.url), &rpc);
    assert!(status >= 400, "{status} {answer}");
    assert!(
        answer.to_string().contains("processes images differently"),
        "{answer}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// 64 clients for 10 s from a second process (`oxrl bench serve`): every request answered, and
/// the server's memory after the first quarter stays where it was (no leak per request).
#[test]
fn sixty_four_clients_get_no_errors_and_the_server_does_not_grow() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["bench", "serve", "--model", s(&demo_policy())])
        .args([
            "--clients",
            "64",
            "--seconds",
            "10",
            "--new-tokens",
            "16",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["errors"], 0, "{r}");
    assert!(r["requests"].as_u64().unwrap() >= 64, "{r}");
    let (early, late) = (
        r["server_rss_mib_early"].as_f64().unwrap(),
        r["server_rss_mib_late"].as_f64().unwrap(),
    );
    assert!(early > 0.0, "{r}");
    assert!(
        late <= early * 1.25 + 32.0,
        "server memory grew under load: {r}"
    );
    eprintln!("{r}");
}
