//! Policy-gradient losses per token, before aggregation, as in `docs/rl-algorithms.md`,
//! "Policy losses" (one section per registered name, with its paper).
//! Inputs are flat `[N]` tensors over the response tokens of consecutive sequences
//! (`seq_lens` gives their lengths); only `logp` carries a gradient.

use candle_core::{Result, Tensor};

/// Log-ratios are clamped to ±20 before `exp`, as verl and SkyRL do.
const LOG_RATIO_CLAMP: f32 = 20.0;
/// GSPO's sequence log-ratio is clamped above at 10 (verl).
const GSPO_LOG_RATIO_MAX: f32 = 10.0;

/// The tensors a loss reads; only `logp` carries a gradient.
struct Inputs<'a> {
    logp: &'a Tensor,
    old_logp: &'a Tensor,
    adv: &'a Tensor,
    seq_lens: &'a [usize],
}

type LossFn = fn(&PolicyLossConfig, &Inputs) -> Result<PolicyLossOutput>;

registry! {
    pub enum PolicyLoss: "policy loss" => LossFn {
        PpoClip = "ppo_clip" => ppo_clip,
            "L = max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)); for A < 0 optionally min(L, −c·A) (dual_clip_c)";
        Gspo = "gspo" => gspo,
            "the PPO clip on a sequence-level ratio s_i = exp(mean_t(logp − logp_old)) (GSPO)";
        Cispo = "cispo" => cispo, "L = −sg[clip(ρ, 1−ε_low, 1+ε_high)] · A · logp (CISPO)";
        Sapo = "sapo" => sapo,
            "L = −A·σ(τ(ρ − 1))·4/τ, τ = tau_pos for A > 0 and tau_neg otherwise: a smooth trust region instead of the clip (SAPO)";
        Gpg = "gpg" => gpg, "L = −A·logp: the policy gradient with no ratio (GPG)";
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossConfig {
    pub kind: PolicyLoss,
    pub clip_low: f64,
    pub clip_high: f64,
    /// The dual-clip constant c for negative advantages (`ppo_clip` only); `None` = no dual clip.
    pub dual_clip_c: Option<f64>,
    /// SAPO's gate temperatures for positive and for other advantages.
    pub tau_pos: f64,
    pub tau_neg: f64,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            kind: PolicyLoss::PpoClip,
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip_c: None,
            // verl's defaults (tau_neg > tau_pos: negative updates gated harder).
            tau_pos: 1.0,
            tau_neg: 1.05,
        }
    }
}

pub struct PolicyLossOutput {
    /// L per token, `[N]`, differentiable through `logp`.
    pub per_token: Tensor,
    /// The importance ratio per token (the sequence ratio for GSPO), for metrics.
    pub ratio: Vec<f32>,
    /// Tokens where the clipped term was the one taken (verl's `pg_clipfrac` numerator).
    pub clipped: usize,
    /// Tokens where the dual clip was taken.
    pub dual_clipped: usize,
}

/// Tokens where `−A·clip(ρ) > −A·ρ`, i.e. A > 0 and ρ > 1+ε_high, or A < 0 and ρ < 1−ε_low.
fn count_clipped(l1: &Tensor, l2: &Tensor) -> Result<usize> {
    let (a, b) = (l1.to_vec1::<f32>()?, l2.to_vec1::<f32>()?);
    Ok(a.iter().zip(&b).filter(|(x, y)| y > x).count())
}

/// `max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))` with its clip count.
fn clipped_surrogate(
    cfg: &PolicyLossConfig,
    ratio: &Tensor,
    adv: &Tensor,
) -> Result<(Tensor, usize)> {
    let neg_adv = adv.neg()?;
    let l1 = (&neg_adv * ratio)?;
    let clipped_ratio = ratio.clamp((1.0 - cfg.clip_low) as f32, (1.0 + cfg.clip_high) as f32)?;
    let l2 = (&neg_adv * clipped_ratio)?;
    let clipped = count_clipped(&l1, &l2)?;
    Ok((l1.maximum(&l2)?, clipped))
}

/// The per-token policy loss of `logp` against `old_logp` with advantages `adv` (all `[N]`).
pub fn policy_loss(
    cfg: &PolicyLossConfig,
    logp: &Tensor,
    old_logp: &Tensor,
    adv: &Tensor,
    seq_lens: &[usize],
) -> Result<PolicyLossOutput> {
    let inputs = Inputs {
        logp,
        old_logp,
        adv,
        seq_lens,
    };
    (cfg.kind.implementation())(cfg, &inputs)
}

/// ρ = exp(logp − logp_old) per token, the log-ratio clamped first.
fn token_ratio(x: &Inputs) -> Result<Tensor> {
    (x.logp - x.old_logp)?
        .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?
        .exp()
}

fn ppo_clip(cfg: &PolicyLossConfig, x: &Inputs) -> Result<PolicyLossOutput> {
    let ratio = token_ratio(x)?;
    let (mut per_token, clipped) = clipped_surrogate(cfg, &ratio, x.adv)?;
    let mut dual_clipped = 0;
    if let Some(c) = cfg.dual_clip_c {
        let cap = (x.adv.neg()? * c)?;
        let negative = x.adv.lt(0f32)?.to_dtype(per_token.dtype())?;
        let (l, capv, a) = (
            per_token.to_vec1::<f32>()?,
            cap.to_vec1::<f32>()?,
            x.adv.to_vec1::<f32>()?,
        );
        dual_clipped = (0..l.len())
            .filter(|&i| a[i] < 0.0 && l[i] > capv[i])
            .count();
        let capped = per_token.minimum(&cap)?;
        per_token = ((&negative * capped)? + ((1.0 - &negative)? * per_token)?)?;
    }
    Ok(PolicyLossOutput {
        per_token,
        ratio: ratio.to_vec1()?,
        clipped,
        dual_clipped,
    })
}

fn gspo(cfg: &PolicyLossConfig, x: &Inputs) -> Result<PolicyLossOutput> {
    // s_{i,t} = sg[s_i] · exp(logp − sg[logp]): the value of the sequence ratio, the
    // gradient of the token's own log-prob.
    let logp = x.logp;
    let diff = (logp - x.old_logp)?.to_vec1::<f32>()?;
    let mut seq_mean = Vec::with_capacity(diff.len());
    let mut at = 0;
    for &n in x.seq_lens {
        let m = diff[at..at + n].iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        seq_mean.extend(std::iter::repeat_n(m as f32, n));
        at += n;
    }
    let seq_mean = Tensor::from_vec(seq_mean, diff.len(), logp.device())?;
    let log_seq_ratio = ((logp - logp.detach())? + seq_mean)?.minimum(GSPO_LOG_RATIO_MAX)?;
    let seq_ratio = log_seq_ratio.exp()?;
    let (per_token, clipped) = clipped_surrogate(cfg, &seq_ratio, x.adv)?;
    Ok(PolicyLossOutput {
        per_token,
        ratio: seq_ratio.to_vec1()?,
        clipped,
        dual_clipped: 0,
    })
}

fn cispo(cfg: &PolicyLossConfig, x: &Inputs) -> Result<PolicyLossOutput> {
    let ratio = token_ratio(x)?;
    let lo = (1.0 - cfg.clip_low) as f32;
    let hi = (1.0 + cfg.clip_high) as f32;
    let weight = ratio.clamp(lo, hi)?.detach();
    let per_token = ((weight * x.adv)? * x.logp)?.neg()?;
    let r = ratio.to_vec1::<f32>()?;
    let clipped = r.iter().filter(|&&x| x < lo || x > hi).count();
    Ok(PolicyLossOutput {
        per_token,
        ratio: r,
        clipped,
        dual_clipped: 0,
    })
}

/// SAPO (Gao et al., *Soft Adaptive Policy Optimization*, 2025): the gate
/// f(ρ) = σ(τ(ρ − 1))·4/τ replaces the clip; its slope 4σ(1 − σ) is 1 on-policy and fades
/// smoothly as ρ leaves 1, faster for larger τ.
fn sapo(cfg: &PolicyLossConfig, x: &Inputs) -> Result<PolicyLossOutput> {
    let ratio = token_ratio(x)?;
    let adv = x.adv.to_vec1::<f32>()?;
    let taus: Vec<f32> = adv
        .iter()
        .map(|&a| if a > 0.0 { cfg.tau_pos } else { cfg.tau_neg } as f32)
        .collect();
    let tau = Tensor::from_vec(taus, adv.len(), x.logp.device())?;
    // σ(z) = 1 / (1 + e^{−z}), z = τ(ρ − 1).
    let z = ((&ratio - 1.0)? * &tau)?;
    let sigmoid = (z.neg()?.exp()? + 1.0)?.recip()?;
    let gate = ((sigmoid * 4.0)? / &tau)?;
    let per_token = (gate * x.adv)?.neg()?;
    Ok(PolicyLossOutput {
        per_token,
        ratio: ratio.to_vec1()?,
        clipped: 0,
        dual_clipped: 0,
    })
}

/// GPG (Chu et al., 2025): the plain policy gradient −A·logp, with `gpg`'s advantages.
fn gpg(_: &PolicyLossConfig, x: &Inputs) -> Result<PolicyLossOutput> {
    let ratio = token_ratio(x)?;
    Ok(PolicyLossOutput {
        per_token: (x.logp * x.adv)?.neg()?,
        ratio: ratio.to_vec1()?,
        clipped: 0,
        dual_clipped: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Loss values and d(Σ L)/d logp for single tokens.
    /// On-policy (ρ = 1) the gate is σ(0)·4/τ = 2/τ and its slope 1: L = −2A/τ, dL/dlogp = −A.
    /// At ρ = e (log-ratio 1), A = 1, τ = 1: L = −4σ(e − 1), slope 4σ(1 − σ)·ρ.
    #[test]
    fn sapo_gate_by_hand() {
        let cfg = PolicyLossConfig {
            kind: PolicyLoss::Sapo,
            ..Default::default()
        };
        let (l, g, clipped, _) = run(&cfg, &[-1.0, -2.0], &[-1.0, -2.0], &[2.0, -1.0], &[2]);
        close(&l, &[-4.0, 2.0 / 1.05]);
        close(&g, &[-2.0, 1.0]);
        assert_eq!(clipped, 0);
        let s = 1.0 / (1.0 + (-(1f32.exp() - 1.0)).exp());
        let (l, g, _, _) = run(&cfg, &[1.0], &[0.0], &[1.0], &[1]);
        close(&l, &[-4.0 * s]);
        close(&g, &[-4.0 * s * (1.0 - s) * 1f32.exp()]);
    }

    /// −A·logp: the loss is the log-prob times −A, its gradient −A whatever the ratio.
    #[test]
    fn gpg_is_the_plain_policy_gradient() {
        let cfg = PolicyLossConfig {
            kind: PolicyLoss::Gpg,
            ..Default::default()
        };
        let (l, g, _, _) = run(&cfg, &[-0.5, -2.0], &[-3.0, -2.0], &[1.5, -1.0], &[2]);
        close(&l, &[0.75, -2.0]);
        close(&g, &[-1.5, 1.0]);
    }

    fn run(
        cfg: &PolicyLossConfig,
        logp: &[f32],
        old: &[f32],
        adv: &[f32],
        lens: &[usize],
    ) -> (Vec<f32>, Vec<f32>, usize, usize) {
        let dev = Device::Cpu;
        let x = Var::new(logp, &dev).unwrap();
        let o = Tensor::new(old, &dev).unwrap();
        let a = Tensor::new(adv, &dev).unwrap();
        let out = policy_loss(cfg, x.as_tensor(), &o, &a, lens).unwrap();
        let g = out.per_token.sum_all().unwrap().backward().unwrap();
        let grad = g
            .get(x.as_tensor())
            .map(|t| t.to_vec1::<f32>().unwrap())
            .unwrap_or(vec![0.0; logp.len()]);
        (
            out.per_token.to_vec1().unwrap(),
            grad,
            out.clipped,
            out.dual_clipped,
        )
    }

    fn close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn ppo_clip_takes_the_pessimistic_term() {
        let cfg = PolicyLossConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            ..Default::default()
        };
        let l2 = 2f32.ln();
        // ρ = 2, A = 1: clipped at 1.28 → L = −1.28, no gradient.
        // ρ = 2, A = −1: unclipped −A·ρ = 2 is larger → L = 2, dL/dlogp = −A·ρ = 2.
        // ρ = 1, A = 0.5: inside the range → L = −0.5, gradient −0.5.
        let (l, g, clipped, _) = run(
            &cfg,
            &[l2, l2, 0.0],
            &[0.0, 0.0, 0.0],
            &[1.0, -1.0, 0.5],
            &[3],
        );
        close(&l, &[-1.28, 2.0, -0.5]);
        close(&g, &[0.0, 2.0, -0.5]);
        assert_eq!(clipped, 1);
    }

    #[test]
    fn dual_clip_caps_negative_advantages_at_c() {
        let cfg = PolicyLossConfig {
            dual_clip_c: Some(3.0),
            ..Default::default()
        };
        // ρ = 4.26 (log 1.45), A = −1: −A·ρ = 4.26 > c·(−A) = 3 → L = 3 with no gradient.
        let (l, g, _, dual) = run(&cfg, &[1.45], &[0.0], &[-1.0], &[1]);
        close(&l, &[3.0]);
        close(&g, &[0.0]);
        assert_eq!(dual, 1);
        // Without it, L = 4.26.
        let (l, _, _, _) = run(&PolicyLossConfig::default(), &[1.45], &[0.0], &[-1.0], &[1]);
        close(&l, &[1.45f32.exp()]);
    }

    #[test]
    fn gspo_uses_the_sequence_mean_log_ratio() {
        let cfg = PolicyLossConfig {
            kind: PolicyLoss::Gspo,
            clip_low: 0.5,
            clip_high: 0.5,
            ..Default::default()
        };
        // Sequence of two tokens with log-ratios 0.2 and 0.0: s = e^{0.1}; A = 1 → L = −s per
        // token, gradient −s on each token's logp.
        let (l, g, clipped, _) = run(&cfg, &[0.2, 0.0], &[0.0, 0.0], &[1.0, 1.0], &[2]);
        let s = 0.1f32.exp();
        close(&l, &[-s, -s]);
        close(&g, &[-s, -s]);
        assert_eq!(clipped, 0);
    }

    #[test]
    fn cispo_weights_logp_by_the_clipped_ratio_without_its_gradient() {
        let cfg = PolicyLossConfig {
            kind: PolicyLoss::Cispo,
            clip_low: 0.2,
            clip_high: 0.2,
            ..Default::default()
        };
        // logp = log 2, old = 0: ρ = 2 → weight 1.2; A = 1: L = −1.2·log 2, dL/dlogp = −1.2.
        let (l, g, clipped, _) = run(&cfg, &[2f32.ln()], &[0.0], &[1.0], &[1]);
        close(&l, &[-1.2 * 2f32.ln()]);
        close(&g, &[-1.2]);
        assert_eq!(clipped, 1);
    }
}
