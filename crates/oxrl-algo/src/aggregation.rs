//! Loss aggregation over a mini-batch, expressed as one weight per token so that
//! `agg(L) = Σ_t w_t · L_t`. The weights use the totals of the whole mini-batch (its token count
//! and its number of responses), so summing micro-batch losses gives exactly the unsplit batch's
//! loss, whatever the split. Formulas: `docs/rl-algorithms.md`, "Loss aggregation".

/// The weight of each token of a sequence of `n` tokens in a mini-batch with `totals`.
type TokenWeight = fn(n: usize, totals: &BatchTotals) -> f64;

registry! {
    pub enum LossAgg: "loss aggregation" => TokenWeight {
        TokenMean = "token_mean" => token_mean, "Σ L / Σ tokens (verl, SkyRL, TRL `dapo`)";
        SeqMeanTokenMean = "seq_mean_token_mean" => seq_mean_token_mean,
            "(1/B) Σ_i mean_t L (original GRPO, TRL `grpo`)";
        SeqMeanTokenSum = "seq_mean_token_sum" => seq_mean_token_sum, "(1/B) Σ_i Σ_t L";
        SeqMeanTokenSumNorm = "seq_mean_token_sum_norm" => seq_mean_token_sum_norm,
            "(1/(B·L_max)) Σ_i Σ_t L with a constant L_max = loss_scale_factor (Dr. GRPO)";
    }
}

/// Totals of the whole mini-batch that normalise every micro-batch's loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchTotals {
    pub tokens: usize,
    pub sequences: usize,
    /// L_max of `seq_mean_token_sum_norm` (`loss_scale_factor`, default the max new tokens).
    pub loss_scale_factor: f64,
}

/// One weight per token of the sequences whose lengths are `seq_lens` (concatenated in order).
pub fn token_weights(agg: LossAgg, seq_lens: &[usize], totals: &BatchTotals) -> Vec<f32> {
    let weight = agg.implementation();
    let mut w = Vec::with_capacity(seq_lens.iter().sum());
    for &n in seq_lens {
        w.extend(std::iter::repeat_n(weight(n, totals) as f32, n));
    }
    w
}

/// [`token_weights`] with some tokens masked out (`keep[t]` false, over the same concatenated
/// tokens): a masked token weighs 0 and a sequence counts only its kept tokens, as verl's
/// `agg_loss` does with a modified response mask. `totals` must count kept tokens and the
/// sequences that keep at least one ([`BatchTotals::kept`]).
pub fn masked_token_weights(
    agg: LossAgg,
    seq_lens: &[usize],
    keep: &[bool],
    totals: &BatchTotals,
) -> Vec<f32> {
    let weight = agg.implementation();
    let mut w = Vec::with_capacity(keep.len());
    let mut at = 0;
    for &n in seq_lens {
        let kept = &keep[at..at + n];
        let k = kept.iter().filter(|&&x| x).count();
        let each = weight(k, totals) as f32;
        w.extend(kept.iter().map(|&x| if x { each } else { 0.0 }));
        at += n;
    }
    w
}

impl BatchTotals {
    /// The totals of a mini-batch whose sequences keep the tokens `keep` says (per sequence):
    /// kept tokens, and sequences with at least one kept.
    pub fn kept(keep: &[&[bool]], loss_scale_factor: f64) -> Self {
        BatchTotals {
            tokens: keep.iter().map(|s| s.iter().filter(|&&k| k).count()).sum(),
            sequences: keep.iter().filter(|s| s.iter().any(|&k| k)).count(),
            loss_scale_factor,
        }
    }
}

fn token_mean(_: usize, totals: &BatchTotals) -> f64 {
    1.0 / totals.tokens as f64
}

fn seq_mean_token_mean(n: usize, totals: &BatchTotals) -> f64 {
    1.0 / (n as f64 * totals.sequences as f64)
}

fn seq_mean_token_sum(_: usize, totals: &BatchTotals) -> f64 {
    1.0 / totals.sequences as f64
}

fn seq_mean_token_sum_norm(_: usize, totals: &BatchTotals) -> f64 {
    1.0 / (totals.sequences as f64 * totals.loss_scale_factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequences [1, 2] and [3, 4, 5, 6] with the 2nd and 4th..6th tokens masked: token_mean
    /// over the kept (1 + 3) / 2 = 2; seq_mean_token_mean: the second sequence keeps one
    /// token, (1 + 3) / 2 = 2 as well; a wholly masked sequence leaves the count of sequences.
    #[test]
    fn masked_tokens_leave_the_totals() {
        let keep = [true, false, true, false, false, false];
        let totals = BatchTotals::kept(&[&keep[..2], &keep[2..]], 10.0);
        assert_eq!((totals.tokens, totals.sequences), (2, 2));
        let sum = |agg| -> f64 {
            masked_token_weights(agg, &[2, 4], &keep, &totals)
                .iter()
                .zip([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
                .map(|(w, l)| *w as f64 * l)
                .sum()
        };
        assert!((sum(LossAgg::TokenMean) - 2.0).abs() < 1e-6);
        assert!((sum(LossAgg::SeqMeanTokenMean) - 2.0).abs() < 1e-6);
        assert!((sum(LossAgg::SeqMeanTokenSum) - 2.0).abs() < 1e-6);
        let gone = [true, true, false, false, false, false];
        let totals = BatchTotals::kept(&[&gone[..2], &gone[2..]], 10.0);
        assert_eq!((totals.tokens, totals.sequences), (2, 1));
        let w = masked_token_weights(LossAgg::SeqMeanTokenSum, &[2, 4], &gone, &totals);
        assert_eq!(w, vec![1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    }

    /// Two sequences: L = [1, 2] and [3, 4, 5, 6]; B = 2, N = 6, L_max = 10.
    fn aggregate(agg: LossAgg) -> f64 {
        let totals = BatchTotals {
            tokens: 6,
            sequences: 2,
            loss_scale_factor: 10.0,
        };
        let w = token_weights(agg, &[2, 4], &totals);
        w.iter()
            .zip([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .map(|(w, l)| *w as f64 * l)
            .sum()
    }

    #[test]
    fn each_mode_matches_its_formula() {
        assert!((aggregate(LossAgg::TokenMean) - 21.0 / 6.0).abs() < 1e-6);
        assert!((aggregate(LossAgg::SeqMeanTokenMean) - (1.5 + 4.5) / 2.0).abs() < 1e-6);
        assert!((aggregate(LossAgg::SeqMeanTokenSum) - (3.0 + 18.0) / 2.0).abs() < 1e-6);
        assert!((aggregate(LossAgg::SeqMeanTokenSumNorm) - 21.0 / 20.0).abs() < 1e-6);
    }

    #[test]
    fn micro_batches_sum_to_the_whole_batch() {
        let totals = BatchTotals {
            tokens: 6,
            sequences: 2,
            loss_scale_factor: 10.0,
        };
        for agg in [LossAgg::TokenMean, LossAgg::SeqMeanTokenMean] {
            let whole = token_weights(agg, &[2, 4], &totals);
            let split: Vec<f32> = [
                token_weights(agg, &[2], &totals),
                token_weights(agg, &[4], &totals),
            ]
            .concat();
            assert_eq!(whole, split);
        }
    }
}
