//! `log_softmax(logits)[target]` per row in one pass over the vocabulary, with a backward
//! (`∂/∂z_j = g·(1[j = t] − softmax(z)_j)`, recomputed from the logits), and the entropy of each
//! row without gradient. candle's generic `log_softmax` + `gather` makes six passes and keeps
//! `[N, vocab]` intermediates for its backward; with a 151,936-token vocabulary that was most of
//! a GRPO step.
//!
//! On a GPU (the `cuda` feature) the same formulas run as `logprob.cu`'s kernels
//! ([`crate::logprob_cuda`]), for f32 or bf16 logits with f32 sums; these CPU functions are
//! their reference.

use crate::exp::{exp_shifted, max_of, sums_shifted};
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

fn f32_rows<'a>(s: &'a CpuStorage, l: &Layout) -> Result<(&'a [f32], usize, usize)> {
    let (n, v) = l.shape().dims2()?;
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("target-logprob: logits must be contiguous");
    };
    let data = s.as_slice::<f32>()?;
    Ok((&data[start..end], n, v))
}

fn u32_targets<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("target-logprob: targets must be contiguous");
    };
    Ok(&s.as_slice::<u32>()?[start..end])
}

/// `z_t − max − ln Σ exp(z − max)` for one row, with `Σ exp(z − max)·z` when `with_dot`.
fn row_logprob(row: &[f32], target: u32, with_dot: bool) -> (f32, f64, f64, f32) {
    let m = max_of(row);
    let (s, t) = sums_shifted(row, m, 1.0, with_dot);
    (row[target as usize] - m - s.ln() as f32, s, t, m)
}

struct TargetLogprob;

impl CustomOp2 for TargetLogprob {
    fn name(&self) -> &'static str {
        "target-logprob"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, n, v) = f32_rows(s1, l1)?;
        let t = u32_targets(s2, l2)?;
        if t.len() != n || t.iter().any(|&i| i as usize >= v) {
            candle_core::bail!("target-logprob: {} targets for {n} rows of {v}", t.len());
        }
        let out: Vec<f32> = (0..n)
            .into_par_iter()
            .map(|i| row_logprob(&x[i * v..(i + 1) * v], t[i], false).0)
            .collect();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        crate::logprob_cuda::target_logprobs_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = match logits.device() {
            Device::Cpu => cpu_grad(logits, targets, res, grad_res)?,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                crate::logprob_cuda::target_logprobs_bwd(logits, targets, res, grad_res)?
            }
            other => candle_core::bail!("target-logprob: no backward on {other:?}"),
        };
        Ok((Some(grad), None))
    }
}

/// `g_i·(1[j = t_i] − softmax(z_i)_j)` for every f32 logit on the CPU.
fn cpu_grad(logits: &Tensor, targets: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Tensor> {
    let logits = logits.contiguous()?;
    let (g, lp, t) = (
        grad_res.to_vec1::<f32>()?,
        res.to_vec1::<f32>()?,
        targets.to_vec1::<u32>()?,
    );
    let (n, v) = logits.dims2()?;
    let (storage, layout) = logits.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("target-logprob: the backward runs on the CPU");
    };
    let (x, _, _) = f32_rows(cpu, layout)?;
    let mut grad = vec![0f32; n * v];
    grad.par_chunks_mut(v).enumerate().for_each(|(i, out)| {
        let row = &x[i * v..(i + 1) * v];
        // ln Σ exp(z) = z_t − logp_t: the softmax needs no second reduction.
        let lse = row[t[i] as usize] - lp[i];
        exp_shifted(out, row, lse, 1.0);
        for o in out.iter_mut() {
            *o *= -g[i];
        }
        out[t[i] as usize] += g[i];
    });
    drop(storage);
    Tensor::from_vec(grad, (n, v), logits.device())
}

/// Refuses targets that do not index a row each, before any kernel reads them.
fn check_targets(op: &str, logits: &Tensor, targets: &[u32]) -> Result<(usize, usize)> {
    let (n, v) = logits.dims2()?;
    if targets.len() != n || targets.iter().any(|&i| i as usize >= v) {
        candle_core::bail!("{op}: {} targets for {n} rows of {v}", targets.len());
    }
    Ok((n, v))
}

/// Differentiable `log_softmax(logits)[targets]` of `[N, V]` logits (f32 on a CPU; f32 or
/// bf16 on a GPU), `[N]` f32 out.
pub fn target_logprobs(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    check_targets("target-logprob", logits, targets)?;
    let t = Tensor::new(targets, logits.device())?;
    logits.contiguous()?.apply_op2(&t, TargetLogprob)
}

/// Log-probabilities of the targets and (when `with_entropy`, else zeros) the entropy of each
/// row, without gradient, in one pass per row.
pub fn logprob_entropy(
    logits: &Tensor,
    targets: &[u32],
    with_entropy: bool,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (n, v) = check_targets("logprob-entropy", logits, targets)?;
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return crate::logprob_cuda::logprob_entropy_to_host(logits, targets, with_entropy);
    }
    let logits = logits.contiguous()?;
    let (storage, layout) = logits.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("logprob-entropy runs on the CPU");
    };
    let (x, _, _) = f32_rows(cpu, layout)?;
    let both: Vec<(f32, f32)> = (0..n)
        .into_par_iter()
        .map(|i| {
            let (lp, s, t, m) = row_logprob(&x[i * v..(i + 1) * v], targets[i], with_entropy);
            // H = ln S + max − Σ p·z, with Σ p·z = T / S.
            let h = if with_entropy {
                (s.ln() + m as f64 - t / s) as f32
            } else {
                0.0
            };
            (lp, h)
        })
        .collect();
    Ok(both.into_iter().unzip())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn logits() -> Tensor {
        let v: Vec<f32> = (0..3 * 1000)
            .map(|i| (((i * 7919) % 613) as f32 / 61.3) - 5.0)
            .collect();
        Tensor::from_vec(v, (3, 1000), &Device::Cpu).unwrap()
    }

    #[test]
    fn matches_log_softmax_gather_values_and_gradients() {
        let targets = [5u32, 999, 0];
        let x = Var::from_tensor(&logits()).unwrap();
        let weights = Tensor::new(&[1.0f32, -2.0, 0.5], &Device::Cpu).unwrap();
        let fused = target_logprobs(x.as_tensor(), &targets).unwrap();
        let g_fused = (&fused * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let ls = candle_nn_free_log_softmax(x.as_tensor());
        let t = Tensor::new(&targets, &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let reference = ls.gather(&t, 1).unwrap().squeeze(1).unwrap();
        let g_ref = (&reference * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (a, b) = (
            fused.to_vec1::<f32>().unwrap(),
            reference.to_vec1::<f32>().unwrap(),
        );
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-5, "{p} vs {q}");
        }
        let ga = g_fused.get(x.as_tensor()).unwrap();
        let gb = g_ref.get(x.as_tensor()).unwrap();
        let diff = (ga - gb)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-6, "{diff}");
    }

    /// `x − logsumexp(x)` from differentiable primitives.
    fn candle_nn_free_log_softmax(x: &Tensor) -> Tensor {
        let m = x.max_keepdim(D::Minus1).unwrap();
        let shifted = x.broadcast_sub(&m).unwrap();
        let lse = shifted
            .exp()
            .unwrap()
            .sum_keepdim(D::Minus1)
            .unwrap()
            .log()
            .unwrap();
        shifted.broadcast_sub(&lse).unwrap()
    }

    #[test]
    fn entropy_matches_its_definition() {
        let x = logits();
        let (lp, h) = logprob_entropy(&x, &[1, 2, 3], true).unwrap();
        let ls = candle_nn_free_log_softmax(&x);
        let want = (ls.exp().unwrap() * &ls)
            .unwrap()
            .sum(D::Minus1)
            .unwrap()
            .neg()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (a, b) in h.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let direct = target_logprobs(&x, &[1, 2, 3])
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(lp, direct);
    }

    /// `logprob.cu`'s arithmetic, in its order: each of 256 threads sums a strided share of the
    /// row in f32, then the 256 partial sums are added up in f32 (a warp tree, then the warps).
    fn kernel_order(row: &[f32], target: usize) -> (f32, f32) {
        const THREADS: usize = 256;
        let reduce = |partials: Vec<f32>, op: fn(f32, f32) -> f32| {
            let warps: Vec<f32> = partials
                .chunks(32)
                .map(|warp| {
                    let mut lanes = warp.to_vec();
                    let mut width = 16;
                    while width > 0 {
                        let before = lanes.clone();
                        for (lane, value) in lanes.iter_mut().enumerate() {
                            *value = op(*value, before[lane ^ width]);
                        }
                        width /= 2;
                    }
                    lanes[0]
                })
                .collect();
            warps[1..].iter().fold(warps[0], |a, &b| op(a, b))
        };
        let strided = |f: &dyn Fn(f32) -> f32, op: fn(f32, f32) -> f32, start: f32| {
            (0..THREADS)
                .map(|t| {
                    row.iter()
                        .skip(t)
                        .step_by(THREADS)
                        .fold(start, |a, &z| op(a, f(z)))
                })
                .collect::<Vec<f32>>()
        };
        let m = reduce(strided(&|z| z, f32::max, f32::NEG_INFINITY), f32::max);
        let add = |a: f32, b: f32| a + b;
        let s = reduce(strided(&|z| (z - m).exp(), add, 0.0), add);
        let dot = reduce(strided(&|z| (z - m).exp() * (z - m), add, 0.0), add);
        (row[target] - m - s.ln(), s.ln() - dot / s)
    }

    /// f32 sums in the GPU kernel's order over a Qwen3-sized vocabulary (151,936) stay within
    /// 1e-4 of this file's CPU path (f64 sums), for flat and for peaked rows.
    #[test]
    fn the_gpu_kernels_f32_sums_match_the_cpu_reference_over_a_full_vocabulary() {
        let vocab = 151_936;
        for (scale, peak) in [(1.0f32, 0.0f32), (4.0, 30.0)] {
            let row: Vec<f32> = (0..vocab)
                .map(|i| ((i * 7919 % 10007) as f32 / 10007.0 - 0.5) * scale)
                .enumerate()
                .map(|(i, z)| if i == 4242 { z + peak } else { z })
                .collect();
            let x = Tensor::from_vec(row.clone(), (1, vocab), &Device::Cpu).unwrap();
            for target in [0usize, 4242, vocab - 1] {
                let (lp, h) = logprob_entropy(&x, &[target as u32], true).unwrap();
                let (klp, kh) = kernel_order(&row, target);
                assert!((lp[0] - klp).abs() < 1e-4, "log-prob {} vs {klp}", lp[0]);
                assert!((h[0] - kh).abs() < 1e-4, "entropy {} vs {kh}", h[0]);
            }
        }
    }
}
