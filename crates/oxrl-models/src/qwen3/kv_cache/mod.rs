//! The inference path of Qwen3: many sequences of different lengths decoded together, each with
//! its own KV cache, so a decode step costs one new token per sequence and never recomputes a prefix.
//!
//! The new tokens of all sequences are flattened into one `[T, D]` matrix, so projections, MLP and
//! lm_head run as single large matmuls; only attention, which differs per sequence, depends on
//! where the cache lives:
//! - [`CacheKind::Host`] (the CPU default): per-sequence f32 rows, attention written out over
//!   slices in parallel ([`host`]);
//! - [`CacheKind::Pooled`] (the default on a GPU): one device tensor per layer holds every
//!   sequence, and attention is a few batched kernels per layer ([`pool`]).
//!
//! Both apply the same RMSNorm, RoPE and softmax-in-f32 as the training path, so all three give
//! the same numbers.

mod host;
mod pool;

use super::rotary::rope_tables;
use super::visual::{VisualInjection, NOT_PROMPT};
use super::Qwen3;
use crate::error::{ModelError, Result};
use crate::image::ProcessedImage;
use crate::ops::linear;
use candle_core::{DType, Device, Tensor};
use pool::{PoolKey, PooledStep, SharedPool, Slot};
use std::sync::Arc;

/// Where a model's inference caches keep keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheKind {
    /// Per-sequence f32 vectors in host memory; fastest on a CPU.
    Host,
    /// One pool of device tensors shared by every sequence; what a GPU needs.
    Pooled,
}

impl CacheKind {
    /// Host on the CPU, pooled elsewhere.
    pub fn for_device(device: &Device) -> Self {
        match device.is_cpu() {
            true => CacheKind::Host,
            false => CacheKind::Pooled,
        }
    }
}

/// Keys and values of one sequence, and how far it has got.
#[derive(Debug)]
pub struct KvCache {
    store: Store,
    len: usize,
    /// How far rotary positions run ahead of token indices after the prompt's images
    /// (`rope_delta` of Qwen3-VL's `get_rope_index`; 0 for text).
    rope_delta: i64,
}

#[derive(Debug)]
enum Store {
    /// One entry per layer.
    Host(Vec<host::LayerRows>),
    /// A slot in the pool, given at the sequence's first step.
    Pooled(Option<Slot>),
}

impl KvCache {
    /// Positions held (the prompt plus every token decoded so far).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where this cache keeps its rows.
    pub fn kind(&self) -> CacheKind {
        match self.store {
            Store::Host(_) => CacheKind::Host,
            Store::Pooled(_) => CacheKind::Pooled,
        }
    }

    /// An independent copy, for another sample continuing the same prefix.
    pub fn fork(&self) -> Result<KvCache> {
        let store = match &self.store {
            Store::Host(layers) => Store::Host(layers.clone()),
            Store::Pooled(None) => Store::Pooled(None),
            Store::Pooled(Some(slot)) => Store::Pooled(Some(slot.fork(self.len)?)),
        };
        Ok(KvCache {
            store,
            len: self.len,
            rope_delta: self.rope_delta,
        })
    }
}

/// Geometry of one attention call, shared by every sequence of a step.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Geometry {
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// The kind every cache of a step shares, or an error naming the mix.
fn common_kind(caches: &[&mut KvCache]) -> Result<CacheKind> {
    let kind = caches.first().map_or(CacheKind::Host, |c| c.kind());
    match caches.iter().all(|c| c.kind() == kind) {
        true => Ok(kind),
        false => Err(ModelError::InvalidInput(
            "one forward_cached step mixes host and pooled KV caches".into(),
        )),
    }
}

impl Qwen3 {
    /// An empty cache for one sequence, of the model's [`Qwen3::kv_cache`] kind.
    pub fn new_cache(&self) -> KvCache {
        let store = match self.kv_cache {
            CacheKind::Host => Store::Host(vec![
                host::LayerRows::default();
                self.config.num_hidden_layers
            ]),
            CacheKind::Pooled => Store::Pooled(None),
        };
        KvCache {
            store,
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
        let geometry = Geometry {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        };
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
                Some(VisualInjection::new(v, &locate, &all, &self.device, false)?)
            }
            _ => None,
        };
        let ids = Tensor::from_vec(ids, total, &self.device)?;
        let mut x = self.model.embed_tokens.index_select(&ids, 0)?;
        if let Some(v) = &visual {
            x = v.write_embeds(&x)?;
        }
        let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let pasts: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let x = match common_kind(caches)? {
            CacheKind::Host => {
                let mut layers: Vec<&mut Vec<host::LayerRows>> = caches
                    .iter_mut()
                    .filter_map(|c| match &mut c.store {
                        Store::Host(layers) => Some(layers),
                        Store::Pooled(_) => None,
                    })
                    .collect();
                self.decoder_pass(x, (&cos, &sin), visual.as_ref(), |l, qkv| {
                    let mut rows: Vec<&mut host::LayerRows> =
                        layers.iter_mut().map(|c| &mut c[l]).collect();
                    host::attend_layer(&geometry, qkv, &offsets, &mut rows, &pasts)
                })?
            }
            CacheKind::Pooled => {
                let mut slots: Vec<&mut Option<Slot>> = caches
                    .iter_mut()
                    .filter_map(|c| match &mut c.store {
                        Store::Pooled(slot) => Some(slot),
                        Store::Host(_) => None,
                    })
                    .collect();
                let pool = self.pool_of(&slots)?;
                let mut rows = pool.lock();
                let step =
                    PooledStep::prepare(&pool, &mut rows, geometry, &mut slots, &pasts, &lens)?;
                self.decoder_pass(x, (&cos, &sin), visual.as_ref(), |l, qkv| {
                    step.attend(&rows, l, qkv)
                })?
            }
        };
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
        // On a GPU one matmul, so the sampler's copy to the host is one transfer per step.
        let rows = match self.device.is_cpu() {
            true => (LM_HEAD_SLICE_ELEMENTS / c.hidden_size).max(1024),
            false => c.vocab_size,
        };
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

    /// The decoder layers over the step's new rows `x [T, D]`, with `attend(layer, (q, k, v))`
    /// doing each layer's cached attention → `[T, heads·hd]`.
    fn decoder_pass(
        &self,
        mut x: Tensor,
        (cos, sin): (&Tensor, &Tensor),
        visual: Option<&VisualInjection>,
        mut attend: impl FnMut(usize, (&Tensor, &Tensor, &Tensor)) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let c = &self.config;
        for (l, layer) in self.model.layers.iter().enumerate() {
            let xn = layer.input_layernorm.forward(&x, c.rms_norm_eps)?;
            let (q, k, v) = layer.self_attn.qkv(c, &xn, cos, sin)?;
            let attn = attend(l, (&q, &k, &v))?.to_dtype(self.dtype)?;
            x = (x + layer.self_attn.project_out(&attn)?)?;
            x = layer.mlp_residual(c, &x)?;
            if let Some(v) = visual {
                x = v.add_deepstack(&x, l)?;
            }
        }
        Ok(x)
    }

    /// The pool the step's caches use: the one their slots are in, or this model's key's.
    fn pool_of(&self, slots: &[&mut Option<Slot>]) -> Result<Arc<SharedPool>> {
        let key = PoolKey {
            device: self.device.clone(),
            layers: self.config.num_hidden_layers,
            width: self.config.num_key_value_heads * self.config.head_dim,
            dtype: self.dtype,
        };
        let mut held = slots.iter().filter_map(|s| s.as_ref()).map(Slot::pool);
        let Some(pool) = held.next() else {
            return Ok(SharedPool::for_key(key));
        };
        if !pool.key().matches(&key) || held.any(|p| !Arc::ptr_eq(p, pool)) {
            return Err(ModelError::InvalidInput(
                "a KV cache was made by a model of another shape, dtype or device".into(),
            ));
        }
        Ok(pool.clone())
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
