//! oxrl-reward: scoring responses. A [`RewardFn`] sees the prompt, the response text and the
//! dataset row's columns and returns a score; a [`RewardSet`] runs several, each with a weight,
//! under a time limit, and turns errors and timeouts into a configured failure score that is
//! counted, never a crash. Sandboxed code execution and reward models plug in behind the same
//! trait.

pub mod rules;
pub mod set;

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

/// A reward function. `Err` is a failure (scored with the set's failure score and counted).
pub trait RewardFn: Send + Sync {
    fn score(&self, input: &RewardInput) -> Result<f64, String>;
}
