//! Rollout correction: the engine that sampled a response (vLLM in bf16, say) and the trainer
//! that recomputes `logp_old` (f32) disagree a little about every token's probability, so the
//! samples are slightly off-policy. With r_t = log π_old(y_t) − log π_rollout(y_t) per token:
//!
//! - **Importance sampling** (`rollout_is`): each token's policy-gradient loss is multiplied by
//!   a weight w, detached — per token w_t = exp(r_t), or per sequence w = exp(Σ_t r_t) on all its
//!   tokens —, truncated at an upper bound C (TIS: min(w, C)), or zeroed outside [lower, upper]
//!   (IcePop, when a lower bound is given). Exponents are clamped to ±20.
//! - **Rejection** (`rollout_rs`): tokens or whole sequences whose divergence leaves a bound
//!   are masked out of every loss term and out of the aggregation's totals. Divergences per
//!   token: k1 = −r, k2 = r²/2, k3 = eᴿ − 1 − r (r clamped to ±20); a rule takes them per token
//!   (`token_kN`), or a sequence's sum, mean or max (`seq_sum_kN`, `seq_mean_kN`, `seq_max_kN`).
//!   k1 rules keep values within [ln lower, ln upper] (lower defaults to 1/upper), so
//!   `seq_mean_k1` bounds the geometric mean of the sequence's ratios; k2/k3 rules keep values
//!   at most upper.
//!
//! The names, thresholds and `rollout_corr/*` metrics are verl's (`rollout_corr_helper.py`,
//! verl 0.9.1); `tests/verl_agreement.rs` checks the weights, masks and metrics against numbers
//! verl computed.

use std::collections::BTreeMap;

/// Exponents are clamped to ±this before `exp`.
pub const SAFETY_BOUND: f64 = 20.0;

/// Where importance-sampling weights are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsLevel {
    Token,
    Sequence,
}

/// `rollout_is` and its threshold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IsConfig {
    pub level: IsLevel,
    /// The truncation bound C.
    pub upper: f64,
    /// IcePop: weights below this (or above `upper`) become 0 instead of being truncated.
    pub lower: Option<f64>,
}

impl IsConfig {
    /// `level` = "token" | "sequence"; `threshold` = "C" (truncate) or "lower_upper" (IcePop).
    pub fn parse(level: &str, threshold: &str) -> Result<Self, String> {
        let level = match level {
            "token" => IsLevel::Token,
            "sequence" => IsLevel::Sequence,
            other => return Err(format!("`{other}`: expected \"token\" or \"sequence\"")),
        };
        let (lower, upper) = parse_bounds(threshold)?;
        if let Some(l) = lower {
            if l > upper {
                return Err(format!("`{threshold}`: the lower bound exceeds the upper"));
            }
        }
        Ok(IsConfig {
            level,
            upper,
            lower,
        })
    }
}

/// Which divergence a rejection rule bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Divergence {
    K1,
    K2,
    K3,
}

/// Over what a rejection rule takes the divergence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Token,
    SeqSum,
    SeqMean,
    SeqMax,
}

/// One `rollout_rs` option with its threshold.
#[derive(Debug, Clone, PartialEq)]
pub struct RejectRule {
    pub name: String,
    pub scope: Scope,
    pub divergence: Divergence,
    /// k1 rules: the natural-log bounds; others: `lower` is `None`.
    pub lower: Option<f64>,
    pub upper: f64,
}

/// The `rollout_rs` options verl offers.
pub const REJECT_RULES: [&str; 11] = [
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
];

impl RejectRule {
    /// `name` one of [`REJECT_RULES`]; `threshold` "upper" (k1: the ratio bound, lower 1/upper)
    /// or, for k1 rules, "lower_upper".
    pub fn parse(name: &str, threshold: &str) -> Result<Self, String> {
        if !REJECT_RULES.contains(&name) {
            return Err(format!(
                "`{name}`: expected one of {}",
                REJECT_RULES.join(", ")
            ));
        }
        let (scope, k) = name.rsplit_once('_').unwrap_or((name, ""));
        let divergence = match k {
            "k1" => Divergence::K1,
            "k2" => Divergence::K2,
            _ => Divergence::K3,
        };
        let scope = match scope {
            "token" => Scope::Token,
            "seq_sum" => Scope::SeqSum,
            "seq_mean" => Scope::SeqMean,
            _ => Scope::SeqMax,
        };
        let (lower, upper) = parse_bounds(threshold)?;
        let (lower, upper) = match divergence {
            Divergence::K1 => {
                let lower = lower.unwrap_or(1.0 / upper);
                if lower > upper {
                    return Err(format!("`{threshold}`: the lower bound exceeds the upper"));
                }
                (Some(lower.ln()), upper.ln())
            }
            _ if lower.is_some() => {
                return Err(format!(
                    "`{threshold}` for {name}: one upper bound (only k1 rules take lower_upper)"
                ))
            }
            _ => (None, upper),
        };
        Ok(RejectRule {
            name: name.to_string(),
            scope,
            divergence,
            lower,
            upper,
        })
    }

    fn keeps(&self, value: f64) -> bool {
        match self.lower {
            Some(lower) => value >= lower && value <= self.upper,
            None => value <= self.upper,
        }
    }
}

/// "C" or "lower_upper", each positive.
fn parse_bounds(threshold: &str) -> Result<(Option<f64>, f64), String> {
    let number = |s: &str| -> Result<f64, String> {
        s.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| {
                format!("`{threshold}`: expected positive numbers, as \"2.0\" or \"0.5_2.0\"")
            })
    };
    match threshold.split_once('_') {
        Some((lower, upper)) => Ok((Some(number(lower)?), number(upper)?)),
        None => Ok((None, number(threshold)?)),
    }
}

/// `[algorithm] rollout_is` / `rollout_rs` as configured: either part may be off.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrectionConfig {
    pub is: Option<IsConfig>,
    pub rules: Vec<RejectRule>,
}

/// What rollout correction decided for a batch: per-token IS weights and keep flags (`None`
/// when that part is off), and the `rollout_corr/*` metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Correction {
    pub weights: Option<Vec<Vec<f64>>>,
    pub keep: Option<Vec<Vec<bool>>>,
    pub metrics: BTreeMap<String, f64>,
}

/// Rollout correction of a batch from each response's `old` (trainer) and `rollout` (engine)
/// log-probs, token for token.
pub fn rollout_correction(
    old: &[Vec<f32>],
    rollout: &[Vec<f32>],
    is: Option<&IsConfig>,
    rules: &[RejectRule],
) -> Correction {
    let log_ratio: Vec<Vec<f64>> = old
        .iter()
        .zip(rollout)
        .map(|(o, r)| {
            o.iter()
                .zip(r)
                .map(|(&o, &r)| o as f64 - r as f64)
                .collect()
        })
        .collect();
    let mut metrics = BTreeMap::new();
    let weights = is.map(|cfg| is_weights(&log_ratio, cfg, &mut metrics));
    let keep = (!rules.is_empty()).then(|| rejection(&log_ratio, rules, &mut metrics));
    offpolicy_metrics(old, rollout, &log_ratio, &mut metrics);
    Correction {
        weights,
        keep,
        metrics: metrics
            .into_iter()
            .map(|(k, v)| (format!("rollout_corr/{k}"), v))
            .collect(),
    }
}

fn clamp(x: f64) -> f64 {
    x.clamp(-SAFETY_BOUND, SAFETY_BOUND)
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    sum / n.max(1) as f64
}

fn is_weights(
    log_ratio: &[Vec<f64>],
    cfg: &IsConfig,
    m: &mut BTreeMap<String, f64>,
) -> Vec<Vec<f64>> {
    let raw: Vec<Vec<f64>> = match cfg.level {
        IsLevel::Token => log_ratio
            .iter()
            .map(|r| r.iter().map(|&x| clamp(x).exp()).collect())
            .collect(),
        IsLevel::Sequence => log_ratio
            .iter()
            .map(|r| vec![clamp(r.iter().sum()).exp(); r.len()])
            .collect(),
    };
    let applied: Vec<Vec<f64>> = raw
        .iter()
        .map(|seq| {
            seq.iter()
                .map(|&w| match cfg.lower {
                    None => w.min(cfg.upper),
                    Some(lower) if w >= lower && w <= cfg.upper => w,
                    Some(_) => 0.0,
                })
                .collect()
        })
        .collect();
    let lower = cfg.lower.unwrap_or(1.0 / cfg.upper);
    let tokens = || applied.iter().flatten().copied();
    m.insert("rollout_is_mean".into(), mean(tokens()));
    match cfg.level {
        IsLevel::Token => {
            let raw_tokens = || raw.iter().flatten().copied();
            m.insert(
                "rollout_is_max".into(),
                tokens().fold(f64::NEG_INFINITY, f64::max),
            );
            m.insert(
                "rollout_is_min".into(),
                tokens().fold(f64::INFINITY, f64::min),
            );
            m.insert(
                "rollout_is_ratio_fraction_high".into(),
                mean(raw_tokens().map(|w| (w > cfg.upper) as u8 as f64)),
            );
            m.insert(
                "rollout_is_ratio_fraction_low".into(),
                mean(raw_tokens().map(|w| (w < lower) as u8 as f64)),
            );
        }
        IsLevel::Sequence => {
            let sums: Vec<f64> = log_ratio.iter().map(|r| r.iter().sum()).collect();
            let max = sums.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let min = sums.iter().copied().fold(f64::INFINITY, f64::min);
            m.insert("rollout_is_max".into(), max.min(SAFETY_BOUND).exp());
            m.insert("rollout_is_min".into(), min.exp());
            let (up, low) = (cfg.upper.ln(), lower.ln());
            m.insert(
                "rollout_is_ratio_fraction_high".into(),
                mean(sums.iter().map(|&s| (s > up) as u8 as f64)),
            );
            m.insert(
                "rollout_is_ratio_fraction_low".into(),
                mean(sums.iter().map(|&s| (s < low) as u8 as f64)),
            );
        }
    }
    // Effective sample size of the applied weights: 1 / mean((w / mean w)²).
    let w_mean = mean(tokens().map(|w| w.clamp(0.0, cfg.upper)));
    let ess = 1.0 / mean(tokens().map(|w| (w.clamp(0.0, cfg.upper) / (w_mean + 1e-8)).powi(2)));
    m.insert("rollout_is_eff_sample_size".into(), ess);
    applied
}

fn rejection(
    log_ratio: &[Vec<f64>],
    rules: &[RejectRule],
    m: &mut BTreeMap<String, f64>,
) -> Vec<Vec<bool>> {
    let mut keep: Vec<Vec<bool>> = log_ratio.iter().map(|r| vec![true; r.len()]).collect();
    for rule in rules {
        for (seq, kept) in log_ratio.iter().zip(keep.iter_mut()) {
            let stat = |x: f64| {
                let r = clamp(x);
                match rule.divergence {
                    Divergence::K1 => -r,
                    Divergence::K2 => 0.5 * r * r,
                    Divergence::K3 => r.exp() - 1.0 - r,
                }
            };
            let values = seq.iter().map(|&x| stat(x));
            let whole = match rule.scope {
                Scope::Token => {
                    for (k, &x) in kept.iter_mut().zip(seq) {
                        *k &= rule.keeps(stat(x));
                    }
                    continue;
                }
                Scope::SeqSum => values.sum::<f64>(),
                Scope::SeqMean => mean(values),
                Scope::SeqMax => values.fold(f64::NEG_INFINITY, f64::max).max(0.0),
            };
            if !seq.is_empty() && !rule.keeps(whole) {
                kept.iter_mut().for_each(|k| *k = false);
            }
        }
    }
    let tokens = keep.iter().flatten().count();
    let masked = keep.iter().flatten().filter(|k| !**k).count();
    m.insert(
        "rollout_rs_masked_fraction".into(),
        masked as f64 / tokens.max(1) as f64,
    );
    let sequences = keep.iter().filter(|s| !s.is_empty()).count();
    let touched = keep.iter().filter(|s| s.iter().any(|k| !k)).count();
    m.insert(
        "rollout_rs_seq_masked_fraction".into(),
        touched as f64 / sequences.max(1) as f64,
    );
    keep
}

/// verl's off-policy diagnostics: KL(π_rollout ‖ π_old) by k1 and k3, both perplexities, their
/// log difference, and χ² per token and per sequence.
fn offpolicy_metrics(
    old: &[Vec<f32>],
    rollout: &[Vec<f32>],
    log_ratio: &[Vec<f64>],
    m: &mut BTreeMap<String, f64>,
) {
    let seq_mean = |v: &[f32]| mean(v.iter().map(|&x| x as f64));
    let tokens = || log_ratio.iter().flatten().copied();
    m.insert("kl".into(), mean(tokens().map(|r| -r)));
    m.insert("k3_kl".into(), mean(tokens().map(|r| r.exp() - r - 1.0)));
    let training: Vec<f64> = old.iter().map(|s| seq_mean(s)).collect();
    let engine: Vec<f64> = rollout.iter().map(|s| seq_mean(s)).collect();
    m.insert(
        "training_ppl".into(),
        mean(training.iter().map(|l| (-l).exp())),
    );
    m.insert(
        "rollout_ppl".into(),
        mean(engine.iter().map(|l| (-l).exp())),
    );
    m.insert(
        "log_ppl_diff".into(),
        mean(engine.iter().zip(&training).map(|(r, t)| r - t)),
    );
    m.insert(
        "chi2_token".into(),
        mean(tokens().map(|r| (2.0 * clamp(r)).exp())) - 1.0,
    );
    m.insert(
        "chi2_seq".into(),
        mean(
            log_ratio
                .iter()
                .map(|r| (2.0 * clamp(r.iter().sum())).exp()),
        ) - 1.0,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(v: &[f64]) -> Vec<f32> {
        v.iter().map(|&x| x as f32).collect()
    }

    /// Ratios exp(r) with r = ln 3, 0, ln 0.25: token weights 3 → 2 (truncated), 1, 0.25.
    #[test]
    fn token_weights_are_truncated_ratios() {
        let old = vec![lp(&[3f64.ln() - 1.0, -1.0]), lp(&[0.25f64.ln() - 2.0])];
        let rollout = vec![lp(&[-1.0, -1.0]), lp(&[-2.0])];
        let cfg = IsConfig::parse("token", "2.0").unwrap();
        let c = rollout_correction(&old, &rollout, Some(&cfg), &[]);
        let w = c.weights.unwrap();
        assert!((w[0][0] - 2.0).abs() < 1e-6 && (w[0][1] - 1.0).abs() < 1e-6);
        assert!((w[1][0] - 0.25).abs() < 1e-6);
        let m = &c.metrics;
        assert!((m["rollout_corr/rollout_is_mean"] - 3.25 / 3.0).abs() < 1e-6);
        // 3 > 2: one token of three above; 0.25 < 1/2: one below.
        assert!((m["rollout_corr/rollout_is_ratio_fraction_high"] - 1.0 / 3.0).abs() < 1e-12);
        assert!((m["rollout_corr/rollout_is_ratio_fraction_low"] - 1.0 / 3.0).abs() < 1e-12);
    }

    /// Sequence weights: exp(Σ r) on every token; IcePop zeroes a weight outside its bounds.
    #[test]
    fn sequence_weights_and_icepop() {
        let old = vec![lp(&[-1.0 + 0.1, -1.0 + 0.2]), lp(&[-1.0 + 1.0])];
        let rollout = vec![lp(&[-1.0, -1.0]), lp(&[-1.0])];
        let seq = IsConfig::parse("sequence", "5").unwrap();
        let w = rollout_correction(&old, &rollout, Some(&seq), &[])
            .weights
            .unwrap();
        assert!((w[0][0] - 0.3f64.exp()).abs() < 1e-6 && (w[0][1] - 0.3f64.exp()).abs() < 1e-6);
        assert!((w[1][0] - 1f64.exp()).abs() < 1e-5);
        let icepop = IsConfig::parse("sequence", "0.5_2").unwrap();
        let w = rollout_correction(&old, &rollout, Some(&icepop), &[])
            .weights
            .unwrap();
        // e^0.3 ≈ 1.35 is kept; e^1 ≈ 2.72 leaves [0.5, 2] and becomes 0 (not 2).
        assert!((w[0][0] - 0.3f64.exp()).abs() < 1e-6);
        assert_eq!(w[1][0], 0.0);
    }

    /// The geometric-mean mask: a sequence whose mean log-ratio leaves [ln ½, ln 2] goes whole;
    /// a token mask drops only the outlier token.
    #[test]
    fn geometric_sequence_mask_and_token_outlier_mask() {
        // Sequence 0: r = (0.1, −0.1): mean 0 → kept. Sequence 1: r = (1.0, 1.0): k1 = −1
        // per token, mean −1 < ln ½ ≈ −0.69 → masked whole.
        let old = vec![lp(&[-1.0 + 0.1, -1.0 - 0.1]), lp(&[0.0, 0.0])];
        let rollout = vec![lp(&[-1.0, -1.0]), lp(&[-1.0, -1.0])];
        let geometric = RejectRule::parse("seq_mean_k1", "2").unwrap();
        let c = rollout_correction(&old, &rollout, None, &[geometric]);
        assert_eq!(c.keep.unwrap(), vec![vec![true, true], vec![false, false]]);
        assert!((c.metrics["rollout_corr/rollout_rs_masked_fraction"] - 0.5).abs() < 1e-12);
        assert!((c.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] - 0.5).abs() < 1e-12);
        // k2 per token: r²/2 = 0.005 and 0.5; bound 0.1 masks only sequence 1's tokens.
        let old = vec![lp(&[-1.0 + 0.1, -1.0 + 1.0])];
        let rollout = vec![lp(&[-1.0, -1.0])];
        let token = RejectRule::parse("token_k2", "0.1").unwrap();
        let c = rollout_correction(&old, &rollout, None, &[token]);
        assert_eq!(c.keep.unwrap(), vec![vec![true, false]]);
    }

    /// KL(π_rollout ‖ π_old) by k1 is the mean of −r; χ² per token mean(e^{2r}) − 1.
    #[test]
    fn offpolicy_metrics_by_hand() {
        let old = vec![lp(&[-1.0 + 0.2, -1.0])];
        let rollout = vec![lp(&[-1.0, -1.0])];
        let m = rollout_correction(&old, &rollout, None, &[]).metrics;
        assert!((m["rollout_corr/kl"] - (-0.1)).abs() < 1e-6);
        let chi2 = ((0.4f64).exp() + 1.0) / 2.0 - 1.0;
        assert!((m["rollout_corr/chi2_token"] - chi2).abs() < 1e-6);
    }

    #[test]
    fn bad_thresholds_are_refused() {
        assert!(IsConfig::parse("tokens", "2").is_err());
        assert!(IsConfig::parse("token", "0").is_err());
        assert!(IsConfig::parse("token", "3_2").is_err());
        assert!(RejectRule::parse("seq_max_k1", "2").is_err());
        assert!(RejectRule::parse("token_k2", "0.5_2")
            .unwrap_err()
            .contains("only k1"));
    }
}
