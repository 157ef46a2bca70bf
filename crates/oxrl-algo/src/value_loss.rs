//! The critic's loss in PPO (`docs/rl-algorithms.md`, "gae"; verl's `compute_value_loss`):
//! per token, `½·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²)`, so that one update
//! cannot move a value more than `c` from the one GAE used. `V` is the critic's prediction (with
//! gradient), `V_old` the values the advantages were computed from, `R` the returns (targets).

use candle_core::{Result, Tensor};

/// One micro-batch's per-token value losses and what they measured.
pub struct ValueLossOutput {
    /// `[N]`, differentiable through the predictions (before aggregation).
    pub per_token: Tensor,
    /// Tokens where the clipped term was the larger (its gradient is 0: the prediction is
    /// already more than `c` from `V_old`).
    pub clipped: usize,
}

/// The clipped value loss per token of flat `[N]` predictions; `clip = None` is the plain
/// squared error `½(V − R)²`.
pub fn clipped_value_loss(
    vpred: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    clip: Option<f64>,
) -> Result<ValueLossOutput> {
    let unclipped = ((vpred - returns)?.sqr()? * 0.5)?;
    let Some(c) = clip else {
        return Ok(ValueLossOutput {
            per_token: unclipped,
            clipped: 0,
        });
    };
    let v = vpred.to_vec1::<f32>()?;
    let old = old_values.to_vec1::<f32>()?;
    let r = returns.to_vec1::<f32>()?;
    let c = c as f32;
    // Where the clipped term wins, the loss is its value and carries no gradient (the clipped
    // prediction is a constant there); elsewhere the unclipped term's.
    let (mut take_clipped, mut clipped_loss) = (Vec::with_capacity(v.len()), Vec::new());
    for ((&v, &o), &r) in v.iter().zip(&old).zip(&r) {
        let plain = 0.5 * (v - r).powi(2);
        let held = 0.5 * (v.clamp(o - c, o + c) - r).powi(2);
        take_clipped.push(f32::from(u8::from(held > plain)));
        clipped_loss.push(held);
    }
    let clipped = take_clipped.iter().filter(|&&x| x > 0.0).count();
    let n = v.len();
    let dev = vpred.device();
    let mask = Tensor::from_vec(take_clipped, n, dev)?;
    let held = Tensor::from_vec(clipped_loss, n, dev)?;
    let per_token = ((unclipped * (1.0 - &mask)?)? + (held * mask)?)?;
    Ok(ValueLossOutput { per_token, clipped })
}

/// `1 − Var(R − V) / (Var(R) + 1e-5)` over every token (unbiased variances), as verl's
/// `critic/vf_explained_var`: 1 when the values predict the returns, 0 when they explain none of
/// their spread. `None` under two tokens.
pub fn explained_variance(returns: &[Vec<f64>], values: &[Vec<f64>]) -> Option<f64> {
    let r: Vec<f64> = returns.iter().flatten().copied().collect();
    let diff: Vec<f64> = r
        .iter()
        .zip(values.iter().flatten())
        .map(|(r, v)| r - v)
        .collect();
    Some(1.0 - unbiased_var(&diff)? / (unbiased_var(&r)? + 1e-5))
}

fn unbiased_var(x: &[f64]) -> Option<f64> {
    let n = x.len();
    if n < 2 {
        return None;
    }
    let mean = x.iter().sum::<f64>() / n as f64;
    Some(x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_clipped_term_bounds_the_move_and_stops_its_gradient() {
        // c = 0.5, R = 1 everywhere.
        // Token 0: V = 0.9, V_old = 0.8: inside the clip, loss ½·0.01 = 0.005, grad V − R = −0.1.
        // Token 1: V = 2.0, V_old = 0.8: clipped to 1.3, ½·0.09 = 0.045 < ½·1 = 0.5: the
        //          unclipped term wins, grad 1.0.
        // Token 2: V = 0.0, V_old = 2.0: clipped to 1.5, ½·0.25 = 0.125 < ½·1 = 0.5: the
        //          unclipped term wins, grad −1.
        // Token 3: V = 1.2, V_old = 0.0: clipped to 0.5, ½·0.25 = 0.125 > ½·0.04 = 0.02:
        //          the clipped term wins, loss 0.125, grad 0.
        let v = Var::new(&[0.9f32, 2.0, 0.0, 1.2], &Device::Cpu).unwrap();
        let out = clipped_value_loss(
            v.as_tensor(),
            &t(&[0.8, 0.8, 2.0, 0.0]),
            &t(&[1.0; 4]),
            Some(0.5),
        )
        .unwrap();
        let loss = out.per_token.to_vec1::<f32>().unwrap();
        for (got, want) in loss.iter().zip([0.005f32, 0.5, 0.5, 0.125]) {
            assert!((got - want).abs() < 1e-6, "{loss:?}");
        }
        assert_eq!(out.clipped, 1);
        let grads = out.per_token.sum_all().unwrap().backward().unwrap();
        let g = grads.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        for (got, want) in g.iter().zip([-0.1f32, 1.0, -1.0, 0.0]) {
            assert!((got - want).abs() < 1e-6, "{g:?}");
        }
    }

    #[test]
    fn without_a_clip_it_is_half_the_squared_error() {
        let out =
            clipped_value_loss(&t(&[3.0, 0.0]), &t(&[0.0, 9.0]), &t(&[1.0, 1.0]), None).unwrap();
        assert_eq!(out.per_token.to_vec1::<f32>().unwrap(), vec![2.0, 0.5]);
        assert_eq!(out.clipped, 0);
    }

    #[test]
    fn explained_variance_is_one_for_perfect_values_and_zero_for_a_constant() {
        let r = vec![vec![1.0, 2.0], vec![3.0]];
        let perfect = explained_variance(&r, &r).unwrap();
        assert!((perfect - 1.0).abs() < 1e-12);
        // V = 5 everywhere: R − V has R's variance (1), so 1 − 1/(1 + 1e-5).
        let constant = explained_variance(&r, &[vec![5.0, 5.0], vec![5.0]]).unwrap();
        assert!((constant - (1.0 - 1.0 / 1.00001)).abs() < 1e-12);
        assert_eq!(explained_variance(&[vec![1.0]], &[vec![0.0]]), None);
    }
}
