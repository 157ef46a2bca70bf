//! A remote reward service over HTTP.
//!
//! The contract: `POST <url>` with `Content-Type: application/json` and the body
//! `{"items": [{"prompt": "...", "response": "...", "row": {<the dataset row's columns>}}, ...]}`
//! (up to `batch_size` items); the service answers `200` with `{"scores": [s0, s1, ...]}`, one
//! number per item in order (`null` for an item it could not score). A transport error, a
//! timeout, `408`, `429` or a `5xx` is retried after `backoff · 2^attempt` up to `max_retries`
//! times; any other status, a malformed body or a wrong number of scores fails the batch at once.
//! Failed items score the set's failure value and are counted (`reward_failures/<name>`).
//! At most `max_concurrency` requests are in flight.

use crate::{RewardFn, RewardInput, Schedule};
use serde_json::{json, Value};
use std::time::Duration;

/// The settings of one HTTP reward (`type = "http"`).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpSpec {
    pub url: String,
    /// Per request, connect to last byte.
    pub timeout: Duration,
    pub max_retries: u32,
    /// Wait before the first retry; doubled for each further one.
    pub backoff: Duration,
    pub max_concurrency: usize,
    /// Items per request.
    pub batch_size: usize,
}

impl HttpSpec {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            timeout: Duration::from_secs(3),
            max_retries: 2,
            backoff: Duration::from_millis(250),
            max_concurrency: 4,
            batch_size: 16,
        }
    }
}

pub struct HttpReward {
    spec: HttpSpec,
    agent: ureq::Agent,
}

/// Why one attempt failed, and whether another may succeed.
struct Failure {
    message: String,
    retry: bool,
}

impl HttpReward {
    pub fn new(spec: HttpSpec) -> Self {
        let agent = ureq::AgentBuilder::new().timeout(spec.timeout).build();
        Self { spec, agent }
    }

    fn attempt(&self, body: &Value, n: usize) -> Result<Vec<Option<f64>>, Failure> {
        let response = match self.agent.post(&self.spec.url).send_json(body) {
            Ok(r) => r,
            Err(ureq::Error::Status(code, _)) => {
                return Err(Failure {
                    message: format!("HTTP status {code}"),
                    retry: code == 408 || code == 429 || code >= 500,
                })
            }
            Err(ureq::Error::Transport(t)) => {
                return Err(Failure {
                    message: t.to_string(),
                    retry: true,
                })
            }
        };
        let fail = |message: String| Failure {
            message,
            retry: false,
        };
        let v: Value = response
            .into_json()
            .map_err(|e| fail(format!("the answer is not JSON: {e}")))?;
        let scores = v
            .get("scores")
            .and_then(Value::as_array)
            .ok_or_else(|| fail("the answer has no `scores` list".into()))?;
        if scores.len() != n {
            return Err(fail(format!("{} scores for {n} items", scores.len())));
        }
        Ok(scores.iter().map(Value::as_f64).collect())
    }
}

impl RewardFn for HttpReward {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        self.score_batch(std::slice::from_ref(input))
            .pop()
            .unwrap_or_else(|| Err("no score".into()))
    }

    fn score_batch(&self, inputs: &[RewardInput]) -> Vec<Result<f64, String>> {
        let items: Vec<Value> = inputs
            .iter()
            .map(|i| json!({"prompt": i.prompt, "response": i.response, "row": i.row}))
            .collect();
        let body = json!({ "items": items });
        let mut attempt = 0;
        let message = loop {
            match self.attempt(&body, inputs.len()) {
                Ok(scores) => {
                    return scores
                        .into_iter()
                        .map(|s| s.ok_or_else(|| "the service gave no score".to_string()))
                        .collect()
                }
                Err(f) if f.retry && attempt < self.spec.max_retries => {
                    std::thread::sleep(self.spec.backoff * 2u32.saturating_pow(attempt));
                    attempt += 1;
                }
                Err(f) => break f.message,
            }
        };
        let message = format!(
            "{}: {message} (after {} attempts)",
            self.spec.url,
            attempt + 1
        );
        vec![Err(message); inputs.len()]
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            batch_size: self.spec.batch_size.max(1),
            workers: Some(self.spec.max_concurrency.max(1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RewardSet, WeightedReward};
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    /// What the test server saw, and how it answers.
    #[derive(Default)]
    struct Server {
        requests: AtomicUsize,
        in_flight: AtomicUsize,
        max_in_flight: AtomicUsize,
        bodies: Mutex<Vec<Value>>,
    }

    /// A real HTTP server on a free local port; each connection on its own thread.
    /// `answer(request number, body)` gives the status, the body and a delay.
    fn serve(
        answer: impl Fn(usize, &Value) -> (u16, String, Duration) + Send + Sync + 'static,
    ) -> (String, Arc<Server>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        let state = Arc::new(Server::default());
        let answer = Arc::new(answer);
        let s = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (s, answer) = (s.clone(), answer.clone());
                std::thread::spawn(move || handle(stream, &s, &*answer));
            }
        });
        (url, state)
    }

    fn handle(
        stream: TcpStream,
        s: &Server,
        answer: &dyn Fn(usize, &Value) -> (u16, String, Duration),
    ) {
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
            return;
        }
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let n = s.requests.fetch_add(1, Ordering::SeqCst);
        let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        s.max_in_flight.fetch_max(now, Ordering::SeqCst);
        s.bodies.lock().unwrap().push(body.clone());
        let (status, text, delay) = answer(n, &body);
        std::thread::sleep(delay);
        s.in_flight.fetch_sub(1, Ordering::SeqCst);
        let _ = write!(
            &stream,
            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        );
    }

    /// Scores each item by the length of its response.
    fn by_length(body: &Value) -> String {
        let scores: Vec<usize> = body["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .map(|i| i["response"].as_str().unwrap_or("").len())
                    .collect()
            })
            .unwrap_or_default();
        json!({ "scores": scores }).to_string()
    }

    fn inputs(n: usize) -> Vec<RewardInput> {
        (0..n)
            .map(|i| {
                let mut row = serde_json::Map::new();
                row.insert("id".into(), json!(i));
                RewardInput {
                    prompt: format!("p{i}"),
                    response: "x".repeat(i),
                    row,
                    response_tokens: i,
                }
            })
            .collect()
    }

    fn set(spec: HttpSpec) -> RewardSet {
        RewardSet {
            functions: vec![WeightedReward {
                name: "remote".into(),
                weight: 1.0,
                function: Arc::new(HttpReward::new(spec)),
            }],
            failure_score: -1.0,
            timeout: Duration::from_secs(10),
        }
    }

    fn fast(url: &str) -> HttpSpec {
        HttpSpec {
            backoff: Duration::from_millis(10),
            timeout: Duration::from_secs(2),
            ..HttpSpec::new(url)
        }
    }

    #[test]
    fn batches_carry_prompt_response_and_row_and_scores_come_back_in_order() {
        let (url, server) = serve(|_, body| (200, by_length(body), Duration::ZERO));
        let spec = HttpSpec {
            batch_size: 2,
            ..fast(&url)
        };
        let out = set(spec).score(&inputs(5));
        assert_eq!(out.total, [0.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(out.failures[0].1, 0);
        assert_eq!(server.requests.load(Ordering::SeqCst), 3, "2 + 2 + 1 items");
        let bodies = server.bodies.lock().unwrap();
        let first = bodies
            .iter()
            .find(|b| b["items"][0]["prompt"] == "p0")
            .unwrap();
        assert_eq!(
            first["items"][1],
            json!({"prompt": "p1", "response": "x", "row": {"id": 1}})
        );
    }

    #[test]
    fn server_errors_are_retried_and_then_counted_as_failures() {
        // The first two answers are 503, then the service recovers.
        let (url, server) = serve(|n, body| match n {
            0 | 1 => (503, "busy".into(), Duration::ZERO),
            _ => (200, by_length(body), Duration::ZERO),
        });
        let out = set(fast(&url)).score(&inputs(3));
        assert_eq!(out.total, [0.0, 1.0, 2.0]);
        assert_eq!(server.requests.load(Ordering::SeqCst), 3);

        // Always 500: 1 + max_retries attempts, every item a counted failure.
        let (url, server) = serve(|_, _| (500, "down".into(), Duration::ZERO));
        let spec = HttpSpec {
            max_retries: 2,
            ..fast(&url)
        };
        let start = Instant::now();
        let out = set(spec).score(&inputs(3));
        assert_eq!(out.total, [-1.0; 3]);
        assert_eq!(out.failures[0].1, 3);
        assert_eq!(server.requests.load(Ordering::SeqCst), 3);
        assert!(
            start.elapsed() >= Duration::from_millis(30),
            "10 + 20 ms of backoff"
        );

        // A client error is not retried; a short or malformed answer fails the batch.
        for (status, text) in [(400, "bad"), (200, "{\"scores\": [1]}"), (200, "nope")] {
            let (url, server) = serve(move |_, _| (status, text.into(), Duration::ZERO));
            let r = HttpReward::new(fast(&url));
            let got = r.score_batch(&inputs(2));
            assert!(got.iter().all(Result::is_err), "{status} {text}: {got:?}");
            assert_eq!(server.requests.load(Ordering::SeqCst), 1, "{status} {text}");
        }
    }

    #[test]
    fn a_slow_service_times_out_into_failures() {
        let (url, _server) = serve(|_, body| (200, by_length(body), Duration::from_secs(3)));
        let spec = HttpSpec {
            timeout: Duration::from_millis(200),
            max_retries: 0,
            ..fast(&url)
        };
        let start = Instant::now();
        let out = set(spec).score(&inputs(2));
        assert!(start.elapsed() < Duration::from_secs(2));
        assert_eq!(out.total, [-1.0, -1.0]);
        assert_eq!(out.failures[0].1, 2);
    }

    #[test]
    fn no_more_than_max_concurrency_requests_are_in_flight() {
        let (url, server) = serve(|_, body| (200, by_length(body), Duration::from_millis(150)));
        let spec = HttpSpec {
            batch_size: 1,
            max_concurrency: 2,
            ..fast(&url)
        };
        let start = Instant::now();
        let out = set(spec).score(&inputs(6));
        assert_eq!(out.failures[0].1, 0);
        assert_eq!(server.max_in_flight.load(Ordering::SeqCst), 2);
        // 6 requests of 150 ms, 2 at a time: three rounds.
        assert!(start.elapsed() >= Duration::from_millis(450));
        let latency = out.latency[0].1;
        assert!((0.15..0.6).contains(&latency), "{latency}");
    }
}
