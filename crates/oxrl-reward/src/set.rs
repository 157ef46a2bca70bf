//! Several reward functions with weights, run over a batch with a time limit per call: a
//! function that errors or runs past the limit scores the failure value and is counted.

use crate::{RewardFn, RewardInput};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

pub struct WeightedReward {
    pub name: String,
    pub weight: f64,
    pub function: Arc<dyn RewardFn>,
}

/// The rewards of one batch: the weighted total per response and each function's raw scores.
#[derive(Debug, Clone, Default)]
pub struct RewardOutcome {
    pub total: Vec<f64>,
    /// `(name, scores per response)` in configuration order.
    pub per_function: Vec<(String, Vec<f64>)>,
    /// `(name, failures)`: calls that errored or timed out.
    pub failures: Vec<(String, usize)>,
    /// `(name, mean seconds per call)`.
    pub latency: Vec<(String, f64)>,
}

pub struct RewardSet {
    pub functions: Vec<WeightedReward>,
    pub failure_score: f64,
    pub timeout: Duration,
}

impl RewardSet {
    /// Scores every input with every function. Calls run on worker threads (up to the machine's
    /// parallelism) so one slow call does not hold the others.
    pub fn score(&self, inputs: &[RewardInput]) -> RewardOutcome {
        let inputs: Arc<Vec<RewardInput>> = Arc::new(inputs.to_vec());
        let mut out = RewardOutcome {
            total: vec![0.0; inputs.len()],
            ..Default::default()
        };
        for f in &self.functions {
            let start = Instant::now();
            let (scores, failed) = self.score_one(&f.function, &inputs);
            let per_call = start.elapsed().as_secs_f64() / inputs.len().max(1) as f64;
            for (t, s) in out.total.iter_mut().zip(&scores) {
                *t += f.weight * s;
            }
            out.per_function.push((f.name.clone(), scores));
            out.failures.push((f.name.clone(), failed));
            out.latency.push((f.name.clone(), per_call));
        }
        out
    }

    fn score_one(
        &self,
        f: &Arc<dyn RewardFn>,
        inputs: &Arc<Vec<RewardInput>>,
    ) -> (Vec<f64>, usize) {
        let workers = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .min(inputs.len().max(1));
        let (tx, rx) = mpsc::channel::<(usize, Result<f64, String>)>();
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..workers {
            let (tx, f, inputs, next) = (tx.clone(), f.clone(), inputs.clone(), next.clone());
            // Detached: a call that never returns is abandoned with its thread, not waited for.
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= inputs.len() {
                    break;
                }
                let r =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.score(&inputs[i])))
                        .unwrap_or_else(|_| Err("the reward function panicked".into()));
                if tx.send((i, r)).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        let mut scores = vec![self.failure_score; inputs.len()];
        let mut done = vec![false; inputs.len()];
        let mut failed = 0;
        let deadline = Instant::now() + self.timeout * inputs.len().div_ceil(workers) as u32;
        while done.iter().any(|d| !d) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((i, Ok(s))) if s.is_finite() => {
                    scores[i] = s;
                    done[i] = true;
                }
                Ok((i, _)) => {
                    failed += 1;
                    done[i] = true;
                }
                Err(_) => {
                    failed += done.iter().filter(|d| !**d).count();
                    break;
                }
            }
        }
        (scores, failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Const(f64);
    impl RewardFn for Const {
        fn score(&self, _: &RewardInput) -> Result<f64, String> {
            Ok(self.0)
        }
    }
    struct Failing;
    impl RewardFn for Failing {
        fn score(&self, _: &RewardInput) -> Result<f64, String> {
            Err("boom".into())
        }
    }
    struct Slow;
    impl RewardFn for Slow {
        fn score(&self, _: &RewardInput) -> Result<f64, String> {
            std::thread::sleep(Duration::from_secs(5));
            Ok(1.0)
        }
    }

    fn inputs(n: usize) -> Vec<RewardInput> {
        (0..n)
            .map(|_| RewardInput {
                prompt: String::new(),
                response: String::new(),
                row: Default::default(),
                response_tokens: 0,
            })
            .collect()
    }

    fn weighted(name: &str, weight: f64, f: impl RewardFn + 'static) -> WeightedReward {
        WeightedReward {
            name: name.into(),
            weight,
            function: Arc::new(f),
        }
    }

    #[test]
    fn totals_are_weighted_sums_and_failures_score_the_failure_value() {
        let set = RewardSet {
            functions: vec![
                weighted("a", 0.5, Const(1.0)),
                weighted("b", 2.0, Const(0.25)),
                weighted("c", 1.0, Failing),
            ],
            failure_score: -1.0,
            timeout: Duration::from_secs(5),
        };
        let out = set.score(&inputs(3));
        assert_eq!(out.total, vec![0.5 + 0.5 - 1.0; 3]);
        assert_eq!(
            out.failures,
            vec![("a".into(), 0), ("b".into(), 0), ("c".into(), 3)]
        );
    }

    #[test]
    fn a_call_past_the_time_limit_is_a_counted_failure() {
        let set = RewardSet {
            functions: vec![weighted("slow", 1.0, Slow)],
            failure_score: 0.0,
            timeout: Duration::from_millis(100),
        };
        let start = Instant::now();
        let out = set.score(&inputs(2));
        assert!(start.elapsed() < Duration::from_secs(2));
        assert_eq!(out.total, vec![0.0, 0.0]);
        assert_eq!(out.failures[0].1, 2);
    }
}
