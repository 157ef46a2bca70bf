//! Differentiable building blocks shared by the Qwen3 decoder and the Qwen3-VL vision tower.
//!
//! They are written out from candle primitives that carry a backward on purpose: candle-nn's
//! fused `rms_norm` / `rope` kernels have no backward and silently drop gradients on the
//! training path.

use candle_core::{DType, Tensor, D};

/// `x · wᵀ` for `x` of any rank, as one `[N, in] · [in, out]` product over the flattened
/// leading dimensions: broadcasting `w` over a batch instead would make the backward
/// materialise one weight gradient per batch element before summing them.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (leading, inputs) = match x.dims() {
        [] => candle_core::bail!("linear: a scalar input"),
        [rest @ .., last] => (rest.to_vec(), *last),
    };
    let rows = leading.iter().product::<usize>();
    let out = x.reshape((rows, inputs))?.matmul(&w.t()?)?;
    let mut shape = leading;
    shape.push(out.dim(1)?);
    out.reshape(shape)
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
}
