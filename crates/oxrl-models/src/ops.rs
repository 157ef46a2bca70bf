//! Differentiable building blocks shared by the Qwen3 decoder and the Qwen3-VL vision tower.
//!
//! They are written out from candle primitives that carry a backward on purpose: candle-nn's
//! fused `rms_norm` / `rope` kernels have no backward and silently drop gradients on the
//! training path.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, D};

/// `x · wᵀ` for `x` of any rank, as one `[N, in] · [in, out]` product over the flattened
/// leading dimensions: broadcasting `w` over a batch instead would make the backward
/// materialise one weight gradient per batch element before summing them.
///
/// When only one operand carries a gradient — a weight that is not trained (a frozen vision
/// tower, LoRA's base weights) behind a trained input, or a trained weight (a LoRA `A`) over
/// an input nothing upstream trains — the product runs as [`OneSidedProduct`], whose backward
/// computes that operand's gradient only: candle's matmul backward computes and keeps both,
/// a full-size gradient buffer for the constant.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (leading, inputs) = match x.dims() {
        [] => candle_core::bail!("linear: a scalar input"),
        [rest @ .., last] => (rest.to_vec(), *last),
    };
    let rows = leading.iter().product::<usize>();
    let flat = x.reshape((rows, inputs))?;
    let out = match (flat.track_op(), w.track_op()) {
        _ if rows == 0 => flat.matmul(&w.t()?)?,
        (true, false) => flat.apply_op2(w, OneSidedProduct::Input)?,
        (false, true) => flat.apply_op2(w, OneSidedProduct::Weight)?,
        _ => flat.matmul(&w.t()?)?,
    };
    let mut shape = leading;
    shape.push(out.dim(1)?);
    out.reshape(shape)
}

/// `x · wᵀ` (`x`: `[N, in]`, `w`: `[out, in]`) whose backward returns the gradient of one
/// operand only. The forward is the backend product `x.matmul(&w.t())` runs, and each
/// gradient the product candle's matmul backward runs for that operand, so values and
/// gradients are bit-identical to the plain product's.
enum OneSidedProduct {
    /// Only `x` gets a gradient: `grad · w`.
    Input,
    /// Only `w` gets a gradient: `(xᵀ · grad)ᵀ`.
    Weight,
}

impl OneSidedProduct {
    fn forward<S: BackendStorage>(
        x: &S,
        x_layout: &Layout,
        w: &S,
        w_layout: &Layout,
    ) -> candle_core::Result<(S, Shape)> {
        let (rows, inputs) = x_layout.shape().dims2()?;
        let (outputs, w_inputs) = w_layout.shape().dims2()?;
        if inputs != w_inputs {
            candle_core::bail!("linear: input width {inputs} against a weight of {w_inputs}");
        }
        let w_t = w_layout.transpose(0, 1)?;
        let out = x.matmul(w, (1, rows, outputs, inputs), x_layout, &w_t)?;
        Ok((out, Shape::from((rows, outputs))))
    }
}

impl CustomOp2 for OneSidedProduct {
    fn name(&self) -> &'static str {
        "one-sided-product"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Self::forward(x, x_layout, w, w_layout)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_layout: &Layout,
        w: &candle_core::CudaStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Self::forward(x, x_layout, w, w_layout)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok(match self {
            Self::Input => (Some(grad.matmul(w)?), None),
            Self::Weight => (None, Some(x.t()?.matmul(grad)?.t()?)),
        })
    }
}

/// `weight * (x / sqrt(mean(x²) + eps))`, statistics in f32, cast back before the weight
/// multiply (as transformers does; it matters for bf16 parity).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&inv)?
        .to_dtype(dtype)?
        .broadcast_mul(weight)
}

/// Half-split (NeoX) rotary embedding: `x*cos + rotate_half(x)*sin`.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn ramp(shape: &[usize], scale: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * scale)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The flattened product is the batched one, in value and in the weight's gradient.
    #[test]
    fn linear_over_a_batch_equals_the_broadcast_product() {
        let x = ramp(&[2, 3, 4], 0.1);
        let w = Var::from_tensor(&ramp(&[5, 4], 0.2)).unwrap();
        let flat = linear(&x, w.as_tensor()).unwrap();
        let batched = x.broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap();
        assert_eq!(flat.dims(), &[2, 3, 5]);
        let grad = |y: &Tensor| {
            let g = (y * 1.5).unwrap().sum_all().unwrap().backward().unwrap();
            g.get(w.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (a, b) = (
            flat.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            batched.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        for (p, q) in a
            .iter()
            .zip(&b)
            .chain(grad(&flat).iter().zip(&grad(&batched)))
        {
            assert!((p - q).abs() < 1e-5, "{p} vs {q}");
        }
        assert!(linear(&Tensor::new(1f32, &Device::Cpu).unwrap(), w.as_tensor()).is_err());
    }

    /// One operand constant: the same output and the other operand's gradient, bit for bit,
    /// as the plain product, and no gradient computed for the constant.
    #[test]
    fn a_constant_operand_gets_no_gradient_and_nothing_else_changes() {
        let x = Var::from_tensor(&ramp(&[2, 3, 4], 0.1)).unwrap();
        let w = ramp(&[5, 4], 0.2);
        let frozen = linear(x.as_tensor(), &w).unwrap();
        let plain = x
            .as_tensor()
            .reshape((6, 4))
            .unwrap()
            .matmul(&w.t().unwrap())
            .unwrap()
            .reshape((2, 3, 5))
            .unwrap();
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(values(&frozen), values(&plain));
        let loss = |y: &Tensor| (y.sqr().unwrap() * 0.5).unwrap().sum_all().unwrap();
        let frozen_grads = loss(&frozen).backward().unwrap();
        let plain_grads = loss(&plain).backward().unwrap();
        assert_eq!(
            values(frozen_grads.get(x.as_tensor()).unwrap()),
            values(plain_grads.get(x.as_tensor()).unwrap())
        );
        // The plain product's backward also keeps a [4, 5] gradient for wᵀ.
        let weight_sized = |g: &candle_core::backprop::GradStore| {
            g.get_ids()
                .filter(|id| g.get_id(**id).unwrap().elem_count() == 20)
                .count()
        };
        assert_eq!(weight_sized(&plain_grads), 1);
        assert_eq!(weight_sized(&frozen_grads), 0);
        // A trained weight over an input nothing upstream trains: the weight's gradient as
        // the plain product gives it, and none for the input.
        let trained = Var::from_tensor(&w).unwrap();
        let constant = x.as_tensor().detach();
        let one_sided = loss(&linear(&constant, trained.as_tensor()).unwrap())
            .backward()
            .unwrap();
        let plain = loss(
            &constant
                .reshape((6, 4))
                .unwrap()
                .matmul(&trained.as_tensor().t().unwrap())
                .unwrap(),
        )
        .backward()
        .unwrap();
        assert_eq!(
            values(one_sided.get(trained.as_tensor()).unwrap()),
            values(plain.get(trained.as_tensor()).unwrap())
        );
        let input_sized = |g: &candle_core::backprop::GradStore| {
            g.get_ids()
                .filter(|id| g.get_id(**id).unwrap().elem_count() == 24)
                .count()
        };
        assert_eq!(input_sized(&plain), 1);
        assert_eq!(input_sized(&one_sided), 0);
    }
}
