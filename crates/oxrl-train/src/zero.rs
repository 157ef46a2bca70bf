//! ZeRO stage 2 (Rajbhandari et al., 2020): the optimizer state is split across the
//! data-parallel ranks instead of copied to each. The trainable parameters are laid end to end
//! in buckets of whole parameters; each bucket is padded to a multiple of the world size W and
//! rank r owns the r-th W-th of every bucket. A step then
//!
//! 1. reduce-scatters each bucket's gradients, so a rank receives only its part, summed;
//! 2. takes the global gradient norm from the ranks' partial sums of squares (one all-reduce of
//!    one number per parameter) and clips its part;
//! 3. runs AdamW on its part alone: f32 master weights and both moments exist for 1/W of the
//!    parameters on each rank;
//! 4. all-gathers each bucket's updated part into every rank's weights.
//!
//! Every rank writes its part of the optimizer state into the checkpoint; a run resumes from
//! them at the same world size (a checkpoint with the whole state resumes at any).

use crate::optim::{adamw_on, AdamW, Optimizer, ParamState};
use crate::parallel::DataParallel;
use crate::update::{Result, TrainError};
use candle_core::{DType, Device, Tensor, Var};
use oxrl_dist::chunk;
use std::ops::Range;

/// Elements per bucket (whole parameters are never split across buckets; one larger than this
/// is a bucket of its own).
const BUCKET_ELEMENTS: usize = 16 << 20;

/// One bucket: parameters laid end to end, padded to a multiple of the world size.
#[derive(Debug, Clone)]
struct Bucket {
    /// The parameters it holds, as indexes into the trainer's variables.
    params: Vec<usize>,
    /// The decoder layer whose parameters it holds, when it is one layer's.
    layer: Option<usize>,
    /// Each parameter's first element within the bucket.
    starts: Vec<usize>,
    /// Elements including the padding.
    padded: usize,
    /// This rank's part of the bucket.
    mine: Range<usize>,
}

/// The layout of the parameters in buckets, and this rank's part of each.
#[derive(Debug, Clone)]
pub struct ZeroLayout {
    buckets: Vec<Bucket>,
    sizes: Vec<usize>,
    world_size: usize,
    rank: usize,
}

impl ZeroLayout {
    /// Lays out parameters of `sizes` elements for rank `rank` of `world_size`, end to end.
    pub fn new(sizes: &[usize], rank: usize, world_size: usize) -> Self {
        Self::grouped(&[], sizes, rank, world_size)
    }

    /// One bucket per decoder layer (`layers`: the layer's index and its parameters), so a
    /// layer's gradients can be reduce-scattered as soon as the backward has finished them;
    /// the other parameters end to end in buckets of at most 16 M elements.
    pub fn grouped(
        layers: &[(usize, Vec<usize>)],
        sizes: &[usize],
        rank: usize,
        world_size: usize,
    ) -> Self {
        let bucket = |params: Vec<usize>, layer: Option<usize>| {
            let mut starts = Vec::with_capacity(params.len());
            let mut elements = 0;
            for &p in &params {
                starts.push(elements);
                elements += sizes[p];
            }
            let padded = elements.div_ceil(world_size) * world_size;
            Bucket {
                params,
                layer,
                starts,
                padded,
                mine: chunk(rank, padded, world_size),
            }
        };
        let mut buckets: Vec<Bucket> = layers
            .iter()
            .map(|(l, params)| bucket(params.clone(), Some(*l)))
            .collect();
        let in_layers: std::collections::HashSet<usize> =
            layers.iter().flat_map(|(_, p)| p.iter().copied()).collect();
        let rest: Vec<usize> = (0..sizes.len())
            .filter(|p| !in_layers.contains(p))
            .collect();
        let mut current: Vec<usize> = Vec::new();
        let mut elements = 0;
        for p in rest {
            if !current.is_empty() && elements + sizes[p] > BUCKET_ELEMENTS {
                buckets.push(bucket(std::mem::take(&mut current), None));
                elements = 0;
            }
            current.push(p);
            elements += sizes[p];
        }
        if !current.is_empty() {
            buckets.push(bucket(current, None));
        }
        ZeroLayout {
            buckets,
            sizes: sizes.to_vec(),
            world_size,
            rank,
        }
    }

    /// The bucket of decoder layer `layer`, if the layout has one.
    pub fn layer_bucket(&self, layer: usize) -> Option<usize> {
        self.buckets.iter().position(|b| b.layer == Some(layer))
    }

    /// The order every rank reduce-scatters the buckets in: the layers' from the last layer to
    /// the first (the order the checkpointed backward finishes them in), then the others.
    pub fn reduce_order(&self) -> Vec<usize> {
        let mut layers: Vec<(usize, usize)> = self
            .buckets
            .iter()
            .enumerate()
            .filter_map(|(b, bucket)| bucket.layer.map(|l| (l, b)))
            .collect();
        layers.sort_by_key(|&(l, _)| std::cmp::Reverse(l));
        let rest = (0..self.buckets.len()).filter(|&b| self.buckets[b].layer.is_none());
        layers.into_iter().map(|(_, b)| b).chain(rest).collect()
    }

    /// The parameters of bucket `b`, as indexes into the trainer's variables.
    pub fn bucket_params(&self, b: usize) -> &[usize] {
        &self.buckets[b].params
    }

    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Elements of the optimizer state this rank holds.
    pub fn shard_len(&self) -> usize {
        self.buckets.iter().map(|b| b.mine.len()).sum()
    }

    /// The part of each parameter's elements this rank owns: `(parameter, its elements
    /// [from, to), where they sit in the shard)`.
    fn owned(&self) -> Vec<(usize, Range<usize>, usize)> {
        let mut owned = Vec::new();
        let mut at = 0;
        for b in &self.buckets {
            for (k, &p) in b.params.iter().enumerate() {
                let (start, len) = (b.starts[k], self.sizes[p]);
                let from = start.max(b.mine.start);
                let to = (start + len).min(b.mine.end);
                if from < to {
                    owned.push((p, from - start..to - start, at + from - b.mine.start));
                }
            }
            at += b.mine.len();
        }
        owned
    }

    /// This rank's part of whole-parameter host vectors (padding as zeros), end to end.
    pub fn shard_of(&self, full: &[Vec<f32>]) -> Vec<f32> {
        let mut shard = vec![0f32; self.shard_len()];
        for (p, range, at) in self.owned() {
            shard[at..at + range.len()].copy_from_slice(&full[p][range]);
        }
        shard
    }
}

/// A rank's ZeRO-2 optimizer: its part of the state behind one flat f32 variable, and the
/// layout that says which part that is.
pub struct ZeroOptimizer {
    pub layout: ZeroLayout,
    /// This rank's f32 master weights, end to end (what AdamW updates).
    shard: Var,
    optimizer: Box<dyn Optimizer>,
}

impl ZeroOptimizer {
    /// Takes this rank's part of `state` (every parameter's, in order) onto `device`.
    pub fn new(layout: ZeroLayout, state: &AdamW, device: &Device) -> Result<Self> {
        let part = |f: fn(&ParamState) -> &Vec<f32>| -> Vec<f32> {
            let full: Vec<Vec<f32>> = state.params.iter().map(|p| f(p).clone()).collect();
            layout.shard_of(&full)
        };
        let mine = ParamState {
            master: part(|p| &p.master),
            exp_avg: part(|p| &p.exp_avg),
            exp_avg_sq: part(|p| &p.exp_avg_sq),
        };
        Self::from_shard(layout, state.config, state.step, mine, device)
    }

    /// Resumes from this rank's saved part.
    pub fn from_shard(
        layout: ZeroLayout,
        config: crate::optim::AdamWConfig,
        step: u64,
        mine: ParamState,
        device: &Device,
    ) -> Result<Self> {
        if mine.master.len() != layout.shard_len() {
            return Err(TrainError::Invalid(format!(
                "optimizer shard of {} elements for a rank that owns {}",
                mine.master.len(),
                layout.shard_len()
            )));
        }
        let shard = Var::from_tensor(&Tensor::from_slice(
            &mine.master,
            mine.master.len(),
            device,
        )?)?;
        let host = AdamW {
            config,
            step,
            params: vec![mine],
        };
        let optimizer = adamw_on(device, host, std::slice::from_ref(&shard))?;
        Ok(ZeroOptimizer {
            layout,
            shard,
            optimizer,
        })
    }

    pub fn steps(&self) -> u64 {
        self.optimizer.steps()
    }

    /// This rank's part of the optimizer state (master, moments), end to end.
    pub fn state(&self) -> Result<ParamState> {
        let mut all = self.optimizer.state()?;
        all.pop()
            .ok_or_else(|| TrainError::Invalid("the optimizer shard holds no state".into()))
    }

    /// Reduce-scatters bucket `b`'s gradients (`grads`: one f32 tensor per parameter of the
    /// bucket, in [`ZeroLayout::bucket_params`] order): this rank's part of their sums.
    pub fn reduce_scatter_bucket(
        &self,
        b: usize,
        grads: &[Tensor],
        parallel: &DataParallel,
    ) -> Result<Tensor> {
        let bucket = &self.layout.buckets[b];
        let mut flat: Vec<Tensor> = grads
            .iter()
            .map(|g| g.flatten_all())
            .collect::<candle_core::Result<_>>()?;
        let elements: usize = flat.iter().map(|t| t.elem_count()).sum();
        if bucket.padded > elements {
            let device = grads.first().map_or(&Device::Cpu, |g| g.device());
            flat.push(Tensor::zeros(bucket.padded - elements, DType::F32, device)?);
        }
        parallel.reduce_scatter(&Tensor::cat(&flat, 0)?)
    }

    /// Each parameter's squared gradient norm over the whole group, from this rank's part of
    /// the summed gradients (`shard`) and the other ranks' (one all-reduce).
    pub fn squared_norms(&self, shard: &Tensor, parallel: &DataParallel) -> Result<Vec<f64>> {
        let mut squared = vec![0f64; self.layout.sizes.len()];
        for (p, range, at) in self.layout.owned() {
            let piece = shard.narrow(0, at, range.len())?.to_dtype(DType::F64)?;
            squared[p] += piece.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
        parallel.sum(&mut squared)?;
        Ok(squared)
    }

    /// One AdamW step on this rank's part with its (clipped) gradient `shard_grad`, then the
    /// updated parts all-gathered into every parameter in `vars`.
    pub fn step(
        &mut self,
        vars: &[Var],
        shard_grad: &Tensor,
        lr: f64,
        parallel: &DataParallel,
    ) -> Result<()> {
        self.optimizer.update(
            std::slice::from_ref(&self.shard),
            std::slice::from_ref(shard_grad),
            lr,
        )?;
        let master = self.shard.as_tensor();
        let mut at = 0;
        for b in &self.layout.buckets {
            let mine = master.narrow(0, at, b.mine.len())?;
            at += b.mine.len();
            let bucket = parallel.all_gather(&mine)?;
            for (k, &p) in b.params.iter().enumerate() {
                let var = &vars[p];
                let value = bucket
                    .narrow(0, b.starts[k], self.layout.sizes[p])?
                    .reshape(var.as_tensor().shape())?
                    .to_dtype(var.as_tensor().dtype())?;
                var.set(&value)?;
            }
        }
        Ok(())
    }

    /// Which rank of how many this state belongs to.
    pub fn owner(&self) -> (usize, usize) {
        (self.layout.rank, self.layout.world_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_element_is_owned_by_exactly_one_rank() {
        let sizes = [5, 3, 7];
        let full: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(p, &n)| (0..n).map(|i| (p * 100 + i) as f32).collect())
            .collect();
        let mut seen: Vec<f32> = Vec::new();
        for rank in 0..4 {
            let layout = ZeroLayout::new(&sizes, rank, 4);
            // 15 elements in one bucket, padded to 16: 4 each.
            assert_eq!(layout.shard_len(), 4);
            let shard = layout.shard_of(&full);
            let owned = layout.owned();
            for (p, range, at) in owned {
                assert_eq!(&shard[at..at + range.len()], &full[p][range]);
            }
            seen.extend(shard);
        }
        // Rank order reproduces the parameters end to end, then the padding.
        let mut expected: Vec<f32> = full.concat();
        expected.push(0.0);
        assert_eq!(seen, expected);
    }
}
