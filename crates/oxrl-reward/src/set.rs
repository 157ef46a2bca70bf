//! Several reward functions with weights, run over a batch with a time limit per call: a
//! function that errors or runs past the limit scores the failure value and is counted.

use crate::{RewardFn, RewardInput};
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// `(name, mean seconds per call)`: wall time of each call (one input, or one batch for
    /// batched functions), a call past the limit counted with the time it was given.
    pub latency: Vec<(String, f64)>,
}

impl RewardOutcome {
    /// Appends another batch's outcome (the same functions, in the same order): totals and
    /// scores follow on, failures add up, latencies average over the batches' calls.
    pub fn extend(&mut self, more: RewardOutcome) {
        let (before, added) = (self.total.len() as f64, more.total.len() as f64);
        self.total.extend(more.total);
        for ((_, scores), (_, more)) in self.per_function.iter_mut().zip(more.per_function) {
            scores.extend(more);
        }
        for ((_, failed), (_, more)) in self.failures.iter_mut().zip(more.failures) {
            *failed += more;
        }
        let all = (before + added).max(1.0);
        for ((_, secs), (_, more)) in self.latency.iter_mut().zip(more.latency) {
            *secs = (*secs * before + more * added) / all;
        }
    }
}

pub struct RewardSet {
    pub functions: Vec<WeightedReward>,
    pub failure_score: f64,
    pub timeout: Duration,
}

impl RewardSet {
    /// Scores every input with every function. Each function's calls run on worker threads (as
    /// many as its [`crate::Schedule`] asks, else the machine's parallelism) pulling batches
    /// from a shared queue, so one slow call does not hold the others.
    pub fn score(&self, inputs: &[RewardInput]) -> RewardOutcome {
        let inputs: Arc<Vec<RewardInput>> = Arc::new(inputs.to_vec());
        let mut out = RewardOutcome {
            total: vec![0.0; inputs.len()],
            ..Default::default()
        };
        for f in &self.functions {
            let scored = self.score_one(&f.function, &inputs);
            for (t, s) in out.total.iter_mut().zip(&scored.scores) {
                *t += f.weight * s;
            }
            out.per_function.push((f.name.clone(), scored.scores));
            out.failures.push((f.name.clone(), scored.failed));
            out.latency.push((f.name.clone(), scored.mean_call_s));
        }
        out
    }

    fn score_one(&self, f: &Arc<dyn RewardFn>, inputs: &Arc<Vec<RewardInput>>) -> Scored {
        let schedule = f.schedule();
        let batch = schedule.batch_size.max(1);
        let calls = inputs.len().div_ceil(batch);
        let workers = schedule
            .workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
            .clamp(1, calls.max(1));
        type Done = (usize, Vec<Result<f64, String>>, Duration);
        let (tx, rx) = mpsc::channel::<Done>();
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..workers {
            let (tx, f, inputs, next) = (tx.clone(), f.clone(), inputs.clone(), next.clone());
            // Detached: a call that never returns is abandoned with its thread, not waited for.
            std::thread::spawn(move || loop {
                let call = next.fetch_add(1, Ordering::SeqCst);
                if call >= calls {
                    break;
                }
                let chunk = &inputs[call * batch..((call + 1) * batch).min(inputs.len())];
                let start = Instant::now();
                let mut r =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.score_batch(chunk)))
                        .unwrap_or_else(|_| {
                            vec![Err("the reward function panicked".into()); chunk.len()]
                        });
                if r.len() != chunk.len() {
                    r = vec![
                        Err(format!("{} scores for {} inputs", r.len(), chunk.len()));
                        chunk.len()
                    ];
                }
                if tx.send((call, r, start.elapsed())).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        let mut scores = vec![self.failure_score; inputs.len()];
        let mut done = vec![false; calls];
        let mut failed = 0;
        let mut call_time = Duration::ZERO;
        let start = Instant::now();
        let deadline = start + self.timeout * calls.div_ceil(workers) as u32;
        while done.iter().any(|d| !d) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((call, results, took)) => {
                    done[call] = true;
                    call_time += took;
                    for (k, r) in results.into_iter().enumerate() {
                        match r {
                            Ok(s) if s.is_finite() => scores[call * batch + k] = s,
                            _ => failed += 1,
                        }
                    }
                }
                Err(_) => {
                    // Calls still out ran past the limit: counted as failures, and as having
                    // taken the time they were given.
                    let late: Vec<usize> = (0..calls).filter(|&c| !done[c]).collect();
                    for c in late {
                        failed += ((c + 1) * batch).min(inputs.len()) - c * batch;
                        call_time += start.elapsed();
                    }
                    break;
                }
            }
        }
        Scored {
            scores,
            failed,
            mean_call_s: call_time.as_secs_f64() / calls.max(1) as f64,
        }
    }
}

/// One function's results over a batch.
struct Scored {
    scores: Vec<f64>,
    failed: usize,
    mean_call_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_of_two_batches_join() {
        let outcome = |total: Vec<f64>, failed: usize, secs: f64| RewardOutcome {
            per_function: vec![("f".into(), total.clone())],
            total,
            failures: vec![("f".into(), failed)],
            latency: vec![("f".into(), secs)],
        };
        let mut a = outcome(vec![1.0, 0.0], 1, 0.5);
        a.extend(outcome(vec![0.5, 0.5, 0.5, 0.5], 2, 2.0));
        assert_eq!(a.total, [1.0, 0.0, 0.5, 0.5, 0.5, 0.5]);
        assert_eq!(a.per_function[0].1, a.total);
        assert_eq!(a.failures[0].1, 3);
        // (0.5·2 + 2.0·4) / 6 = 1.5.
        assert_eq!(a.latency[0].1, 1.5);
    }

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
