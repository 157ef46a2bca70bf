//! The KL penalty in the reward (`docs/rl-algorithms.md`, "KL to the reference policy": "or in
//! the reward"), as verl's `apply_kl_penalty`: every response token's reward gets
//! `−β·KL_t(logp_old ‖ logp_ref)`, and β is held fixed or moved by the adaptive controller of
//! Ziegler et al. (2019) towards a target KL. The KL loss term is then off: the two are
//! exclusive.

use crate::kl::{kl_per_token, KlEstimator};
use candle_core::{Device, Result, Tensor};

/// How β moves from step to step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KlControl {
    Fixed,
    /// `β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon)` after each step of `n` responses
    /// (verl's `AdaptiveKLController`).
    Adaptive {
        target: f64,
        horizon: f64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct KlInReward {
    /// β now (the configured `kl_coef` at the start).
    pub coef: f64,
    pub control: KlControl,
    pub estimator: KlEstimator,
}

/// One batch's penalties and the KL they came from.
#[derive(Debug, Clone, PartialEq)]
pub struct KlPenalty {
    /// `−β·KL_t` per response token.
    pub penalties: Vec<Vec<f64>>,
    /// The batch's KL: each response's mean over its tokens, averaged over the responses.
    pub kl: f64,
    /// The β these penalties used.
    pub coef: f64,
}

impl KlInReward {
    /// The penalties of a batch from the policy that sampled it (`old`) and the reference,
    /// per token; then β moves for the next step (adaptive control).
    pub fn apply(&mut self, old: &[Vec<f32>], reference: &[Vec<f32>]) -> Result<KlPenalty> {
        let mut penalties = Vec::with_capacity(old.len());
        let mut seq_means = Vec::with_capacity(old.len());
        for (o, r) in old.iter().zip(reference) {
            let n = o.len();
            let kl: Vec<f64> = match n {
                0 => Vec::new(),
                _ => {
                    let o = Tensor::from_slice(o, n, &Device::Cpu)?;
                    let r = Tensor::from_slice(r, n, &Device::Cpu)?;
                    kl_per_token(self.estimator, &o, &r)?
                        .to_vec1::<f32>()?
                        .into_iter()
                        .map(f64::from)
                        .collect()
                }
            };
            if n > 0 {
                seq_means.push(kl.iter().sum::<f64>() / n as f64);
            }
            penalties.push(kl.iter().map(|k| -self.coef * k).collect());
        }
        let kl = seq_means.iter().sum::<f64>() / seq_means.len().max(1) as f64;
        let used = self.coef;
        self.update(kl, old.len());
        Ok(KlPenalty {
            penalties,
            kl,
            coef: used,
        })
    }

    /// Moves β after a step of `n` responses whose KL was `kl`.
    pub fn update(&mut self, kl: f64, n: usize) {
        if let KlControl::Adaptive { target, horizon } = self.control {
            let error = (kl / target - 1.0).clamp(-0.2, 0.2);
            self.coef *= 1.0 + error * n as f64 / horizon;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adaptive(coef: f64) -> KlInReward {
        KlInReward {
            coef,
            control: KlControl::Adaptive {
                target: 0.1,
                horizon: 100.0,
            },
            estimator: KlEstimator::K1,
        }
    }

    #[test]
    fn penalties_are_minus_beta_times_the_per_token_kl() {
        // k1: δ = old − ref = [0.5, −0.25] and [1.0]; β = 0.2.
        let mut k = KlInReward {
            coef: 0.2,
            control: KlControl::Fixed,
            estimator: KlEstimator::K1,
        };
        let out = k
            .apply(
                &[vec![0.0, -1.0], vec![-1.0]],
                &[vec![-0.5, -0.75], vec![-2.0]],
            )
            .unwrap();
        let want = [vec![-0.1, 0.05], vec![-0.2]];
        for (got, want) in out.penalties.iter().flatten().zip(want.iter().flatten()) {
            assert!((got - want).abs() < 1e-7, "{:?}", out.penalties);
        }
        // Per-response means 0.125 and 1.0: the batch KL is their mean, 0.5625.
        assert!((out.kl - 0.5625).abs() < 1e-7);
        assert_eq!((out.coef, k.coef), (0.2, 0.2));
    }

    #[test]
    fn the_adaptive_controller_moves_beta_towards_the_target_at_most_twenty_percent() {
        // KL 0.15 over a target of 0.1: error 0.5, clipped to 0.2; 10 responses over a horizon
        // of 100: β ← β·(1 + 0.2·0.1) = 1.02β.
        let mut k = adaptive(0.5);
        k.update(0.15, 10);
        assert!((k.coef - 0.51).abs() < 1e-12);
        // KL 0.09: error −0.1: β ← β·(1 − 0.1·0.1) = 0.99β.
        let mut k = adaptive(0.5);
        k.update(0.09, 10);
        assert!((k.coef - 0.495).abs() < 1e-12);
        // The step's penalties use β before the move.
        let mut k = adaptive(0.5);
        let out = k.apply(&[vec![0.0]], &[vec![-1.0]]).unwrap();
        assert_eq!(out.coef, 0.5);
        assert!((k.coef - 0.5 * (1.0 + 0.2 / 100.0)).abs() < 1e-12);
    }
}
