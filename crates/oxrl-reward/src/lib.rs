//! oxrl-reward: scoring responses. A [`RewardFn`] sees the prompt, the response text and the
//! dataset row's columns and returns a score; a [`RewardSet`] runs several, each with a weight,
//! under a time limit, and turns errors and timeouts into a configured failure score that is
//! counted, never a crash. Code correctness ([`code`], run in the [`sandbox`]), reward models
//! ([`model`]) and remote services ([`http`]) plug in behind the same trait.

pub mod code;
pub mod http;
pub mod model;
pub mod rules;
pub mod set;

/// The sandbox the code reward runs in (the `oxrl-sandbox` crate), reachable from here because a
/// [`CodeSpec`]'s `limits` are the sandbox's [`sandbox::Limits`].
pub use oxrl_sandbox as sandbox;

pub use code::{CodeError, CodeReward, CodeSpec, Scoring};
pub use http::{HttpReward, HttpSpec};
pub use model::{Normalize, RewardModel, RewardModelSpec};
pub use rules::{build_rule, RuleSpec};
pub use set::{RewardOutcome, RewardSet, WeightedReward};

use serde_json::{Map, Value};

/// What a reward function sees of one response.
#[derive(Debug, Clone)]
pub struct RewardInput {
    pub prompt: String,
    pub response: String,
    /// The dataset row's columns (the ground truth among them).
    pub row: Map<String, Value>,
    pub response_tokens: usize,
}

/// How a [`RewardSet`] calls a function: inputs per call, and calls at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Inputs handed to one [`RewardFn::score_batch`] call (a model forward, one request).
    pub batch_size: usize,
    /// Calls in flight at once; `None` is the machine's parallelism.
    pub workers: Option<usize>,
}

impl Default for Schedule {
    fn default() -> Self {
        Self {
            batch_size: 1,
            workers: None,
        }
    }
}

/// A reward function. `Err` is a failure (scored with the set's failure score and counted).
pub trait RewardFn: Send + Sync {
    fn score(&self, input: &RewardInput) -> Result<f64, String>;

    /// Scores several inputs in one call; one result per input, in order. Functions that gain
    /// from batching (a model, a remote service) override it; the default scores one by one.
    fn score_batch(&self, inputs: &[RewardInput]) -> Vec<Result<f64, String>> {
        inputs.iter().map(|i| self.score(i)).collect()
    }

    fn schedule(&self) -> Schedule {
        Schedule::default()
    }
}
