//! The inference path of Qwen3: many sequences of different lengths decoded together, each with
//! its own KV cache, so a decode step costs one new token per sequence and never recomputes a prefix.
//!
//! The new tokens of all sequences are flattened into one `[T, D]` matrix, so projections, MLP and
//! lm_head run as single large matmuls; only attention, which differs per sequence, is a loop over
//! sequences (written out over f32 slices, in parallel). It applies the same RMSNorm, RoPE and
//! softmax-in-f32 as the training path, so the two give the same numbers.

use super::rotary::rope_tables;
use super::visual::{VisualInjection, NOT_PROMPT};
use super::Qwen3;
use crate::error::{ModelError, Result};
use crate::image::ProcessedImage;
use crate::ops::linear;
use candle_core::{DType, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

/// Keys and values of one sequence: per layer, rows `[position][kv_head][hd]` in f32.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
    /// How far rotary positions run ahead of token indices after the prompt's images
    /// (`rope_delta` of Qwen3-VL's `get_rope_index`; 0 for text).
    rope_delta: i64,
}

#[derive(Debug, Clone, Default)]
struct LayerCache {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    /// Positions held (the prompt plus every token decoded so far).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Geometry of one attention call, shared by every sequence of a step.
struct Heads {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Heads {
    /// Causal attention of `n` new query rows (positions `past..past+n`) over a cache holding
    /// `past + n` rows; writes `[n, heads*hd]` into `out`.
    fn attend(&self, q: &[f32], k: &[f32], v: &[f32], past: usize, out: &mut [f32]) {
        let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
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
}

fn to_f32_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

impl Qwen3 {
    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![LayerCache::default(); self.config.num_hidden_layers],
            len: 0,
            rope_delta: 0,
        }
    }

    /// Feeds `chunks[i]` as the next tokens of the sequence whose cache is `caches[i]` (a whole
    /// prompt for a prefill, one token for a decode step), appends their keys and values, and
    /// returns the logits of each chunk's last token, `[chunks.len(), vocab]` in f32, computed in
    /// slices of the vocabulary (see [`VocabSlices`]).
    pub fn forward_cached(
        &self,
        chunks: &[&[u32]],
        caches: &mut [&mut KvCache],
    ) -> Result<VocabSlices> {
        self.forward_cached_with(chunks, &vec![&[][..]; chunks.len()], caches)
    }

    /// [`Qwen3::forward_cached`] where chunk `i` may carry `images[i]`, the images whose tokens
    /// it holds (Qwen3-VL): a chunk with images must be the first of its sequence (a prompt),
    /// and sets the cache's position offset for everything decoded after it.
    pub fn forward_cached_with(
        &self,
        chunks: &[&[u32]],
        images: &[&[Arc<ProcessedImage>]],
        caches: &mut [&mut KvCache],
    ) -> Result<VocabSlices> {
        if chunks.len() != caches.len()
            || chunks.len() != images.len()
            || chunks.iter().any(|c| c.is_empty())
        {
            return Err(ModelError::InvalidInput(
                "forward_cached needs one non-empty chunk (and one image list) per cache".into(),
            ));
        }
        let c = &self.config;
        let heads = Heads {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        };
        let (q_width, kv_width) = (
            heads.heads * heads.head_dim,
            heads.kv_heads * heads.head_dim,
        );
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut offsets = vec![0usize];
        let mut deltas = Vec::with_capacity(chunks.len());
        for ((chunk, cache), imgs) in chunks.iter().zip(caches.iter()).zip(images) {
            ids.extend_from_slice(chunk);
            match &self.vision {
                Some(v) if !imgs.is_empty() => {
                    if cache.len != 0 {
                        return Err(ModelError::InvalidInput(
                            "images can only come with a sequence's first chunk".into(),
                        ));
                    }
                    let grids: Vec<[usize; 3]> = imgs.iter().map(|i| i.grid_thw).collect();
                    let (p, delta) = v.tokens.rope_index(chunk, &grids)?;
                    positions.extend(p);
                    deltas.push(delta);
                }
                None if !imgs.is_empty() => {
                    return Err(ModelError::InvalidInput(
                        "the input has images, but the model has no vision tower".into(),
                    ))
                }
                _ => {
                    let start = cache.len as i64 + cache.rope_delta;
                    positions.extend((start..start + chunk.len() as i64).map(|p| [p as u32; 3]));
                    deltas.push(cache.rope_delta);
                }
            }
            offsets.push(ids.len());
        }
        self.validate_vocab(&ids, "decode input")?;
        if let Some(p) = positions
            .iter()
            .map(|p| p.iter().max().copied().unwrap_or(0))
            .find(|&p| p as usize >= c.max_position_embeddings)
        {
            return Err(ModelError::InvalidInput(format!(
                "position {p} is past the model's {} positions (max_position_embeddings)",
                c.max_position_embeddings
            )));
        }
        let total = ids.len();
        let (cos, sin) = rope_tables(c, &positions, self.dtype, &self.device)?;
        let visual = match &self.vision {
            Some(v) if images.iter().any(|i| !i.is_empty()) => {
                let all: Vec<&ProcessedImage> =
                    images.iter().flat_map(|i| i.iter().map(|p| &**p)).collect();
                // Only prompt chunks (those with images) carry image tokens.
                let mut locate = Vec::with_capacity(ids.len());
                for (chunk, imgs) in chunks.iter().zip(images) {
                    match imgs.is_empty() {
                        true => locate.extend(std::iter::repeat_n(NOT_PROMPT, chunk.len())),
                        false => locate.extend_from_slice(chunk),
                    }
                }
                Some(VisualInjection::new(v, &locate, &all, &self.device)?)
            }
            _ => None,
        };
        let ids = Tensor::from_vec(ids, total, &self.device)?;
        let mut x = self.model.embed_tokens.index_select(&ids, 0)?;
        if let Some(v) = &visual {
            x = v.write_embeds(&x)?;
        }
        for (l, layer) in self.model.layers.iter().enumerate() {
            let xn = layer.input_layernorm.forward(&x, c.rms_norm_eps)?;
            let (q, k, v) = layer.self_attn.qkv(c, &xn, &cos, &sin)?;
            let (q, k, v) = (to_f32_vec(&q)?, to_f32_vec(&k)?, to_f32_vec(&v)?);
            let mut attn = vec![0f32; total * q_width];
            let mut outs = Vec::with_capacity(chunks.len());
            let mut rest = attn.as_mut_slice();
            for w in offsets.windows(2) {
                let (head, tail) = rest.split_at_mut((w[1] - w[0]) * q_width);
                outs.push(head);
                rest = tail;
            }
            caches
                .par_iter_mut()
                .zip(outs)
                .enumerate()
                .for_each(|(i, (cache, out))| {
                    let (a, b) = (offsets[i], offsets[i + 1]);
                    let past = cache.len;
                    let lc = &mut cache.layers[l];
                    lc.k.extend_from_slice(&k[a * kv_width..b * kv_width]);
                    lc.v.extend_from_slice(&v[a * kv_width..b * kv_width]);
                    heads.attend(&q[a * q_width..b * q_width], &lc.k, &lc.v, past, out);
                });
            let attn =
                Tensor::from_vec(attn, (total, q_width), &self.device)?.to_dtype(self.dtype)?;
            x = (x + layer.self_attn.project_out(&attn)?)?;
            x = layer.mlp_residual(c, &x)?;
            if let Some(v) = &visual {
                x = v.add_deepstack(&x, l)?;
            }
        }
        for ((cache, chunk), delta) in caches.iter_mut().zip(chunks).zip(deltas) {
            cache.len += chunk.len();
            cache.rope_delta = delta;
        }
        let last: Vec<u32> = offsets[1..].iter().map(|&o| o as u32 - 1).collect();
        let last = Tensor::from_vec(last, chunks.len(), &self.device)?;
        let x = self
            .model
            .norm
            .forward(&x.index_select(&last, 0)?, c.rms_norm_eps)?;
        let rows = (LM_HEAD_SLICE_ELEMENTS / c.hidden_size).max(1024);
        let mut slices = Vec::new();
        let mut start = 0;
        while start < c.vocab_size {
            let w = self
                .lm_head
                .narrow(0, start, rows.min(c.vocab_size - start))?;
            slices.push(linear(&x, &w)?.to_dtype(DType::F32)?.contiguous()?);
            start += rows;
        }
        Ok(VocabSlices { slices })
    }
}

/// lm_head weights per vocabulary slice (2M elements: 8 MB in f32), so each slice's matmul works
/// from cache. One `[n, 151936]` matmul at once runs at ~95 GFLOP/s on 2 cores; 8192-row slices
/// at ~135.
const LM_HEAD_SLICE_ELEMENTS: usize = 1 << 21;

/// Logits of `n` rows over the vocabulary, held as consecutive vocabulary slices `[n, width]`.
pub struct VocabSlices {
    slices: Vec<Tensor>,
}

impl VocabSlices {
    /// The logits as one `[n, vocab]` tensor (a copy).
    pub fn to_tensor(&self) -> candle_core::Result<Tensor> {
        Tensor::cat(&self.slices, 1)
    }

    /// The slices as row-major f32 data, `[n × width]` each.
    pub fn to_vecs(&self) -> candle_core::Result<Vec<Vec<f32>>> {
        self.slices
            .iter()
            .map(|t| t.flatten_all()?.to_vec1::<f32>())
            .collect()
    }

    /// Calls `f` with borrowed row-major f32 data of every slice (no copy on the CPU).
    pub fn with_data<T>(&self, f: impl FnOnce(&[&[f32]]) -> T) -> candle_core::Result<T> {
        if self.slices.iter().any(|t| !t.device().is_cpu()) {
            let owned = self.to_vecs()?;
            let parts: Vec<&[f32]> = owned.iter().map(Vec::as_slice).collect();
            return Ok(f(&parts));
        }
        let guards: Vec<_> = self.slices.iter().map(|t| t.storage_and_layout()).collect();
        let mut parts = Vec::with_capacity(guards.len());
        for (t, (storage, layout)) in self.slices.iter().zip(&guards) {
            if let candle_core::Storage::Cpu(cpu) = &**storage {
                let data = cpu.as_slice::<f32>()?;
                parts.push(&data[layout.start_offset()..layout.start_offset() + t.elem_count()]);
            }
        }
        Ok(f(&parts))
    }
}
