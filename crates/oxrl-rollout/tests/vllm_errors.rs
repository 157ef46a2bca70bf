//! The vLLM engine against a small HTTP server that misbehaves on purpose: a 5xx is retried and
//! the request then succeeds; malformed JSON, a hung server and a server that is not there
//! are clear errors naming the URL, after the retries they allow and never later than the
//! timeouts say.

use oxrl_fixtures::{read_http_request, write_http_json};
use oxrl_rollout::{Engine, SamplingParams, VllmEngine, VllmSpec, WeightSync};
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the test server answers a generation request.
#[derive(Clone, Copy)]
enum Behaviour {
    /// `failures` answers of 500, then a valid one.
    FailThenAnswer { failures: usize },
    /// 200 with a body that is not JSON.
    Malformed,
    /// Reads the request and never answers.
    Hang,
    /// 404 on the token route; `/v1/completions` answers.
    NoTokenRoute,
}

const ANSWER: &str = r#"{"choices": [{"index": 0, "finish_reason": "length", "token_ids": [5, 6],
    "logprobs": {"content": [{"token_id": 5, "logprob": -0.25}, {"token_id": 6, "logprob": -0.5}]},
    "weight_versions": [{"version": "v0", "start": 0, "end": 2}]}]}"#;

const COMPLETIONS_ANSWER: &str = r#"{"choices": [
    {"index": 1, "finish_reason": "stop", "token_ids": [8], "logprobs": {"token_logprobs": [-0.75]}},
    {"index": 0, "finish_reason": "length", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.25, -0.5]}}]}"#;

/// Serves `/health` and generation requests as `behaviour` says; counts generation requests.
fn serve(behaviour: Behaviour) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let generations = Arc::new(AtomicUsize::new(0));
    let seen = generations.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let seen = seen.clone();
            std::thread::spawn(move || {
                let Some((path, _)) = read_http_request(&stream) else {
                    return;
                };
                if path == "/health" {
                    return write_http_json(&stream, "200 OK", "");
                }
                let n = seen.fetch_add(1, Ordering::SeqCst);
                match behaviour {
                    Behaviour::FailThenAnswer { failures } if n < failures => write_http_json(
                        &stream,
                        "500 Internal Server Error",
                        r#"{"error": "busy"}"#,
                    ),
                    Behaviour::FailThenAnswer { .. } => write_http_json(&stream, "200 OK", ANSWER),
                    Behaviour::Malformed => {
                        write_http_json(&stream, "200 OK", "{\"choices\": [ oops")
                    }
                    Behaviour::Hang => std::thread::sleep(Duration::from_secs(30)),
                    Behaviour::NoTokenRoute if path == "/inference/v1/generate" => {
                        write_http_json(&stream, "404 Not Found", r#"{"detail": "Not Found"}"#)
                    }
                    Behaviour::NoTokenRoute => {
                        write_http_json(&stream, "200 OK", COMPLETIONS_ANSWER)
                    }
                }
            });
        }
    });
    (url, generations)
}

fn spec(url: &str, retries: u32) -> VllmSpec {
    VllmSpec {
        server_urls: vec![url.to_string()],
        sync: WeightSync::Disk,
        sync_dir: None,
        timeout: Duration::from_secs(1),
        max_retries: retries,
        backoff: Duration::from_millis(10),
    }
}

fn engine(url: &str, retries: u32) -> VllmEngine {
    VllmEngine::connect(spec(url, retries), Path::new("/tmp/unused"), None, vec![2]).unwrap()
}

fn generate(
    engine: &mut VllmEngine,
) -> oxrl_rollout::engine::Result<Vec<Vec<oxrl_rollout::Completion>>> {
    engine.generate(&[vec![1, 2, 3]], &SamplingParams::default())
}

#[test]
fn a_5xx_is_retried_and_then_succeeds() {
    let (url, calls) = serve(Behaviour::FailThenAnswer { failures: 2 });
    let mut e = engine(&url, 3);
    let out = generate(&mut e).unwrap();
    assert_eq!(out[0][0].response_ids, vec![5, 6]);
    assert_eq!(out[0][0].logprobs, vec![-0.25, -0.5]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let m = e.take_metrics();
    assert_eq!(m[&format!("server_errors/{url}")], 2.0);
}

#[test]
fn too_many_5xx_fail_with_the_url_and_the_answer() {
    let (url, calls) = serve(Behaviour::FailThenAnswer { failures: 10 });
    let err = generate(&mut engine(&url, 1)).unwrap_err().to_string();
    assert!(
        err.contains(&url)
            && err.contains("500")
            && err.contains("busy")
            && err.contains("2 attempts"),
        "{err}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn malformed_json_fails_at_once() {
    let (url, calls) = serve(Behaviour::Malformed);
    let err = generate(&mut engine(&url, 3)).unwrap_err().to_string();
    assert!(err.contains(&url) && err.contains("not JSON"), "{err}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a malformed answer is not retried"
    );
}

#[test]
fn a_hung_server_times_out() {
    let (url, _) = serve(Behaviour::Hang);
    let start = Instant::now();
    let err = generate(&mut engine(&url, 0)).unwrap_err().to_string();
    assert!(err.contains(&url), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_server_that_is_not_there_fails_the_health_check() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let err = VllmEngine::connect(spec(&url, 0), Path::new("/tmp/x"), None, vec![])
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(&format!("{url}/health")) && err.contains("health check"),
        "{err}"
    );
}

#[test]
fn a_server_without_the_token_route_is_asked_through_completions() {
    let (url, calls) = serve(Behaviour::NoTokenRoute);
    let mut e = engine(&url, 0);
    let params = SamplingParams {
        n: 2,
        ..SamplingParams::default()
    };
    for _ in 0..2 {
        let out = e.generate(&[vec![1, 2, 3]], &params).unwrap();
        assert_eq!(out[0][0].response_ids, vec![5, 6]);
        assert_eq!(out[0][0].logprobs, vec![-0.25, -0.5]);
        assert_eq!(out[0][1].response_ids, vec![8]);
    }
    // One 404, then completions only: 1 + 2 requests.
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}
