//! The host cache: each sequence keeps its keys and values as f32 rows in its own vectors, and
//! attention is a loop over sequences written out over f32 slices, in parallel. On a CPU this
//! beats any padded batched form: nothing is copied or padded, and each sequence's rows stay in
//! one core's cache.

use super::Geometry;
use candle_core::{DType, Tensor};
use rayon::prelude::*;

/// Keys and values of one layer of one sequence: rows `[position][kv_head][hd]` in f32.
#[derive(Debug, Clone, Default)]
pub(super) struct LayerRows {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// One layer's attention for every sequence of a step: appends each chunk's keys and values to
/// its sequence's rows (`pasts[i]` rows already there) and returns the attended rows
/// `[T, heads·hd]` in f32.
///
/// `q [T, heads, hd]`, `k`/`v [T, kv_heads, hd]` hold the chunks' tokens one after another,
/// chunk `i` at rows `offsets[i]..offsets[i+1]`.
pub(super) fn attend_layer(
    geometry: &Geometry,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    offsets: &[usize],
    layers: &mut [&mut LayerRows],
    pasts: &[usize],
) -> candle_core::Result<Tensor> {
    let (q_width, kv_width) = (geometry.q_width(), geometry.kv_width());
    let device = q.device().clone();
    let (q, k, v) = (to_f32_vec(q)?, to_f32_vec(k)?, to_f32_vec(v)?);
    let total = offsets[offsets.len() - 1];
    let mut attn = vec![0f32; total * q_width];
    let mut outs = Vec::with_capacity(layers.len());
    let mut rest = attn.as_mut_slice();
    for w in offsets.windows(2) {
        let (head, tail) = rest.split_at_mut((w[1] - w[0]) * q_width);
        outs.push(head);
        rest = tail;
    }
    layers
        .par_iter_mut()
        .zip(outs)
        .enumerate()
        .for_each(|(i, (rows, out))| {
            let (a, b) = (offsets[i], offsets[i + 1]);
            rows.k.extend_from_slice(&k[a * kv_width..b * kv_width]);
            rows.v.extend_from_slice(&v[a * kv_width..b * kv_width]);
            attend(
                geometry,
                &q[a * q_width..b * q_width],
                &rows.k,
                &rows.v,
                pasts[i],
                out,
            );
        });
    Tensor::from_vec(attn, (total, q_width), &device)
}

/// Causal attention of `n` new query rows (positions `past..past+n`) over a cache holding
/// `past + n` rows; writes `[n, heads·hd]` into `out`.
fn attend(g: &Geometry, q: &[f32], k: &[f32], v: &[f32], past: usize, out: &mut [f32]) {
    let (h, kv, hd) = (g.heads, g.kv_heads, g.head_dim);
    let n_rep = h / kv;
    let scale = (hd as f32).powf(-0.5);
    let n = q.len() / (h * hd);
    let mut scores = vec![0f32; past + n];
    for j in 0..n {
        let visible = past + j + 1;
        for head in 0..h {
            let kvh = head / n_rep;
            let qv = &q[(j * h + head) * hd..][..hd];
            let mut max = f32::NEG_INFINITY;
            for (t, s) in scores[..visible].iter_mut().enumerate() {
                let kr = &k[(t * kv + kvh) * hd..][..hd];
                *s = qv.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in &mut scores[..visible] {
                *s = (*s - max).exp();
                sum += *s;
            }
            let o = &mut out[(j * h + head) * hd..][..hd];
            o.fill(0.0);
            for (t, s) in scores[..visible].iter().enumerate() {
                let p = s / sum;
                let vr = &v[(t * kv + kvh) * hd..][..hd];
                for (a, b) in o.iter_mut().zip(vr) {
                    *a += p * b;
                }
            }
        }
    }
}

fn to_f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}
