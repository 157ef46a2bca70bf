//! The pooled cache: every sequence's keys and values live in one device tensor per layer, so a
//! step attends over all its sequences with a fixed handful of kernels per layer (a scatter of
//! the new rows, a gather of the visible ones, two batched matmuls, a softmax) whatever the
//! number of sequences — no host round trip, no per-sequence launch. This is the form a GPU
//! needs; on a CPU the host cache is faster and stays the default there.
//!
//! Layout: a pool has `slots × capacity` rows of `kv_heads·hd` per layer; sequence slot `s`
//! keeps position `p` at row `s·capacity + p`. Both dimensions grow by doubling when a step
//! needs more (one copy of the pool). One pool serves every cache of a device, geometry and
//! dtype in the process, as vLLM keeps one cache per GPU: a model swapped in by a weight reload
//! carries on the sequences cached under the one before it.

use super::Geometry;
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

/// Slots a pool starts with (and its least growth).
const MIN_SLOTS: usize = 8;
/// Positions per slot a pool starts with.
const MIN_CAPACITY: usize = 64;

/// What a pool holds: caches of one device, depth, row width and dtype share it.
#[derive(Debug, Clone)]
pub(super) struct PoolKey {
    pub device: Device,
    pub layers: usize,
    pub width: usize,
    pub dtype: DType,
}

impl PoolKey {
    pub fn matches(&self, other: &PoolKey) -> bool {
        self.device.same_device(&other.device)
            && (self.layers, self.width, self.dtype) == (other.layers, other.width, other.dtype)
    }
}

/// A pool and what it is for.
#[derive(Debug)]
pub(super) struct SharedPool {
    key: PoolKey,
    rows: Mutex<PoolRows>,
}

impl SharedPool {
    /// The process's pool for `key`, made on first use; it lives while a cache holds a slot.
    pub fn for_key(key: PoolKey) -> Arc<SharedPool> {
        static POOLS: Mutex<Vec<Weak<SharedPool>>> = Mutex::new(Vec::new());
        let mut pools = POOLS.lock().unwrap_or_else(PoisonError::into_inner);
        pools.retain(|p| p.strong_count() > 0);
        if let Some(pool) = pools
            .iter()
            .filter_map(Weak::upgrade)
            .find(|p| p.key.matches(&key))
        {
            return pool;
        }
        let pool = Arc::new(SharedPool {
            key,
            rows: Mutex::new(PoolRows::default()),
        });
        pools.push(Arc::downgrade(&pool));
        pool
    }

    pub fn key(&self) -> &PoolKey {
        &self.key
    }

    /// The rows, for one step or one fork. A step holds them for its whole forward: a pool
    /// shared by two engines must not grow (and move every row) between one step's layers.
    pub fn lock(&self) -> MutexGuard<'_, PoolRows> {
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The pool's tensors and its slot bookkeeping.
#[derive(Debug, Default)]
pub(super) struct PoolRows {
    /// Per layer, keys and values `[slots·capacity, kv_heads·hd]`.
    layers: Vec<(Tensor, Tensor)>,
    slots: usize,
    capacity: usize,
    /// Slots handed out at least once; those below it and not in `free` are in use.
    issued: usize,
    free: Vec<usize>,
}

impl PoolRows {
    fn take_slot(&mut self) -> usize {
        self.free.pop().unwrap_or_else(|| {
            self.issued += 1;
            self.issued - 1
        })
    }

    /// Grows the tensors to hold every issued slot and `positions` per slot.
    fn ensure(&mut self, key: &PoolKey, positions: usize) -> Result<()> {
        if self.issued <= self.slots && positions <= self.capacity && !self.layers.is_empty() {
            return Ok(());
        }
        let slots = self
            .slots
            .max(self.issued.next_power_of_two())
            .max(MIN_SLOTS);
        let capacity = self
            .capacity
            .max(positions.next_power_of_two())
            .max(MIN_CAPACITY);
        if slots
            .checked_mul(capacity)
            .is_none_or(|r| r > u32::MAX as usize)
        {
            return Err(ModelError::InvalidInput(format!(
                "a KV pool of {slots} sequences × {capacity} positions has more rows than u32 \
                 indexes reach; decode fewer sequences at once (max_num_seqs)"
            )));
        }
        let width = key.width;
        let grow = |old: Option<&Tensor>| -> candle_core::Result<Tensor> {
            let Some(old) = old else {
                return Tensor::zeros((slots * capacity, width), key.dtype, &key.device);
            };
            let mut t = old.reshape((self.slots, self.capacity, width))?;
            if capacity > self.capacity {
                let pad = Tensor::zeros(
                    (self.slots, capacity - self.capacity, width),
                    key.dtype,
                    &key.device,
                )?;
                t = Tensor::cat(&[t, pad], 1)?;
            }
            if slots > self.slots {
                let pad = Tensor::zeros(
                    (slots - self.slots, capacity, width),
                    key.dtype,
                    &key.device,
                )?;
                t = Tensor::cat(&[t, pad], 0)?;
            }
            t.reshape((slots * capacity, width))
        };
        let layers = (0..key.layers)
            .map(|l| {
                let old = self.layers.get(l);
                Ok((grow(old.map(|(k, _)| k))?, grow(old.map(|(_, v)| v))?))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        (self.layers, self.slots, self.capacity) = (layers, slots, capacity);
        Ok(())
    }

    /// The pool row of `slot`'s `position`.
    fn row(&self, slot: usize, position: usize) -> u32 {
        (slot * self.capacity + position) as u32
    }
}

/// A sequence's slot in a pool; it goes back to the pool when the cache is dropped.
pub(super) struct Slot {
    pool: Arc<SharedPool>,
    index: usize,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Slot({})", self.index)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.lock().free.push(self.index);
    }
}

impl Slot {
    pub fn pool(&self) -> &Arc<SharedPool> {
        &self.pool
    }

    /// A new slot holding a copy of this one's first `len` positions.
    pub fn fork(&self, len: usize) -> Result<Slot> {
        let mut rows = self.pool.lock();
        let index = rows.take_slot();
        if let Err(e) = rows.ensure(&self.pool.key, len) {
            rows.free.push(index);
            return Err(e);
        }
        if len > 0 {
            let (from, to) = (rows.row(self.index, 0), rows.row(index, 0));
            for t in rows.layers.iter().flat_map(|(k, v)| [k, v]) {
                t.slice_set(&t.narrow(0, from as usize, len)?.copy()?, 0, to as usize)?;
            }
        }
        Ok(Slot {
            pool: self.pool.clone(),
            index,
        })
    }
}

/// One step's attention over the pool: the index tensors every layer shares.
pub(super) struct PooledStep {
    geometry: Geometry,
    /// Sequences, padded query rows and padded key rows per sequence.
    batch: usize,
    queries: usize,
    keys: usize,
    /// `[T, width]`: each new token's pool row, repeated along the row (scatter's index form).
    write: Tensor,
    /// `[B·keys]`: the pool rows sequence `b` attends over, padded with its last row.
    gather: Tensor,
    /// `[B·queries]`: the new-token row each padded query takes, padded with the chunk's last.
    pad_queries: Tensor,
    /// `[T]`: the padded query row of each new token.
    unpad: Tensor,
    /// `[B, 1, 1, queries, keys]` f32: 0 where a query sees a key, −∞ elsewhere.
    mask: Tensor,
}

impl PooledStep {
    /// Gives a slot to each sequence without one, grows the pool to hold every sequence's
    /// `pasts[i] + lens[i]` positions, and lays out the step's indices.
    pub fn prepare(
        pool: &Arc<SharedPool>,
        rows: &mut PoolRows,
        geometry: Geometry,
        slots: &mut [&mut Option<Slot>],
        pasts: &[usize],
        lens: &[usize],
    ) -> Result<PooledStep> {
        let key = &pool.key;
        let slot_index: Vec<usize> = slots
            .iter_mut()
            .map(|s| {
                s.get_or_insert_with(|| Slot {
                    pool: pool.clone(),
                    index: rows.take_slot(),
                })
                .index
            })
            .collect();
        let ends: Vec<usize> = pasts.iter().zip(lens).map(|(p, n)| p + n).collect();
        let keys = ends.iter().copied().max().unwrap_or(0);
        let queries = lens.iter().copied().max().unwrap_or(0);
        rows.ensure(key, keys)?;
        let batch = slots.len();
        let total: usize = lens.iter().sum();
        let (mut write, mut gather, mut pad_queries, mut unpad) = (
            Vec::with_capacity(total),
            Vec::with_capacity(batch * keys),
            Vec::with_capacity(batch * queries),
            Vec::with_capacity(total),
        );
        let mut mask = Vec::with_capacity(batch * queries * keys);
        let mut offset = 0u32;
        for (b, ((&slot, &past), &n)) in slot_index.iter().zip(pasts).zip(lens).enumerate() {
            write.extend((past..past + n).map(|p| rows.row(slot, p)));
            gather.extend((0..keys).map(|t| rows.row(slot, t.min(past + n - 1))));
            pad_queries.extend((0..queries).map(|j| offset + j.min(n - 1) as u32));
            unpad.extend((0..n).map(|j| (b * queries + j) as u32));
            for j in 0..queries {
                let sees = past + j.min(n - 1);
                mask.extend((0..keys).map(|t| if t <= sees { 0f32 } else { f32::NEG_INFINITY }));
            }
            offset += n as u32;
        }
        let device = &key.device;
        let write = Tensor::from_vec(write, (total, 1), device)?
            .broadcast_as((total, key.width))?
            .contiguous()?;
        Ok(PooledStep {
            geometry,
            batch,
            queries,
            keys,
            write,
            gather: Tensor::from_vec(gather, batch * keys, device)?,
            pad_queries: Tensor::from_vec(pad_queries, batch * queries, device)?,
            unpad: Tensor::from_vec(unpad, total, device)?,
            mask: Tensor::from_vec(mask, (batch, 1, 1, queries, keys), device)?,
        })
    }

    /// Layer `layer`'s attention: writes the new keys and values `[T, kv_heads, hd]` into the
    /// pool, then attends with queries `[T, heads, hd]` → `[T, heads·hd]`. Scores are computed
    /// in the model's dtype, scaled, and softmaxed in f32, as the training path does.
    pub fn attend(
        &self,
        rows: &PoolRows,
        layer: usize,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
    ) -> candle_core::Result<Tensor> {
        let Geometry {
            heads,
            kv_heads,
            head_dim: hd,
        } = self.geometry;
        let (b, n, l, rep) = (self.batch, self.queries, self.keys, heads / kv_heads);
        let total = q.dim(0)?;
        let (pool_k, pool_v) = &rows.layers[layer];
        pool_k.scatter_set(&self.write, &k.reshape((total, kv_heads * hd))?, 0)?;
        pool_v.scatter_set(&self.write, &v.reshape((total, kv_heads * hd))?, 0)?;
        // [B, kv_heads, keys, hd]
        let visible = |pool: &Tensor| {
            pool.index_select(&self.gather, 0)?
                .reshape((b, l, kv_heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (keys, values) = (visible(pool_k)?, visible(pool_v)?);
        // The `rep` query heads sharing a kv head sit together: [B, kv_heads, rep·queries, hd].
        let q = q
            .reshape((total, heads * hd))?
            .index_select(&self.pad_queries, 0)?
            .reshape((b, n, kv_heads, rep, hd))?
            .permute((0, 2, 3, 1, 4))?
            .contiguous()?
            .reshape((b, kv_heads, rep * n, hd))?;
        let scores = (q.matmul(&keys.t()?.contiguous()?)? * (hd as f64).powf(-0.5))?
            .to_dtype(DType::F32)?
            .reshape((b, kv_heads, rep, n, l))?
            .broadcast_add(&self.mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?
            .to_dtype(q.dtype())?
            .reshape((b, kv_heads, rep * n, l))?;
        probs
            .matmul(&values)?
            .reshape((b, kv_heads, rep, n, hd))?
            .permute((0, 3, 1, 2, 4))?
            .contiguous()?
            .reshape((b * n, heads * hd))?
            .index_select(&self.unpad, 0)
    }
}
