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
