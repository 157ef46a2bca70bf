//! KL estimators between the current policy and the reference, per token, from log-probs:
//! δ = logp − logp_ref. Gradients flow through `logp` only. Formulas: `docs/rl-algorithms.md`,
//! "KL to the reference policy".

use candle_core::{Result, Tensor};

registry! {
    pub enum KlEstimator: "KL estimator" => fn(&Tensor) -> Result<Tensor> {
        K1 = "k1" => k1, "δ";
        K2 = "k2" => k2, "δ²/2";
        K3 = "k3" | "low_var_kl" => k3,
            "exp(−δ) + δ − 1, δ clamped to ±20 and the result to [−10, 10] (verl's low_var_kl)";
        Abs = "abs" => abs, "|δ|";
    }
}

/// The estimator per token, `[N]`.
pub fn kl_per_token(est: KlEstimator, logp: &Tensor, ref_logp: &Tensor) -> Result<Tensor> {
    let delta = (logp - ref_logp)?;
    (est.implementation())(&delta)
}

fn k1(delta: &Tensor) -> Result<Tensor> {
    Ok(delta.clone())
}

fn k2(delta: &Tensor) -> Result<Tensor> {
    delta.sqr()? * 0.5
}

fn k3(delta: &Tensor) -> Result<Tensor> {
    // With d = logp_ref − logp: exp(d) − d − 1.
    let d = delta.neg()?.clamp(-20f32, 20f32)?;
    ((d.exp()? - d)? - 1.0)?.clamp(-10f32, 10f32)
}

fn abs(delta: &Tensor) -> Result<Tensor> {
    delta.abs()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn run(est: KlEstimator, logp: f32, ref_logp: f32) -> (f32, f32) {
        let x = Var::new(&[logp], &Device::Cpu).unwrap();
        let r = Tensor::new(&[ref_logp], &Device::Cpu).unwrap();
        let k = kl_per_token(est, x.as_tensor(), &r).unwrap();
        let g = k.sum_all().unwrap().backward().unwrap();
        let grad = g.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap()[0];
        (k.to_vec1::<f32>().unwrap()[0], grad)
    }

    #[test]
    fn estimators_and_their_gradients() {
        // δ = logp − ref = −1 − (−2) = 1.
        assert_eq!(run(KlEstimator::K1, -1.0, -2.0), (1.0, 1.0));
        assert_eq!(run(KlEstimator::K2, -1.0, -2.0), (0.5, 1.0));
        assert_eq!(run(KlEstimator::Abs, -2.0, -1.0), (1.0, -1.0));
        // k3 = e^{−1} + 1 − 1 = e^{−1}; d/dlogp = 1 − e^{−δ} = 1 − e^{−1}.
        let (k, g) = run(KlEstimator::K3, -1.0, -2.0);
        let e = (-1.0f32).exp();
        assert!(
            (k - e).abs() < 1e-6 && (g - (1.0 - e)).abs() < 1e-6,
            "{k} {g}"
        );
        // Zero at equal policies, and the clamp at 10.
        assert_eq!(run(KlEstimator::K3, -1.0, -1.0).0, 0.0);
        assert_eq!(run(KlEstimator::K3, -30.0, -1.0).0, 10.0);
        assert_eq!(
            KlEstimator::from_name("low_var_kl").unwrap(),
            KlEstimator::K3
        );
    }
}
