//! Rotary position tables for the decoder, shared by the training and inference paths.

use crate::config::Qwen3Config;
use candle_core::{DType, Device, Tensor};

/// cos/sin tables `[positions.len(), hd]` for `(T, H, W)` positions, computed in f32 then cast
/// to `dtype`. Plain RoPE reads the T row; interleaved MRoPE takes frequency `i` from H when
/// `i % 3 == 1` and `i < 3·section[1]`, from W when `i % 3 == 2` and `i < 3·section[2]`, else
/// from T (so equal rows give plain RoPE, and text needs no second code path).
pub(crate) fn rope_tables(
    config: &Qwen3Config,
    positions: &[[u32; 3]],
    dtype: DType,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let hd = config.head_dim;
    let theta = config.rope_theta as f32;
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / hd as f32))
        .collect();
    let axis: Vec<usize> = (0..hd / 2)
        .map(|i| match config.mrope_section {
            Some([_, h, _]) if i % 3 == 1 && i < 3 * h => 1,
            Some([_, _, w]) if i % 3 == 2 && i < 3 * w => 2,
            _ => 0,
        })
        .collect();
    let mut emb = Vec::with_capacity(positions.len() * hd);
    for p in positions {
        let freqs = inv_freq.iter().zip(&axis).map(|(f, &a)| p[a] as f32 * f);
        emb.extend(freqs.clone());
        emb.extend(freqs);
    }
    let emb = Tensor::from_vec(emb, (positions.len(), hd), device)?;
    Ok((emb.cos()?.to_dtype(dtype)?, emb.sin()?.to_dtype(dtype)?))
}
