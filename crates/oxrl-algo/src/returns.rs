//! Token-level returns and advantages (`docs/rl-algorithms.md`, "reinforce++" and "gae"):
//! per-token rewards — the outcome reward at a response's last token, plus any per-token terms
//! such as a KL penalty folded into the reward — discounted back through the response.
//! Responses are rows of their own lengths (no padding); whitening runs over every token of the
//! batch, as verl's `masked_whiten` does over the response mask.

/// `R_t = Σ_{k≥t} γ^{k−t} r_k` within each response.
pub fn discounted_returns(token_rewards: &[Vec<f64>], gamma: f64) -> Vec<Vec<f64>> {
    token_rewards
        .iter()
        .map(|r| {
            let mut out = vec![0.0; r.len()];
            let mut running = 0.0;
            for t in (0..r.len()).rev() {
                running = r[t] + gamma * running;
                out[t] = running;
            }
            out
        })
        .collect()
}

/// `(x − mean) / √(var + 1e-8)` over every token of the batch, as verl's `masked_whiten`
/// computes it: both means divide by `N + 1e-8`, the variance is then made unbiased by
/// `N / (N − 1)`. Fewer than two tokens: left as they are.
pub fn whiten(values: &mut [Vec<f64>]) {
    let n = values.iter().map(Vec::len).sum::<usize>() as f64;
    if n < 2.0 {
        return;
    }
    let mean = values.iter().flatten().sum::<f64>() / (n + 1e-8);
    let biased = values
        .iter()
        .flatten()
        .map(|x| (x - mean).powi(2))
        .sum::<f64>()
        / (n + 1e-8);
    let var = biased * (n / (n - 1.0));
    let scale = 1.0 / (var + 1e-8).sqrt();
    for x in values.iter_mut().flatten() {
        *x = (*x - mean) * scale;
    }
}

/// Advantages and the returns they came from (a critic's targets).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenAdvantages {
    pub advantages: Vec<Vec<f64>>,
    pub returns: Vec<Vec<f64>>,
}

impl TokenAdvantages {
    /// An estimator without returns of its own: they are its advantages, as verl sets them.
    pub fn same(advantages: Vec<Vec<f64>>) -> Self {
        Self {
            returns: advantages.clone(),
            advantages,
        }
    }
}

/// REINFORCE++ (Hu, 2025): the discounted return of every token, whitened over the batch.
pub fn reinforce_plus_plus(token_rewards: &[Vec<f64>], gamma: f64) -> TokenAdvantages {
    let returns = discounted_returns(token_rewards, gamma);
    let mut advantages = returns.clone();
    whiten(&mut advantages);
    TokenAdvantages {
        advantages,
        returns,
    }
}

/// Generalised advantage estimation (Schulman et al., 2016) from a critic's `values`:
/// `δ_t = r_t + γ·V_{t+1} − V_t` (`V` past the last token is 0), `A_t = δ_t + γλ·A_{t+1}`;
/// the returns (the critic's targets) are `A + V` before the advantages are whitened.
pub fn gae(
    token_rewards: &[Vec<f64>],
    values: &[Vec<f64>],
    gamma: f64,
    lam: f64,
) -> TokenAdvantages {
    let mut advantages: Vec<Vec<f64>> = token_rewards
        .iter()
        .zip(values)
        .map(|(r, v)| {
            let mut a = vec![0.0; r.len()];
            let (mut next_value, mut next_advantage) = (0.0, 0.0);
            for t in (0..r.len()).rev() {
                let delta = r[t] + gamma * next_value - v[t];
                next_advantage = delta + gamma * lam * next_advantage;
                a[t] = next_advantage;
                next_value = v[t];
            }
            a
        })
        .collect();
    let returns = advantages
        .iter()
        .zip(values)
        .map(|(a, v)| a.iter().zip(v).map(|(a, v)| a + v).collect())
        .collect();
    whiten(&mut advantages);
    TokenAdvantages {
        advantages,
        returns,
    }
}

/// Each response's outcome reward at its last token, 0 before it.
pub fn outcome_token_rewards(rewards: &[f64], token_counts: &[usize]) -> Vec<Vec<f64>> {
    rewards
        .iter()
        .zip(token_counts)
        .map(|(&r, &n)| {
            let mut row = vec![0.0; n];
            if let Some(last) = row.last_mut() {
                *last = r;
            }
            row
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal to 1e-12; whitened values to 1e-7 (`whitened`): verl's ε in the means moves them
    /// by ~1e-8 from the exact-mean numbers written by hand.
    fn close(a: &[Vec<f64>], b: &[Vec<f64>]) {
        close_within(a, b, 1e-12)
    }

    fn whitened(a: &[Vec<f64>], b: &[Vec<f64>]) {
        close_within(a, b, 1e-7)
    }

    fn close_within(a: &[Vec<f64>], b: &[Vec<f64>], tol: f64) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            assert!((x - y).abs() < tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn returns_discount_later_rewards() {
        // r = [1, 0, 2], γ = 0.5: R_2 = 2, R_1 = 0 + 0.5·2 = 1, R_0 = 1 + 0.5·1 = 1.5.
        close(
            &discounted_returns(&[vec![1.0, 0.0, 2.0], vec![3.0]], 0.5),
            &[vec![1.5, 1.0, 2.0], vec![3.0]],
        );
    }

    #[test]
    fn whitening_uses_every_token_and_the_unbiased_variance() {
        // Tokens 1, 2, 3, 6: mean 3, unbiased var (4 + 1 + 0 + 9)/3 = 14/3.
        let mut v = vec![vec![1.0, 2.0], vec![3.0, 6.0]];
        whiten(&mut v);
        let s = 1.0 / (14.0f64 / 3.0).sqrt();
        whitened(&v, &[vec![-2.0 * s, -s], vec![0.0, 3.0 * s]]);
    }

    #[test]
    fn reinforce_plus_plus_with_outcome_rewards_and_gamma_one_whitens_the_reward() {
        // Rewards 1 and 0 over 1 and 3 tokens: returns 1 | 0, 0, 0; mean 0.25, var 0.25.
        let r = outcome_token_rewards(&[1.0, 0.0], &[1, 3]);
        let out = reinforce_plus_plus(&r, 1.0);
        close(&out.returns, &[vec![1.0], vec![0.0, 0.0, 0.0]]);
        // Tokens 1, 0, 0, 0: mean 0.25, unbiased var 0.25 (std 0.5).
        whitened(&out.advantages, &[vec![1.5], vec![-0.5, -0.5, -0.5]]);
    }

    #[test]
    fn gae_is_the_discounted_sum_of_td_errors() {
        // r = [0, 1], V = [0.5, 0.2], γ = 0.9, λ = 0.5:
        // δ_1 = 1 − 0.2 = 0.8; δ_0 = 0 + 0.9·0.2 − 0.5 = −0.32; A_1 = 0.8;
        // A_0 = −0.32 + 0.45·0.8 = 0.04; returns = A + V = [0.54, 1.0].
        let out = gae(&[vec![0.0, 1.0]], &[vec![0.5, 0.2]], 0.9, 0.5);
        close(&out.returns, &[vec![0.54, 1.0]]);
        // Whitened: mean 0.42, unbiased var 2·0.38² = 0.2888, so ±0.38/√0.2888 = ±1/√2.
        let h = 0.5f64.sqrt();
        whitened(&out.advantages, &[vec![-h, h]]);
        // λ = 1, V = 0: GAE is the plain discounted return.
        let plain = gae(&[vec![1.0, 0.0, 2.0]], &[vec![0.0; 3]], 0.5, 1.0);
        close(&plain.returns, &[vec![1.5, 1.0, 2.0]]);
    }
}
