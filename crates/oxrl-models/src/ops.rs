//! Differentiable building blocks shared by the Qwen3 decoder and the Qwen3-VL vision tower.
//!
//! They are written out from candle primitives that carry a backward on purpose: candle-nn's
//! fused `rms_norm` / `rope` kernels have no backward and silently drop gradients on the
//! training path.

use candle_core::{DType, Tensor, D};

/// `x · wᵀ` for `x` of any rank.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.broadcast_matmul(&w.t()?)
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
