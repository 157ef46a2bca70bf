//! The loss of one micro-batch: the policy-gradient term, the KL penalty and the entropy bonus,
//! each aggregated with weights from the whole mini-batch's totals, and what they measured.
//! Math only: the forward that produced the log-probs, gradient accumulation and the optimizer
//! live in `update.rs`.
//!
//! L = Σ_t w_t · L_pg,t  +  β · Σ_t w^KL_t · KL_t  −  c_H · Σ_t w_t · H_t
//! (`docs/rl-algorithms.md`: policy losses, KL estimators, aggregation).

use crate::update::AlgorithmConfig;
use candle_core::{Result, Tensor};
use oxrl_algo::{kl_per_token, masked_token_weights, policy_loss, token_weights, BatchTotals};

/// One micro-batch's per-token tensors, flat `[N]` over its response tokens in order.
pub struct MicroBatch<'a> {
    /// log π_θ of each response token (differentiable).
    pub logp: &'a Tensor,
    /// Entropy per token (differentiable only when the bonus is on).
    pub entropy: &'a Tensor,
    /// log π_old per token.
    pub old_logp: &'a Tensor,
    /// The sequence's advantage, repeated over its tokens.
    pub advantages: &'a Tensor,
    /// log π_ref per token, when the KL term is on.
    pub ref_logp: Option<&'a Tensor>,
    /// Response length of each sequence.
    pub lens: &'a [usize],
    /// Totals of the mini-batch this micro-batch belongs to (aggregation weights).
    pub totals: &'a BatchTotals,
    /// Rollout correction's importance-sampling weight per token (detached), multiplied into
    /// the policy-gradient term.
    pub is_weights: Option<&'a Tensor>,
    /// Rollout correction's rejection: tokens to keep; the others leave every term and the
    /// totals (which then count kept tokens only).
    pub keep: Option<&'a [bool]>,
}

/// What one micro-batch's loss measured (each term already aggregated, so summing over the
/// micro-batches of a mini-batch gives the mini-batch's value).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossMetrics {
    pub loss: f64,
    pub pg_loss: f64,
    /// The aggregated KL term before β (0 without a reference).
    pub kl: f64,
    pub entropy: f64,
    pub tokens: usize,
    /// Tokens where the clipped term was taken, and where the dual clip was.
    pub clipped: usize,
    pub dual_clipped: usize,
    /// Σ_t (log π_old − log π_θ), for the mean approximate KL between old and current policy.
    pub ppo_kl_sum: f64,
    /// ρ per token (the sequence ratio for GSPO).
    pub ratio: Vec<f32>,
}

/// The micro-batch's loss (to be backpropagated) and its metrics.
pub fn micro_batch_loss(algo: &AlgorithmConfig, mb: &MicroBatch) -> Result<(Tensor, LossMetrics)> {
    let n = mb.logp.dims1()?;
    let dev = mb.logp.device();
    let weights = |agg| {
        let w = match mb.keep {
            Some(keep) => masked_token_weights(agg, mb.lens, keep, mb.totals),
            None => token_weights(agg, mb.lens, mb.totals),
        };
        Tensor::from_vec(w, n, dev)
    };
    let pl = policy_loss(
        &algo.policy_loss,
        mb.logp,
        mb.old_logp,
        mb.advantages,
        mb.lens,
    )?;
    let w = weights(algo.loss_agg)?;
    let per_token = match mb.is_weights {
        Some(is) => (&pl.per_token * is)?,
        None => pl.per_token.clone(),
    };
    let pg = (&per_token * &w)?.sum_all()?;
    let mut loss = pg.clone();
    let mut kl_value = 0.0;
    if let Some(ref_logp) = mb.ref_logp {
        let kw = weights(algo.kl_loss_agg)?;
        let kl = (kl_per_token(algo.kl_estimator, mb.logp, ref_logp)? * kw)?.sum_all()?;
        kl_value = kl.to_scalar::<f32>()? as f64;
        loss = (loss + (kl * algo.kl_coef)?)?;
    }
    let ent = (mb.entropy * &w)?.sum_all()?;
    let entropy = ent.to_scalar::<f32>()? as f64;
    if algo.entropy_coef != 0.0 {
        loss = (loss - (ent * algo.entropy_coef)?)?;
    }
    let logp = mb.logp.to_vec1::<f32>()?;
    let old = mb.old_logp.to_vec1::<f32>()?;
    let metrics = LossMetrics {
        loss: loss.to_scalar::<f32>()? as f64,
        pg_loss: pg.to_scalar::<f32>()? as f64,
        kl: kl_value,
        entropy,
        tokens: n,
        clipped: pl.clipped,
        dual_clipped: pl.dual_clipped,
        ppo_kl_sum: old.iter().zip(&logp).map(|(o, l)| (o - l) as f64).sum(),
        ratio: pl.ratio,
    };
    Ok((loss, metrics))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::update::OldLogprobs;
    use candle_core::Device;
    use oxrl_algo::{AdvantageConfig, KlEstimator, LossAgg, PolicyLossConfig};

    fn algo(kl_coef: f64, entropy_coef: f64) -> AlgorithmConfig {
        AlgorithmConfig {
            advantage: AdvantageConfig::default(),
            policy_loss: PolicyLossConfig::default(),
            kl_coef,
            kl_estimator: KlEstimator::K1,
            loss_agg: LossAgg::TokenMean,
            kl_loss_agg: LossAgg::TokenMean,
            loss_scale_factor: 1.0,
            old_logprobs: OldLogprobs::Recompute,
            entropy_coef,
            overlong_filter: false,
            rollout_correction: None,
            kl_in_reward: None,
        }
    }

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }

    /// On-policy (ρ = 1), token-mean over 3 tokens: L_pg = −mean(A) = −(1 + 1 − 2)/3 = 0;
    /// KL (k1) = mean(logp − ref) = mean(0.1, 0.2, 0.3) = 0.2 → β·0.2 = 0.02; entropy
    /// mean(0.5, 1.0, 1.5) = 1.0 → −c_H·1.0 = −0.01. Total 0.01.
    #[test]
    fn terms_add_up_by_hand() {
        let logp = t(&[-1.0, -2.0, -0.5]);
        let reference = t(&[-1.1, -2.2, -0.8]);
        let adv = t(&[1.0, 1.0, -2.0]);
        let entropy = t(&[0.5, 1.0, 1.5]);
        let totals = BatchTotals {
            tokens: 3,
            sequences: 2,
            loss_scale_factor: 1.0,
        };
        let mb = MicroBatch {
            logp: &logp,
            entropy: &entropy,
            old_logp: &logp,
            advantages: &adv,
            ref_logp: Some(&reference),
            lens: &[2, 1],
            totals: &totals,
            is_weights: None,
            keep: None,
        };
        let (loss, m) = micro_batch_loss(&algo(0.1, 0.01), &mb).unwrap();
        assert!((m.pg_loss - 0.0).abs() < 1e-6, "{}", m.pg_loss);
        assert!((m.kl - 0.2).abs() < 1e-6, "{}", m.kl);
        assert!((m.entropy - 1.0).abs() < 1e-6, "{}", m.entropy);
        assert!((m.loss - 0.01).abs() < 1e-6, "{}", m.loss);
        assert!((loss.to_scalar::<f32>().unwrap() as f64 - m.loss).abs() < 1e-9);
        assert_eq!((m.tokens, m.clipped, m.dual_clipped), (3, 0, 0));
        assert_eq!(m.ratio, vec![1.0, 1.0, 1.0]);
        assert_eq!(m.ppo_kl_sum, 0.0);
    }
}
