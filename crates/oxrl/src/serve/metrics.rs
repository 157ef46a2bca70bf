//! What `GET /metrics` reports, in Prometheus' text format: requests by route and status,
//! prompt and generated tokens, latency and time-to-first-token histograms, the queue depth and
//! the running sequences (the names follow vLLM's where one exists, under `oxrl_serve_`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Upper bounds (seconds) of the latency buckets: 10 ms to 5 minutes.
const BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A cumulative histogram of seconds.
#[derive(Default)]
pub struct Histogram {
    inner: Mutex<(Vec<u64>, u64, f64)>,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if h.0.is_empty() {
            h.0 = vec![0; BUCKETS.len()];
        }
        for (count, bound) in h.0.iter_mut().zip(BUCKETS) {
            if seconds <= bound {
                *count += 1;
            }
        }
        h.1 += 1;
        h.2 += seconds;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, bound) in BUCKETS.iter().enumerate() {
            let count = h.0.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.1);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", h.2, h.1);
    }
}

#[derive(Default)]
pub struct ServeMetrics {
    /// `(route, status)` → answered requests.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Engine steps (prefills and decodes): tokens per step is the batching at work.
    pub steps: AtomicU64,
    pub queue_depth: AtomicU64,
    pub running: AtomicU64,
    pub weight_version: AtomicU64,
    pub latency: Histogram,
    pub first_token: Histogram,
}

impl ServeMetrics {
    pub fn answered(&self, route: &str, status: u16) {
        let mut r = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *r.entry((route.to_string(), status)).or_default() += 1;
    }

    pub fn exposition(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP oxrl_serve_requests_total Requests answered, by route and HTTP status.\n\
             # TYPE oxrl_serve_requests_total counter"
        );
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "oxrl_serve_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let counters = [
            (
                "oxrl_serve_prompt_tokens_total",
                "Prompt tokens of accepted requests.",
                &self.prompt_tokens,
            ),
            (
                "oxrl_serve_generation_tokens_total",
                "Tokens sampled.",
                &self.generated_tokens,
            ),
            (
                "oxrl_serve_engine_steps_total",
                "Engine steps (each a prefill or a decode of every running sequence).",
                &self.steps,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
        let gauges = [
            (
                "oxrl_serve_queue_depth",
                "Prompts waiting for room in the batch.",
                &self.queue_depth,
            ),
            (
                "oxrl_serve_running_sequences",
                "Sequences decoding now.",
                &self.running,
            ),
            (
                "oxrl_serve_weight_version",
                "The weight version new tokens are sampled under.",
                &self.weight_version,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}",
                v.load(Relaxed)
            );
        }
        self.latency.write(
            &mut out,
            "oxrl_serve_request_duration_seconds",
            "Seconds from a request's arrival to its last byte.",
        );
        self.first_token.write(
            &mut out,
            "oxrl_serve_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first sampled token.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_observation_in_every_bucket_at_or_above_it() {
        let h = Histogram::default();
        h.observe(0.03);
        h.observe(2.0);
        let mut out = String::new();
        h.write(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.025\"} 0\n"));
        assert!(out.contains("x_bucket{le=\"0.05\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"2.5\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 2\n"));
        assert!(out.contains("x_sum 2.03\nx_count 2\n"));
    }

    #[test]
    fn requests_are_counted_by_route_and_status() {
        let m = ServeMetrics::default();
        m.answered("/v1/completions", 200);
        m.answered("/v1/completions", 200);
        m.answered("/v1/completions", 400);
        let text = m.exposition();
        assert!(text
            .contains("oxrl_serve_requests_total{route=\"/v1/completions\",status=\"200\"} 2\n"));
        assert!(text
            .contains("oxrl_serve_requests_total{route=\"/v1/completions\",status=\"400\"} 1\n"));
    }
}
