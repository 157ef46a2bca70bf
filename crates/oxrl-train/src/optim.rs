//! AdamW with f32 master weights and moments (as `torch.optim.AdamW` computes it), global-norm
//! gradient clipping (as `torch.nn.utils.clip_grad_norm_`), and learning-rate schedules.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// The state of one parameter: its f32 master copy and both moments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamState {
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamW {
    pub config: AdamWConfig,
    /// Optimizer steps taken.
    pub step: u64,
    pub params: Vec<ParamState>,
}

impl AdamW {
    /// Starts from the current values of every parameter (moments at zero).
    pub fn new(config: AdamWConfig, initial: Vec<Vec<f32>>) -> Self {
        let params = initial
            .into_iter()
            .map(|master| ParamState {
                exp_avg: vec![0.0; master.len()],
                exp_avg_sq: vec![0.0; master.len()],
                master,
            })
            .collect();
        Self {
            config,
            step: 0,
            params,
        }
    }

    /// One step at learning rate `lr` with gradients `grads` (one per parameter, in order);
    /// updates the master weights, which the caller copies back into the model.
    pub fn step(&mut self, grads: &[Vec<f32>], lr: f64) {
        self.step += 1;
        let c = self.config;
        let (b1, b2) = c.betas;
        let bias1 = 1.0 - b1.powi(self.step as i32);
        let bias2_sqrt = (1.0 - b2.powi(self.step as i32)).sqrt();
        let decay = (1.0 - lr * c.weight_decay) as f32;
        let step_size = (lr / bias1) as f32;
        let (w1, w2) = ((1.0 - b1) as f32, (1.0 - b2) as f32);
        let (b2f, bias2_sqrt, eps) = (b2 as f32, bias2_sqrt as f32, c.eps as f32);
        for (p, g) in self.params.iter_mut().zip(grads) {
            let moments = p.exp_avg.iter_mut().zip(p.exp_avg_sq.iter_mut());
            for ((w, &gi), (m, v)) in p.master.iter_mut().zip(g).zip(moments) {
                *w *= decay;
                *m += w1 * (gi - *m);
                *v = *v * b2f + w2 * gi * gi;
                let denom = v.sqrt() / bias2_sqrt + eps;
                *w -= step_size * *m / denom;
            }
        }
    }
}

/// Scales `grads` so their global L2 norm is at most `max_norm` (torch's `clip_grad_norm_`:
/// coefficient `max_norm / (norm + 1e-6)`, clamped at 1); returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [Vec<f32>], max_norm: f64) -> f64 {
    let total = grads
        .iter()
        .map(|g| g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
        .sum::<f64>()
        .sqrt();
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for g in grads.iter_mut() {
            for x in g.iter_mut() {
                *x *= coef as f32;
            }
        }
    }
    total
}

/// How the learning rate moves with the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// Linear warmup, then constant.
    Constant,
    /// Linear warmup, then linear decay to 0 at the last step.
    Linear,
    /// Linear warmup, then a half cosine to 0 at the last step.
    Cosine,
}

impl LrSchedule {
    pub const NAMES: [&'static str; 3] = ["constant", "linear", "cosine"];

    /// The learning rate of 0-based optimizer step `step` out of `total`, as transformers'
    /// `get_*_schedule_with_warmup` (a warmup step `s` runs at `lr · s / warmup`).
    pub fn lr(self, base: f64, step: u64, warmup: u64, total: u64) -> f64 {
        if step < warmup {
            return base * step as f64 / warmup.max(1) as f64;
        }
        let span = total.saturating_sub(warmup).max(1) as f64;
        let progress = ((step - warmup) as f64 / span).min(1.0);
        match self {
            LrSchedule::Constant => base,
            LrSchedule::Linear => base * (1.0 - progress).max(0.0),
            LrSchedule::Cosine => base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_adamw_step_moves_by_lr_sign_after_decay() {
        // Step 1: p ← p(1 − lr·wd) − lr·g/(|g| + eps).
        let cfg = AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut opt = AdamW::new(cfg, vec![vec![1.0, -2.0, 0.5]]);
        opt.step(&[vec![0.5, -3.0, 0.0]], 1e-3);
        let want = [
            1.0 * (1.0 - 1e-5) - 1e-3,
            -2.0 * (1.0 - 1e-5) + 1e-3,
            0.5 * (1.0 - 1e-5),
        ];
        for (p, w) in opt.params[0].master.iter().zip(want) {
            assert!((*p as f64 - w).abs() < 1e-6, "{p} vs {w}");
        }
    }

    #[test]
    fn second_adamw_step_uses_bias_corrected_moments() {
        // g = 1 twice, no decay: m = 0.19, v = 0.001999; m̂ = 0.19/0.19 = 1, v̂ = 1 → each step
        // moves by lr/(1 + eps).
        let cfg = AdamWConfig {
            lr: 0.1,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut opt = AdamW::new(cfg, vec![vec![0.0]]);
        opt.step(&[vec![1.0]], 0.1);
        opt.step(&[vec![1.0]], 0.1);
        assert!((opt.params[0].master[0] + 0.2).abs() < 1e-6);
        assert!((opt.params[0].exp_avg[0] - 0.19).abs() < 1e-7);
    }

    #[test]
    fn clipping_scales_to_max_norm_and_reports_the_prior_norm() {
        let mut g = vec![vec![3.0], vec![4.0]];
        assert_eq!(clip_grad_norm(&mut g, 1.0), 5.0);
        assert!((g[0][0] - 0.6).abs() < 1e-6 && (g[1][0] - 0.8).abs() < 1e-6);
        let mut small = vec![vec![0.3], vec![0.4]];
        clip_grad_norm(&mut small, 1.0);
        assert_eq!(small, vec![vec![0.3], vec![0.4]]);
    }

    #[test]
    fn schedules_warm_up_then_follow_their_shape() {
        let (base, warm, total) = (1.0, 2, 12);
        assert_eq!(LrSchedule::Constant.lr(base, 0, warm, total), 0.0);
        assert_eq!(LrSchedule::Constant.lr(base, 1, warm, total), 0.5);
        assert_eq!(LrSchedule::Constant.lr(base, 7, warm, total), 1.0);
        assert_eq!(LrSchedule::Linear.lr(base, 7, warm, total), 0.5);
        assert!((LrSchedule::Cosine.lr(base, 7, warm, total) - 0.5).abs() < 1e-12);
        assert!(LrSchedule::Cosine.lr(base, 12, warm, total).abs() < 1e-12);
    }
}
