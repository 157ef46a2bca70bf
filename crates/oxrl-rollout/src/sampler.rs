//! Drawing one token from a row of logits: greedy at temperature 0, otherwise from
//! `softmax(logits / T)` truncated by top-k, then top-p (nucleus, on the renormalised top-k mass),
//! then min-p — the order transformers applies them. The returned log-probability is always that of
//! the full temperature-scaled distribution, before truncation: what the trainer recomputes.

use oxrl_nn::exp::{exp_shifted, max_of, sum_of};
use rand::Rng;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// 0 means greedy.
    pub temperature: f64,
    /// 0 keeps every token.
    pub top_k: usize,
    /// 1.0 keeps every token.
    pub top_p: f64,
    /// 0.0 keeps every token.
    pub min_p: f64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }
}

/// Tokens whose weight relative to the top token is below this are first left out of the top-p
/// sort; if the tokens kept already hold the nucleus mass the cut is exact, else all are sorted.
const TOP_P_PREFILTER: f32 = 1e-6;

/// Weights are summed in blocks of this many, so a draw walks block sums, then one block.
const BLOCK: usize = 1024;

/// Scratch space a sampler reuses between calls (one per thread).
#[derive(Debug, Default)]
pub struct SamplerScratch {
    /// `exp((logit - max) / T)` per vocabulary entry.
    weights: Vec<f32>,
    /// Sums of `weights` per [`BLOCK`].
    blocks: Vec<f64>,
}

/// The logit of vocabulary entry `i` of a row stored as consecutive pieces.
fn logit_at(row: &[&[f32]], mut i: usize) -> f32 {
    for piece in row {
        if i < piece.len() {
            return piece[i];
        }
        i -= piece.len();
    }
    f32::NAN
}

impl SamplerScratch {
    /// Fills `weights` with `exp((x - max) * scale)` and `blocks` with their block sums; returns
    /// the total.
    fn fill(&mut self, row: &[&[f32]], max: f32, scale: f32) -> f64 {
        let vocab: usize = row.iter().map(|p| p.len()).sum();
        self.weights.resize(vocab, 0.0);
        let mut at = 0;
        for piece in row {
            exp_shifted(&mut self.weights[at..at + piece.len()], piece, max, scale);
            at += piece.len();
        }
        self.blocks.clear();
        self.blocks
            .extend(self.weights.chunks(BLOCK).map(|b| sum_of(b) as f64));
        self.blocks.iter().sum()
    }

    /// The first index where the running weight passes `u`, found block by block.
    fn pick_blocked(&self, u: f64) -> usize {
        let mut cum = 0.0;
        for (b, &block_sum) in self.blocks.iter().enumerate() {
            if cum + block_sum > u {
                let start = b * BLOCK;
                let end = (start + BLOCK).min(self.weights.len());
                return pick(start..end, &self.weights, u - cum);
            }
            cum += block_sum;
        }
        pick(0..self.weights.len(), &self.weights, f64::INFINITY)
    }
}

impl SamplerConfig {
    fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }

    /// Samples a token from a row of logits given as consecutive pieces of the vocabulary;
    /// returns it with its log-probability under `softmax(logits/T)` (under `softmax(logits)` when
    /// greedy).
    pub fn sample<R: Rng>(
        &self,
        row: &[&[f32]],
        rng: &mut R,
        scratch: &mut SamplerScratch,
    ) -> (u32, f32) {
        let max = row
            .iter()
            .map(|p| max_of(p))
            .fold(f32::NEG_INFINITY, f32::max);
        if self.temperature <= 0.0 {
            let mut best = 0;
            let mut offset = 0;
            for piece in row {
                if let Some(i) = piece.iter().position(|&x| x == max) {
                    best = offset + i;
                    break;
                }
                offset += piece.len();
            }
            let total = scratch.fill(row, max, 1.0);
            return (best as u32, -(total.ln() as f32));
        }
        let inv_t = (1.0 / self.temperature) as f32;
        let total = scratch.fill(row, max, inv_t);
        let token = if self.truncates() {
            let weights = &scratch.weights;
            let candidates = self.nucleus(weights, total);
            let mass: f64 = candidates.iter().map(|&i| weights[i] as f64).sum();
            pick(
                candidates.iter().copied(),
                weights,
                rng.random::<f64>() * mass,
            )
        } else {
            scratch.pick_blocked(rng.random::<f64>() * total)
        };
        let logprob = (logit_at(row, token) - max) * inv_t - total.ln() as f32;
        (token as u32, logprob)
    }

    /// The token indices that survive top-k, top-p and min-p, heaviest first where sorted.
    fn nucleus(&self, weights: &[f32], total: f64) -> Vec<usize> {
        let by_weight_desc =
            |a: &usize, b: &usize| weights[*b].total_cmp(&weights[*a]).then(a.cmp(b));
        let mut cands: Vec<usize> = (0..weights.len()).collect();
        let mut mass = total;
        if self.top_k > 0 && self.top_k < cands.len() {
            cands.select_nth_unstable_by(self.top_k - 1, by_weight_desc);
            cands.truncate(self.top_k);
            mass = cands.iter().map(|&i| weights[i] as f64).sum();
        }
        if self.top_p < 1.0 {
            let target = self.top_p * mass;
            let heavy: Vec<usize> = cands
                .iter()
                .copied()
                .filter(|&i| weights[i] >= TOP_P_PREFILTER)
                .collect();
            let heavy_mass: f64 = heavy.iter().map(|&i| weights[i] as f64).sum();
            if heavy_mass >= target {
                cands = heavy;
            }
            cands.sort_unstable_by(by_weight_desc);
            let mut cum = 0.0;
            let mut keep = cands.len();
            for (n, &i) in cands.iter().enumerate() {
                cum += weights[i] as f64;
                if cum >= target {
                    keep = n + 1;
                    break;
                }
            }
            cands.truncate(keep.max(1));
        }
        if self.min_p > 0.0 {
            // The top token's weight is exp(0) = 1, so min_p · p_max is min_p in these units.
            let floor = self.min_p as f32;
            cands.retain(|&i| weights[i] >= floor);
        }
        cands
    }
}

/// The first index at which the running weight passes `u` (the last one if rounding leaves `u`
/// beyond the total).
fn pick(indices: impl Iterator<Item = usize>, weights: &[f32], u: f64) -> usize {
    let mut cum = 0.0;
    let mut last = 0;
    for i in indices {
        cum += weights[i] as f64;
        last = i;
        if cum > u {
            return i;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn draw(cfg: &SamplerConfig, logits: &[f32], n: usize) -> Vec<usize> {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut counts = vec![0; logits.len()];
        let mut scratch = SamplerScratch::default();
        for _ in 0..n {
            counts[cfg.sample(&[logits], &mut rng, &mut scratch).0 as usize] += 1;
        }
        counts
    }

    #[test]
    fn greedy_takes_argmax_with_its_untempered_logprob() {
        let cfg = SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        };
        let logits = [0.0f32, 2.0, 1.0];
        let (t, lp) = cfg.sample(
            &[&logits],
            &mut ChaCha8Rng::seed_from_u64(0),
            &mut SamplerScratch::default(),
        );
        let z: f32 = logits.iter().map(|x| x.exp()).sum();
        assert_eq!(t, 1);
        assert!((lp - (2.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn logprob_is_of_the_tempered_untruncated_distribution() {
        // T = 2: softmax([0, ln 4]/2) = softmax([0, ln 2]) = [1/3, 2/3].
        let cfg = SamplerConfig {
            temperature: 2.0,
            top_k: 1,
            ..Default::default()
        };
        let logits = [0.0f32, 4f32.ln()];
        let (t, lp) = cfg.sample(
            &[&logits],
            &mut ChaCha8Rng::seed_from_u64(0),
            &mut SamplerScratch::default(),
        );
        assert_eq!(t, 1, "top_k = 1 keeps only the heaviest token");
        assert!((lp - (2.0f32 / 3.0).ln()).abs() < 1e-6, "{lp}");
    }

    #[test]
    fn a_row_in_pieces_samples_like_the_whole_row() {
        let logits: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let cfg = SamplerConfig {
            temperature: 0.7,
            ..Default::default()
        };
        let pieces: Vec<&[f32]> = logits.chunks(1100).collect();
        let (mut a, mut b) = (ChaCha8Rng::seed_from_u64(5), ChaCha8Rng::seed_from_u64(5));
        let (mut sa, mut sb) = (SamplerScratch::default(), SamplerScratch::default());
        for _ in 0..50 {
            assert_eq!(
                cfg.sample(&[&logits], &mut a, &mut sa),
                cfg.sample(&pieces, &mut b, &mut sb)
            );
        }
        let greedy = SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        };
        let (t, lp) = greedy.sample(&pieces, &mut a, &mut sa);
        assert_eq!(logits[t as usize], 9.99);
        let lse = logits
            .iter()
            .map(|&x| ((x - 9.99) as f64).exp())
            .sum::<f64>()
            .ln();
        assert!((lp as f64 + lse).abs() < 1e-5);
    }

    #[test]
    fn frequencies_follow_softmax() {
        // probabilities 0.1, 0.2, 0.3, 0.4
        let logits: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4].iter().map(|p| p.ln()).collect();
        let counts = draw(&SamplerConfig::default(), &logits, 20_000);
        for (c, p) in counts.iter().zip([0.1, 0.2, 0.3, 0.4]) {
            assert!((*c as f64 / 20_000.0 - p).abs() < 0.015, "{counts:?}");
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        let logits: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4].iter().map(|p| p.ln()).collect();
        let cfg = SamplerConfig {
            top_p: 0.6,
            ..Default::default()
        };
        // 0.4 < 0.6 ≤ 0.4 + 0.3: tokens 3 and 2 survive, in ratio 4:3.
        let counts = draw(&cfg, &logits, 14_000);
        assert_eq!(counts[0] + counts[1], 0, "{counts:?}");
        assert!(
            (counts[3] as f64 / 14_000.0 - 4.0 / 7.0).abs() < 0.015,
            "{counts:?}"
        );
    }

    #[test]
    fn top_k_and_min_p_cut_light_tokens() {
        let logits: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4].iter().map(|p| p.ln()).collect();
        let top2 = draw(
            &SamplerConfig {
                top_k: 2,
                ..Default::default()
            },
            &logits,
            2_000,
        );
        assert_eq!(top2[0] + top2[1], 0, "{top2:?}");
        // min_p 0.6: keep p ≥ 0.6·0.4 = 0.24 → tokens 2 and 3.
        let minp = draw(
            &SamplerConfig {
                min_p: 0.6,
                ..Default::default()
            },
            &logits,
            2_000,
        );
        assert_eq!(minp[0] + minp[1], 0, "{minp:?}");
        assert!(minp[2] > 0 && minp[3] > 0);
    }
}
