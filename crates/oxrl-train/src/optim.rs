//! The optimizer seam and its AdamWs, global-norm gradient clipping (as
//! `torch.nn.utils.clip_grad_norm_`), and learning-rate schedules.
//!
//! Both AdamWs keep f32 master weights and moments and follow `torch.optim.AdamW`'s arithmetic
//! operation for operation: [`AdamW`] on host vectors (the fastest on a CPU, where the weights
//! already live), [`TensorAdamW`] with tensor ops on the parameters' own device (a GPU). They
//! agree to the last bit on a CPU (tested), so a device changes speed, not numbers.

use candle_core::{DType, Device, Tensor, Var};
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
    /// updates the master weights.
    pub fn step_host(&mut self, grads: &[Vec<f32>], lr: f64) {
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

/// An optimizer over the trainer's variables. Gradients arrive as f32 tensors on the
/// parameters' device, one per variable in order, already reduced across ranks and clipped.
pub trait Optimizer: Send {
    /// Optimizer steps taken.
    fn steps(&self) -> u64;
    /// One step at learning rate `lr`; writes the new weights into `vars`.
    fn update(&mut self, vars: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()>;
    /// A host copy of every parameter's state, in variable order (what a checkpoint stores).
    fn state(&self) -> candle_core::Result<Vec<ParamState>>;
}

/// Writes f32 `master` (host or device) into `var` in the variable's own dtype.
fn write_back(var: &Var, master: &Tensor) -> candle_core::Result<()> {
    var.set(&master.to_dtype(var.as_tensor().dtype())?)
}

impl Optimizer for AdamW {
    fn steps(&self) -> u64 {
        self.step
    }

    fn update(&mut self, vars: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()> {
        let host = grads
            .iter()
            .map(|g| g.flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.step_host(&host, lr);
        for (var, p) in vars.iter().zip(&self.params) {
            let shape = var.as_tensor().shape();
            write_back(
                var,
                &Tensor::from_slice(&p.master, shape, var.as_tensor().device())?,
            )?;
        }
        Ok(())
    }

    fn state(&self) -> candle_core::Result<Vec<ParamState>> {
        Ok(self.params.clone())
    }
}

/// One parameter's AdamW state as f32 tensors on the parameter's device.
struct TensorState {
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// AdamW from tensor ops on the parameters' device: the same arithmetic as [`AdamW`], operation
/// for operation (divisions stay divisions, products keep torch's order), so the two agree.
pub struct TensorAdamW {
    config: AdamWConfig,
    step: u64,
    params: Vec<TensorState>,
}

impl TensorAdamW {
    /// Moves a host AdamW's state (fresh or restored from a checkpoint) onto `device`, shaped
    /// like `vars`.
    pub fn from_host(host: AdamW, vars: &[Var], device: &Device) -> candle_core::Result<Self> {
        let params = host
            .params
            .iter()
            .zip(vars)
            .map(|(p, var)| {
                let shape = var.as_tensor().shape();
                let to_device = |v: &[f32]| Tensor::from_slice(v, shape, device);
                Ok(TensorState {
                    master: to_device(&p.master)?,
                    exp_avg: to_device(&p.exp_avg)?,
                    exp_avg_sq: to_device(&p.exp_avg_sq)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            config: host.config,
            step: host.step,
            params,
        })
    }
}

impl Optimizer for TensorAdamW {
    fn steps(&self) -> u64 {
        self.step
    }

    fn update(&mut self, vars: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()> {
        self.step += 1;
        let c = self.config;
        let (b1, b2) = c.betas;
        let bias1 = 1.0 - b1.powi(self.step as i32);
        let bias2_sqrt = (1.0 - b2.powi(self.step as i32)).sqrt() as f32;
        let decay = (1.0 - lr * c.weight_decay) as f32 as f64;
        let step_size = (lr / bias1) as f32 as f64;
        let (w1, w2) = ((1.0 - b1) as f32 as f64, (1.0 - b2) as f32 as f64);
        let b2f = b2 as f32 as f64;
        for ((p, g), var) in self.params.iter_mut().zip(grads).zip(vars) {
            let g = g.reshape(p.master.shape())?;
            let bias2 = Tensor::new(bias2_sqrt, g.device())?;
            // w ← w·(1 − lr·λ); m ← m + (1 − β1)(g − m); v ← v·β2 + ((1 − β2)·g)·g
            let master = p.master.affine(decay, 0.0)?;
            let exp_avg = (&p.exp_avg + (&g - &p.exp_avg)?.affine(w1, 0.0)?)?;
            let exp_avg_sq = (p.exp_avg_sq.affine(b2f, 0.0)? + (g.affine(w2, 0.0)? * &g)?)?;
            // w ← w − (lr / (1 − β1ᵗ))·m / (√v / √(1 − β2ᵗ) + ε)
            let denom = exp_avg_sq
                .sqrt()?
                .broadcast_div(&bias2)?
                .affine(1.0, c.eps as f32 as f64)?;
            let master = (master - (exp_avg.affine(step_size, 0.0)? / denom)?)?;
            write_back(var, &master)?;
            *p = TensorState {
                master,
                exp_avg,
                exp_avg_sq,
            };
        }
        Ok(())
    }

    fn state(&self) -> candle_core::Result<Vec<ParamState>> {
        let host = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
        self.params
            .iter()
            .map(|p| {
                Ok(ParamState {
                    master: host(&p.master)?,
                    exp_avg: host(&p.exp_avg)?,
                    exp_avg_sq: host(&p.exp_avg_sq)?,
                })
            })
            .collect()
    }
}

/// The optimizer for parameters on `device`: host AdamW on a CPU, tensor AdamW elsewhere.
pub fn adamw_on(
    device: &Device,
    host: AdamW,
    vars: &[Var],
) -> candle_core::Result<Box<dyn Optimizer>> {
    Ok(match device {
        Device::Cpu => Box::new(host),
        _ => Box::new(TensorAdamW::from_host(host, vars, device)?),
    })
}

/// Each variable's values as host f32 (where AdamW's master weights start).
pub fn host_values(vars: &[(String, Var)]) -> candle_core::Result<Vec<Vec<f32>>> {
    vars.iter()
        .map(|(_, v)| {
            v.as_tensor()
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()
        })
        .collect()
}

/// Adds one backward pass's gradients of `vars` to `acc` (one slot per variable, in f32).
pub fn accumulate(
    vars: &[(String, Var)],
    acc: &mut [Option<Tensor>],
    grads: &candle_core::backprop::GradStore,
) -> candle_core::Result<()> {
    for ((_, var), slot) in vars.iter().zip(acc.iter_mut()) {
        if let Some(g) = grads.get(var.as_tensor()) {
            let g = g.to_dtype(DType::F32)?;
            *slot = Some(match slot.take() {
                Some(prev) => (prev + g)?,
                None => g,
            });
        }
    }
    Ok(())
}

/// The accumulated gradients as one f32 tensor per variable: zeros where no loss reached it.
pub fn dense_gradients(
    vars: &[(String, Var)],
    acc: Vec<Option<Tensor>>,
) -> candle_core::Result<Vec<Tensor>> {
    vars.iter()
        .zip(acc)
        .map(|((_, var), g)| match g {
            Some(g) => Ok(g),
            None => Tensor::zeros(
                var.as_tensor().shape(),
                DType::F32,
                var.as_tensor().device(),
            ),
        })
        .collect()
}

/// Each gradient's squared L2 norm, summed in f64 on its device.
pub fn squared_norms(grads: &[Tensor]) -> candle_core::Result<Vec<f64>> {
    grads
        .iter()
        .map(|g| g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>())
        .collect()
}

/// Scales `grads` so their global L2 norm is at most `max_norm` (torch's `clip_grad_norm_`:
/// coefficient `max_norm / (norm + 1e-6)`, clamped at 1); `squared_norms` are theirs. Returns
/// the norm before clipping.
pub fn clip_grad_norm(
    grads: &mut [Tensor],
    squared_norms: &[f64],
    max_norm: f64,
) -> candle_core::Result<f64> {
    let total = squared_norms.iter().sum::<f64>().sqrt();
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for g in grads.iter_mut() {
            *g = g.affine(coef as f32 as f64, 0.0)?;
        }
    }
    Ok(total)
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
        opt.step_host(&[vec![0.5, -3.0, 0.0]], 1e-3);
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
        opt.step_host(&[vec![1.0]], 0.1);
        opt.step_host(&[vec![1.0]], 0.1);
        assert!((opt.params[0].master[0] + 0.2).abs() < 1e-6);
        assert!((opt.params[0].exp_avg[0] - 0.19).abs() < 1e-7);
    }

    fn tensors(values: &[&[f32]]) -> Vec<Tensor> {
        values
            .iter()
            .map(|v| Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap())
            .collect()
    }

    fn host(ts: &[Tensor]) -> Vec<Vec<f32>> {
        ts.iter().map(|t| t.to_vec1::<f32>().unwrap()).collect()
    }

    #[test]
    fn clipping_scales_to_max_norm_and_reports_the_prior_norm() {
        let mut g = tensors(&[&[3.0], &[4.0]]);
        let sq = squared_norms(&g).unwrap();
        assert_eq!(sq, vec![9.0, 16.0]);
        assert_eq!(clip_grad_norm(&mut g, &sq, 1.0).unwrap(), 5.0);
        let g = host(&g);
        assert!((g[0][0] - 0.6).abs() < 1e-6 && (g[1][0] - 0.8).abs() < 1e-6);
        let mut small = tensors(&[&[0.3], &[0.4]]);
        let sq = squared_norms(&small).unwrap();
        clip_grad_norm(&mut small, &sq, 1.0).unwrap();
        assert_eq!(host(&small), vec![vec![0.3], vec![0.4]]);
    }

    /// The device-generic AdamW is the host AdamW: ten steps of varied gradients (with decay,
    /// a changing lr) leave masters, moments and the written weights equal to 1e-7.
    #[test]
    fn tensor_adamw_equals_host_adamw_over_ten_steps() {
        let cfg = AdamWConfig {
            lr: 1e-2,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let init: Vec<Vec<f32>> = vec![vec![0.5, -1.25, 2.0, 0.0, 3.5, -0.75], vec![1.0, -2.0]];
        let vars_for = || -> Vec<Var> {
            vec![
                Var::from_tensor(&Tensor::from_slice(&init[0], (2, 3), &Device::Cpu).unwrap())
                    .unwrap(),
                Var::from_tensor(&Tensor::from_slice(&init[1], 2, &Device::Cpu).unwrap()).unwrap(),
            ]
        };
        let (host_vars, tensor_vars) = (vars_for(), vars_for());
        let mut host_opt = AdamW::new(cfg, init.clone());
        let mut tensor_opt =
            TensorAdamW::from_host(AdamW::new(cfg, init.clone()), &tensor_vars, &Device::Cpu)
                .unwrap();
        for step in 0..10 {
            let s = step as f32;
            let g0: Vec<f32> = (0..6)
                .map(|i| ((i as f32 + 1.0) * (s + 0.5)).sin())
                .collect();
            let g1 = vec![0.1 * s - 0.3, (s * 0.7).cos() * 1e-3];
            let grads = vec![
                Tensor::from_slice(&g0, (2, 3), &Device::Cpu).unwrap(),
                Tensor::from_slice(&g1, 2, &Device::Cpu).unwrap(),
            ];
            let lr = 1e-2 * (1.0 - step as f64 / 20.0);
            host_opt.update(&host_vars, &grads, lr).unwrap();
            tensor_opt.update(&tensor_vars, &grads, lr).unwrap();
        }
        assert_eq!(host_opt.steps(), 10);
        assert_eq!(tensor_opt.steps(), 10);
        let (a, b) = (host_opt.state().unwrap(), tensor_opt.state().unwrap());
        for (pa, pb) in a.iter().zip(&b) {
            for (x, y) in [
                (&pa.master, &pb.master),
                (&pa.exp_avg, &pb.exp_avg),
                (&pa.exp_avg_sq, &pb.exp_avg_sq),
            ] {
                for (u, v) in x.iter().zip(y) {
                    assert!((u - v).abs() <= 1e-7, "{u} vs {v}");
                }
            }
        }
        for (hv, tv) in host_vars.iter().zip(&tensor_vars) {
            let h = hv
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let t = tv
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert_eq!(h.len(), t.len());
            for (u, v) in h.iter().zip(&t) {
                assert!((u - v).abs() <= 1e-7, "{u} vs {v}");
            }
        }
        assert_ne!(a[0].master, init[0], "the weights moved");
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
