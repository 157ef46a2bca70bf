//! oxrl-algo: the math of RL post-training as pure functions, each named as in
//! `docs/rl-algorithms.md` and looked up by that name from the config (SkyRL-style registries:
//! adding one is a function plus a match arm).
//!
//! Per-token quantities travel as flat `[N]` tensors over every response token of a batch, with
//! the sequence lengths alongside; gradients flow through the current policy's log-probs only.

pub mod advantage;
pub mod aggregation;
pub mod kl;
pub mod policy_loss;

pub use advantage::{compute_advantages, AdvantageConfig, AdvantageEstimator};
pub use aggregation::{token_weights, BatchTotals, LossAgg};
pub use kl::{kl_per_token, KlEstimator};
pub use policy_loss::{policy_loss, PolicyLoss, PolicyLossConfig, PolicyLossOutput};

/// A name from a config that matches no registered entry.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("unknown {what} `{name}`; expected one of: {}", .valid.join(", "))]
pub struct UnknownName {
    pub what: &'static str,
    pub name: String,
    pub valid: Vec<&'static str>,
}

/// Looks `name` up in a registry of `(name, value)` pairs.
pub(crate) fn lookup<T: Copy>(
    what: &'static str,
    name: &str,
    registry: &[(&'static str, T)],
) -> Result<T, UnknownName> {
    registry
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
        .ok_or_else(|| UnknownName {
            what,
            name: name.to_string(),
            valid: registry.iter().map(|(n, _)| *n).collect(),
        })
}
