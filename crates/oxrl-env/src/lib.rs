//! oxrl-env: multi-turn environments. A rollout alternates the policy's turns with the
//! environment's: [`Environment::reset`] starts an episode on a dataset row, then each policy
//! turn (its text) goes to [`Environment::step`], which answers with an observation (shown to
//! the policy as a tool response), a reward and whether the episode is over. The rollout loop
//! that drives them, and the loss mask that keeps the environment's tokens out of the update,
//! live in `oxrl-train` (`episodes.rs`).
//!
//! Built in: [`ToolEnvironment`] (tools called in Qwen3's `<tool_call>` format or `<code>`
//! blocks — a calculator, Python run in the sandbox — and the final answer scored against the
//! row's ground truth) and [`HttpEnvironment`] (a remote service implements reset and step, in
//! any language).

pub mod calculator;
pub mod http;
pub mod tool_call;
pub mod tools;

pub use http::{HttpEnvSpec, HttpEnvironment, HttpEnvironmentFactory};
pub use tools::{Tool, ToolEnvironment, ToolEnvironmentFactory};

use serde_json::{Map, Value};

/// What the environment answers to one policy turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Shown to the policy before its next turn (as a tool response); `None` with nothing to
    /// show.
    pub observation: Option<String>,
    pub reward: f64,
    pub done: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// The environment could not answer (a remote one unreachable, a malformed answer); the
    /// message names where and what was expected.
    #[error("{0}")]
    Failed(String),
}

/// One episode's environment. A rollout makes one per sampled trajectory.
pub trait Environment: Send {
    /// Starts an episode on a dataset row (its columns). `Some(text)`: the episode's first
    /// observation, which becomes the user's message in place of the row's prompt; `None`: the
    /// row's prompt as the data loader rendered it.
    fn reset(&mut self, row: &Map<String, Value>) -> Result<Option<String>, EnvError>;

    /// The policy's turn, as text (special tokens removed).
    fn step(&mut self, action: &str) -> Result<Step, EnvError>;
}

/// Makes a fresh environment for each episode.
pub trait EnvironmentFactory: Send + Sync {
    fn make(&self) -> Box<dyn Environment>;
}
