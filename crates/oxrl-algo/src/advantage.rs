//! Advantage estimators: an advantage per response token from the batch's rewards. The group
//! estimators give every token of a response the same value; REINFORCE++ discounts the reward
//! back through the response and GAE bootstraps from a critic's values ([`crate::returns`]).
//! Groups are the responses sharing a prompt uid. Each estimator's formula and paper:
//! `docs/rl-algorithms.md`, "Advantage estimators" (one section per registered name).
//!
//! Rewards are per token: each response's outcome reward at its last token, plus any per-token
//! terms (a KL penalty folded into the reward). The token-level estimators read them as they
//! are; the group estimators score a response by their sum, as verl does.

use crate::registry::Registered;
use crate::returns::{
    discounted_returns, gae as gae_returns, outcome_token_rewards, whiten, TokenAdvantages,
};
use std::collections::HashMap;

/// An estimator: how a batch's rewards become per-token advantages (and returns), the default
/// of `norm_adv_by_std` the config resolves for it, and whether it needs a critic's values.
#[derive(Clone, Copy)]
struct Estimator {
    compute: fn(&Batch, &AdvantageConfig) -> TokenAdvantages,
    norm_adv_by_std: bool,
    needs_values: bool,
}

/// An estimator whose advantages are also its returns (no critic to fit them to).
macro_rules! outcome {
    ($f:ident, $norm:expr) => {
        Estimator {
            compute: |b, cfg| TokenAdvantages::same($f(b, cfg)),
            norm_adv_by_std: $norm,
            needs_values: false,
        }
    };
}

registry! {
    pub enum AdvantageEstimator: "advantage estimator" => Estimator {
        Grpo = "grpo" => outcome!(grpo, true),
            "A_i = (r_i − mean_g r) / (std_g r + ε), std with n − 1 (GRPO)";
        DrGrpo = "dr_grpo" => outcome!(grpo, false),
            "GRPO without the std: A_i = r_i − mean_g r (Dr. GRPO; norm_adv_by_std defaults to false)";
        Rloo = "rloo" => outcome!(rloo, true),
            "leave-one-out baseline: A_i = r_i − mean_{j≠i} r_j (RLOO)";
        ReinforceBaseline = "reinforce_baseline" | "reinforce_plus_plus_baseline" => outcome!(reinforce_baseline, true),
            "REINFORCE++-baseline: r_i − mean_g r, whitened over every token of the batch";
        ReinforcePlusPlus = "reinforce_plus_plus" => Estimator { compute: reinforce_plus_plus, norm_adv_by_std: true, needs_values: false },
            "REINFORCE++: the γ-discounted return of each token (reward at the last token), whitened over every token of the batch";
        Opo = "opo" => outcome!(opo, false),
            "A_i = r_i − Σ_j |o_j| r_j / Σ_j |o_j| over the group: the length-weighted baseline (OPO)";
        Gpg = "gpg" => outcome!(gpg, false),
            "A_i = α (r_i − mean_g r), α = B / #{responses with r ≠ 0} in the batch (GPG)";
        Gae = "gae" => Estimator { compute: gae, norm_adv_by_std: false, needs_values: true },
            "PPO with a critic: δ_t = r_t + γV_{t+1} − V_t, A_t = Σ_k (γλ)^k δ_{t+k}, whitened over the batch; the critic fits A + V (needs [critic])";
    }
}

impl AdvantageEstimator {
    /// Whether this estimator divides by the group std when `norm_adv_by_std` is not given.
    pub fn norm_adv_by_std_default(self) -> bool {
        self.implementation().norm_adv_by_std
    }

    /// Whether this estimator bootstraps from a critic's values (`gae`).
    pub fn needs_values(self) -> bool {
        self.implementation().needs_values
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdvantageConfig {
    pub estimator: AdvantageEstimator,
    /// Divide by the group std (GRPO's estimators only).
    pub norm_adv_by_std: bool,
    /// ε in the GRPO denominator: 1e-6 as verl and SkyRL (TRL uses 1e-4).
    pub eps: f64,
    /// γ, the discount of REINFORCE++'s and GAE's returns (1: every token gets the whole reward).
    pub gamma: f64,
    /// λ, GAE's trade of bias (0: one-step TD) against variance (1: Monte Carlo returns).
    pub lam: f64,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        let estimator = AdvantageEstimator::Grpo;
        Self {
            estimator,
            norm_adv_by_std: estimator.norm_adv_by_std_default(),
            eps: 1e-6,
            gamma: 1.0,
            lam: 1.0,
        }
    }
}

/// One response's reward per entry (the sum of its token rewards), its group, its token count,
/// its per-token rewards and, for GAE, the critic's value of each of its tokens.
struct Batch<'a> {
    rewards: &'a [f64],
    groups: Vec<Vec<usize>>,
    token_counts: &'a [usize],
    token_rewards: &'a [Vec<f64>],
    values: &'a [Vec<f64>],
}

impl Batch<'_> {
    /// `per_response(group, group mean, i)` for every response `i`. A group of one has no
    /// baseline (mean 0, std 1), so it keeps its reward.
    fn per_group(&self, per_response: impl Fn(&[usize], f64, usize) -> f64) -> Vec<f64> {
        let mut adv = vec![0.0; self.rewards.len()];
        for group in &self.groups {
            let m = mean(group.iter().map(|&i| self.rewards[i]));
            for &i in group {
                adv[i] = match group.len() {
                    1 => self.rewards[i],
                    _ => per_response(group, m, i),
                };
            }
        }
        adv
    }

    /// One value per response, given to each of its tokens.
    fn broadcast(&self, per_response: Vec<f64>) -> Vec<Vec<f64>> {
        per_response
            .into_iter()
            .zip(self.token_counts)
            .map(|(a, &n)| vec![a; n])
            .collect()
    }
}

/// Indices of the responses of each group, groups in order of first appearance.
fn groups<G: Eq + std::hash::Hash>(uids: &[G]) -> Vec<Vec<usize>> {
    let mut index: HashMap<&G, usize> = HashMap::new();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, u) in uids.iter().enumerate() {
        let g = *index.entry(u).or_insert_with(|| {
            out.push(Vec::new());
            out.len() - 1
        });
        out[g].push(i);
    }
    out
}

fn mean(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = xs.clone().count();
    xs.sum::<f64>() / n as f64
}

/// What an estimator reads of a batch. `uids[i]` names the prompt of response `i` (groups need
/// not be contiguous); `token_counts[i]` is its response length.
pub struct AdvantageInputs<'a, G> {
    /// Each response's outcome reward.
    pub rewards: &'a [f64],
    pub uids: &'a [G],
    pub token_counts: &'a [usize],
    /// Per-token terms added to the rewards (`−β·KL_t` when the KL penalty is in the reward);
    /// `None`: the outcome reward alone.
    pub token_penalties: Option<&'a [Vec<f64>]>,
    /// The critic's value of each response token (`gae` only).
    pub values: Option<&'a [Vec<f64>]>,
}

/// A batch the estimator cannot read: missing or misshapen per-token inputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("advantage estimator `{estimator}`: {problem}")]
pub struct AdvantageError {
    pub estimator: &'static str,
    pub problem: String,
}

/// Advantages and returns per response token (`[i][t]`: response `i`, token `t`).
pub fn estimate_advantages<G: Eq + std::hash::Hash>(
    inputs: &AdvantageInputs<G>,
    cfg: &AdvantageConfig,
) -> Result<TokenAdvantages, AdvantageError> {
    let counts = inputs.token_counts;
    let fail = |problem: String| AdvantageError {
        estimator: cfg.estimator.name(),
        problem,
    };
    let shaped = |rows: &[Vec<f64>], what: &str| -> Result<(), AdvantageError> {
        let lens: Vec<usize> = rows.iter().map(Vec::len).collect();
        match lens == counts {
            true => Ok(()),
            false => Err(fail(format!(
                "{what} have lengths {lens:?} for responses of {counts:?} tokens"
            ))),
        }
    };
    let mut token_rewards = outcome_token_rewards(inputs.rewards, counts);
    let mut summed = inputs.rewards.to_vec();
    if let Some(penalties) = inputs.token_penalties {
        shaped(penalties, "the per-token reward terms")?;
        for ((row, p), total) in token_rewards.iter_mut().zip(penalties).zip(&mut summed) {
            for (r, x) in row.iter_mut().zip(p) {
                *r += x;
            }
            *total = row.iter().sum();
        }
    }
    let values = match (inputs.values, cfg.estimator.needs_values()) {
        (Some(v), _) => {
            shaped(v, "the values")?;
            v
        }
        (None, true) => return Err(fail("needs a critic's values ([critic])".into())),
        (None, false) => &[],
    };
    let batch = Batch {
        rewards: &summed,
        groups: groups(inputs.uids),
        token_counts: counts,
        token_rewards: &token_rewards,
        values,
    };
    Ok((cfg.estimator.implementation().compute)(&batch, cfg))
}

/// Advantages per response token from outcome rewards alone (no per-token terms, no critic):
/// [`estimate_advantages`] for the estimators that need nothing more (`gae` is an error here).
pub fn compute_advantages<G: Eq + std::hash::Hash>(
    rewards: &[f64],
    uids: &[G],
    token_counts: &[usize],
    cfg: &AdvantageConfig,
) -> Result<Vec<Vec<f64>>, AdvantageError> {
    let inputs = AdvantageInputs {
        rewards,
        uids,
        token_counts,
        token_penalties: None,
        values: None,
    };
    estimate_advantages(&inputs, cfg).map(|a| a.advantages)
}

fn grpo(b: &Batch, cfg: &AdvantageConfig) -> Vec<Vec<f64>> {
    let r = b.rewards;
    b.broadcast(b.per_group(|group, m, i| match cfg.norm_adv_by_std {
        true => {
            let var =
                group.iter().map(|&j| (r[j] - m).powi(2)).sum::<f64>() / (group.len() - 1) as f64;
            (r[i] - m) / (var.sqrt() + cfg.eps)
        }
        false => r[i] - m,
    }))
}

/// r_i − mean_{j≠i} r_j = (r_i − mean) · n / (n − 1).
fn rloo(b: &Batch, _: &AdvantageConfig) -> Vec<Vec<f64>> {
    b.broadcast(b.per_group(|group, m, i| {
        let n = group.len();
        (b.rewards[i] - m) * n as f64 / (n - 1) as f64
    }))
}

/// The group mean removed, then whitened over every token of the batch (a response counts
/// once per token).
fn reinforce_baseline(b: &Batch, _: &AdvantageConfig) -> Vec<Vec<f64>> {
    let mut adv = b.broadcast(b.per_group(|_, m, i| b.rewards[i] - m));
    whiten(&mut adv);
    adv
}

fn reinforce_plus_plus(b: &Batch, cfg: &AdvantageConfig) -> TokenAdvantages {
    let returns = discounted_returns(b.token_rewards, cfg.gamma);
    let mut advantages = returns.clone();
    whiten(&mut advantages);
    TokenAdvantages {
        advantages,
        returns,
    }
}

fn gae(b: &Batch, cfg: &AdvantageConfig) -> TokenAdvantages {
    gae_returns(b.token_rewards, b.values, cfg.gamma, cfg.lam)
}

/// OPO (Hao et al., *On-Policy RL with Optimal Reward Baseline*, 2025): the group baseline is
/// the mean reward weighted by response length. A group of one keeps its reward.
fn opo(b: &Batch, _: &AdvantageConfig) -> Vec<Vec<f64>> {
    let r = b.rewards;
    let lens = b.token_counts;
    b.broadcast(b.per_group(|group, _, i| {
        let total: f64 = group.iter().map(|&j| lens[j] as f64).sum();
        let weighted: f64 = group.iter().map(|&j| lens[j] as f64 * r[j]).sum();
        r[i] - weighted / total
    }))
}

/// GPG (Chu et al., *GPG: A Simple and Strong Reinforcement Learning Baseline*, 2025): the
/// group mean removed, scaled by α = B / (responses with a non-zero reward, at least 1) so the
/// gradient is not diluted by the batch's zero-reward responses; a group of one has mean 0.
fn gpg(b: &Batch, _: &AdvantageConfig) -> Vec<Vec<f64>> {
    let r = b.rewards;
    let nonzero = r.iter().filter(|&&x| x != 0.0).count().max(1);
    let alpha = r.len() as f64 / nonzero as f64;
    let mut adv = vec![0.0; r.len()];
    for group in &b.groups {
        let m = match group.len() {
            1 => 0.0,
            _ => mean(group.iter().map(|&i| r[i])),
        };
        for &i in group {
            adv[i] = alpha * (r[i] - m);
        }
    }
    b.broadcast(adv)
}

/// Fraction of groups whose rewards are all equal (their GRPO advantages are all 0).
pub fn frac_zero_std_groups<G: Eq + std::hash::Hash>(rewards: &[f64], uids: &[G]) -> f64 {
    let gs = groups(uids);
    let flat = gs
        .iter()
        .filter(|g| g.iter().all(|&i| rewards[i] == rewards[g[0]]))
        .count();
    flat as f64 / gs.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each response's advantage, checking that all its tokens share it.
    fn close(adv: &[Vec<f64>], b: &[f64]) {
        close_within(adv, b, 1e-9)
    }

    /// [`close`] to `tol`: whitening divides its means by `N + 1e-8` as verl does, which moves
    /// whitened values by ~1e-8 from the exact-mean numbers written by hand below.
    fn close_within(adv: &[Vec<f64>], b: &[f64], tol: f64) {
        let a: Vec<f64> = adv
            .iter()
            .map(|row| {
                assert!(row.iter().all(|x| *x == row[0]), "{row:?}");
                row[0]
            })
            .collect();
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn grpo_normalises_by_unbiased_std_per_group() {
        // Group a: rewards 1, 0 → mean 0.5, unbiased std √0.5 → ±0.5/√0.5 = ±√0.5.
        // Group b: all equal → 0 (the ε keeps 0/0 away).
        let cfg = AdvantageConfig::default();
        let adv = compute_advantages(&[1.0, 2.0, 0.0, 2.0], &["a", "b", "a", "b"], &[1; 4], &cfg)
            .unwrap();
        let h = 0.5 / (0.5f64.sqrt() + 1e-6);
        close(&adv, &[h, 0.0, -h, 0.0]);
        assert_eq!(
            frac_zero_std_groups(&[1.0, 2.0, 0.0, 2.0], &["a", "b", "a", "b"]),
            0.5
        );
    }

    #[test]
    fn dr_grpo_only_subtracts_the_mean() {
        let cfg = AdvantageConfig {
            norm_adv_by_std: false,
            ..Default::default()
        };
        let adv = compute_advantages(&[1.0, 0.0, 0.5], &[0, 0, 0], &[1; 3], &cfg).unwrap();
        close(&adv, &[0.5, -0.5, 0.0]);
    }

    #[test]
    fn dr_grpo_defaults_to_no_std() {
        let estimator = AdvantageEstimator::from_name("dr_grpo").unwrap();
        assert!(!estimator.norm_adv_by_std_default());
        let cfg = AdvantageConfig {
            estimator,
            norm_adv_by_std: estimator.norm_adv_by_std_default(),
            ..Default::default()
        };
        let adv = compute_advantages(&[1.0, 0.0, 0.5], &[0, 0, 0], &[1; 3], &cfg).unwrap();
        close(&adv, &[0.5, -0.5, 0.0]);
    }

    #[test]
    fn rloo_uses_the_mean_of_the_others() {
        // r = 3, 0, 0: A_0 = 3 − 0 = 3, A_1 = 0 − 1.5 = −1.5.
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::Rloo,
            ..Default::default()
        };
        let adv = compute_advantages(&[3.0, 0.0, 0.0], &[0, 0, 0], &[1; 3], &cfg).unwrap();
        close(&adv, &[3.0, -1.5, -1.5]);
    }

    #[test]
    fn opo_weights_the_baseline_by_length() {
        // Group: r = 1 (3 tokens), 0 (1 token): baseline (3·1 + 1·0) / 4 = 0.75.
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::Opo,
            ..Default::default()
        };
        let adv = compute_advantages(&[1.0, 0.0], &[0, 0], &[3, 1], &cfg).unwrap();
        assert_eq!(adv, vec![vec![0.25; 3], vec![-0.75]]);
    }

    #[test]
    fn gpg_scales_by_the_share_of_nonzero_rewards() {
        // r = 1, 0, 0, 0 in one group: mean 0.25, α = 4 / 1 = 4 → 3, −1, −1, −1; a group of one
        // (r = 0.5) in the same batch: α = 5 / 2, mean 0.
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::Gpg,
            ..Default::default()
        };
        let adv = compute_advantages(&[1.0, 0.0, 0.0, 0.0], &[0; 4], &[1; 4], &cfg).unwrap();
        close(&adv, &[3.0, -1.0, -1.0, -1.0]);
        let adv = compute_advantages(&[1.0, 0.0, 0.0, 0.0, 0.5], &[0, 0, 0, 0, 1], &[1; 5], &cfg)
            .unwrap();
        close(&adv, &[1.875, -0.625, -0.625, -0.625, 1.25]);
    }

    #[test]
    fn a_group_of_one_keeps_its_reward() {
        let adv = compute_advantages(&[0.7], &[0], &[3], &AdvantageConfig::default()).unwrap();
        close(&adv, &[0.7]);
    }

    #[test]
    fn reinforce_baseline_whitens_over_tokens() {
        // Group means removed: [1, -1] (one group of r = 2, 0). Tokens: 1 and 3 → values
        // 1, -1, -1, -1: mean -0.5, unbiased var (2.25 + 3·0.25)/3 = 1.
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::ReinforceBaseline,
            ..Default::default()
        };
        let adv = compute_advantages(&[2.0, 0.0], &[0, 0], &[1, 3], &cfg).unwrap();
        close_within(&adv, &[1.5, -0.5], 1e-7);
    }

    #[test]
    fn reinforce_plus_plus_discounts_the_reward_back_through_the_response() {
        // One response, reward 1 over 3 tokens, γ = 0.5: returns 0.25, 0.5, 1 (mean 7/12),
        // whitened with their unbiased variance.
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::ReinforcePlusPlus,
            gamma: 0.5,
            ..Default::default()
        };
        let adv = compute_advantages(&[1.0], &[0], &[3], &cfg).unwrap();
        let m = 7.0 / 12.0;
        let var = [0.25f64, 0.5, 1.0]
            .iter()
            .map(|x| (x - m).powi(2))
            .sum::<f64>()
            / 2.0;
        let s = 1.0 / (var + 1e-8).sqrt();
        for (got, r) in adv[0].iter().zip([0.25, 0.5, 1.0]) {
            assert!((got - (r - m) * s).abs() < 1e-7, "{adv:?}");
        }
        // γ = 1: every token carries the whole reward, as reinforce_baseline without the mean.
        let flat = AdvantageConfig { gamma: 1.0, ..cfg };
        let adv = compute_advantages(&[1.0, 0.0], &["a", "b"], &[1, 3], &flat).unwrap();
        close_within(&adv, &[0.75 / 0.5, -0.25 / 0.5], 1e-7);
    }

    #[test]
    fn names_resolve_and_unknown_names_list_the_valid_ones() {
        assert_eq!(
            AdvantageEstimator::from_name("rloo").unwrap(),
            AdvantageEstimator::Rloo
        );
        let e = AdvantageEstimator::from_name("ppo")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gae") && e.contains("grpo"), "{e}");
    }

    #[test]
    fn gae_needs_values_and_bootstraps_from_them() {
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::Gae,
            gamma: 0.9,
            lam: 0.5,
            ..Default::default()
        };
        let e = compute_advantages(&[1.0], &[0], &[2], &cfg).unwrap_err();
        assert!(e.to_string().contains("[critic]"), "{e}");
        // As `returns::gae`'s hand-checked case: reward 1 at the last of 2 tokens, V = [0.5, 0.2]:
        // returns [0.54, 1.0], advantages ±1/√2 after whitening.
        let values = vec![vec![0.5, 0.2]];
        let inputs = AdvantageInputs {
            rewards: &[1.0],
            uids: &[0],
            token_counts: &[2],
            token_penalties: None,
            values: Some(&values),
        };
        let out = estimate_advantages(&inputs, &cfg).unwrap();
        assert!(
            (out.returns[0][0] - 0.54).abs() < 1e-12 && (out.returns[0][1] - 1.0).abs() < 1e-12
        );
        let h = 0.5f64.sqrt();
        assert!((out.advantages[0][0] + h).abs() < 1e-7 && (out.advantages[0][1] - h).abs() < 1e-7);
        let short = vec![vec![0.5]];
        let e = estimate_advantages(
            &AdvantageInputs {
                values: Some(&short),
                ..inputs
            },
            &cfg,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("[1] for responses of [2] tokens"),
            "{e}"
        );
    }

    #[test]
    fn per_token_penalties_enter_the_returns_and_the_group_scores_as_their_sum() {
        // Rewards 1 and 0, penalties −0.1 on each of two tokens.
        let penalties = vec![vec![-0.1, -0.1], vec![-0.1, -0.1]];
        let inputs = AdvantageInputs {
            rewards: &[1.0, 0.0],
            uids: &[0, 0],
            token_counts: &[2, 2],
            token_penalties: Some(&penalties),
            values: None,
        };
        // REINFORCE++ with γ = 1: returns are the reward-to-go, [0.8, 0.9] and [−0.2, −0.1].
        let rpp = AdvantageConfig {
            estimator: AdvantageEstimator::ReinforcePlusPlus,
            ..Default::default()
        };
        let out = estimate_advantages(&inputs, &rpp).unwrap();
        let want = [[0.8, 0.9], [-0.2, -0.1]];
        for (got, want) in out.returns.iter().flatten().zip(want.iter().flatten()) {
            assert!((got - want).abs() < 1e-12, "{:?}", out.returns);
        }
        // Dr. GRPO scores each response by its summed token rewards, 0.8 and −0.2: ±0.5.
        let dr = AdvantageConfig {
            estimator: AdvantageEstimator::DrGrpo,
            norm_adv_by_std: false,
            ..Default::default()
        };
        let out = estimate_advantages(&inputs, &dr).unwrap();
        close(&out.advantages, &[0.5, -0.5]);
        assert_eq!(out.returns, out.advantages);
    }
}
