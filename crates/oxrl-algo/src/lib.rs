//! oxrl-algo: the math of RL post-training as pure functions, each named as in
//! `docs/rl-algorithms.md` and looked up by that name from the config.
//!
//! Each family (advantage estimators, policy losses, KL estimators, aggregations) is a
//! SkyRL-style registry declared with [`registry!`]: adding one is one function plus one line in
//! its family's `registry!` block. The names the config accepts, `oxrl config --explain` and the
//! errors for unknown names all read the registry, so there is no second list.
//!
//! Per-token quantities travel as flat `[N]` tensors over every response token of a batch, with
//! the sequence lengths alongside; gradients flow through the current policy's log-probs only.

#[macro_use]
mod registry;

pub mod advantage;
pub mod aggregation;
pub mod dapo;
pub mod kl;
pub mod kl_reward;
pub mod policy_loss;
pub mod returns;
pub mod rollout_corr;
pub mod value_loss;

pub use advantage::{
    compute_advantages, estimate_advantages, AdvantageConfig, AdvantageError, AdvantageEstimator,
    AdvantageInputs,
};
pub use aggregation::{masked_token_weights, token_weights, BatchTotals, LossAgg};
pub use kl::{kl_per_token, KlEstimator};
pub use policy_loss::{policy_loss, PolicyLoss, PolicyLossConfig, PolicyLossOutput};
pub use registry::{Registered, UnknownName};
pub use returns::TokenAdvantages;
