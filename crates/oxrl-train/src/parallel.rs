//! Data parallelism: W processes (ranks) share one training step. Every rank samples and
//! rewards its share of the step's prompts; the shares are gathered, so each rank holds the
//! whole batch and computes the same advantages; then each rank computes log-probs and
//! gradients for its share of every mini-batch, weighted by the whole mini-batch's totals,
//! and the gradients are summed across ranks — so the step equals one process doing all of it,
//! up to the order floating-point sums are taken in. Each rank keeps the full optimizer state
//! and applies the same update (plain data parallelism; the sharded optimizer of ZeRO-2 is the
//! next stage, see `docs/distributed.md`).

use crate::shares;
use crate::update::Result;
use candle_core::Tensor;
use oxrl_dist::{chunk, Collective, Solo};
use oxrl_reward::RewardOutcome;
use oxrl_rollout::Completion;
use std::ops::Range;
use std::sync::Arc;

/// Gradient elements summed per all-reduce: large enough to amortise a round trip, small
/// enough that the flat copy is a fraction of the model (PyTorch DDP buckets 25 MB).
const BUCKET_ELEMENTS: usize = 16 << 20;

/// This process's place in the data-parallel group and the collectives it shares.
#[derive(Clone)]
pub struct DataParallel {
    group: Arc<dyn Collective>,
}

impl Default for DataParallel {
    /// One process: every collective is the identity.
    fn default() -> Self {
        DataParallel {
            group: Arc::new(Solo),
        }
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DataParallel(rank {} of {}, {})",
            self.rank(),
            self.world_size(),
            self.group.transport()
        )
    }
}

impl DataParallel {
    pub fn new(group: Arc<dyn Collective>) -> Self {
        DataParallel { group }
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn world_size(&self) -> usize {
        self.group.world_size()
    }

    /// Whether this rank writes the run's files (checkpoints, metrics, charts).
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    pub fn is_single(&self) -> bool {
        self.world_size() == 1
    }

    /// This rank's contiguous share of `n` items (the step's prompts).
    pub fn share(&self, n: usize) -> Range<usize> {
        chunk(self.rank(), n, self.world_size())
    }

    /// The trajectories (of `0..n`) rank `rank` computes in the update: its share of every
    /// mini-batch of `mini` trajectories.
    pub fn update_shard_of(&self, rank: usize, n: usize, mini: usize) -> Vec<usize> {
        let mini = mini.clamp(1, n.max(1));
        (0..n)
            .step_by(mini)
            .flat_map(|start| {
                let len = mini.min(n - start);
                chunk(rank, len, self.world_size()).map(move |i| start + i)
            })
            .collect()
    }

    /// This rank's trajectories in the update ([`DataParallel::update_shard_of`]).
    pub fn update_shard(&self, n: usize, mini: usize) -> Vec<usize> {
        self.update_shard_of(self.rank(), n, mini)
    }

    /// Per-trajectory values each rank computed for its update shard, put together: on return
    /// every rank holds all `n` rows in trajectory order.
    pub fn gather_rows(&self, mine: Vec<Vec<f32>>, n: usize, mini: usize) -> Result<Vec<Vec<f32>>> {
        if self.is_single() {
            return Ok(mine);
        }
        let mut bytes = Vec::new();
        for row in &mine {
            bytes.extend_from_slice(&(row.len() as u64).to_le_bytes());
            for v in row {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        let mut all = vec![Vec::new(); n];
        for (rank, message) in self.group.all_gather_bytes(&bytes)?.iter().enumerate() {
            let mut at = 0usize;
            for i in self.update_shard_of(rank, n, mini) {
                let len =
                    u64::from_le_bytes(message[at..at + 8].try_into().unwrap_or_default()) as usize;
                at += 8;
                all[i] = message[at..at + 4 * len]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                at += 4 * len;
            }
        }
        Ok(all)
    }

    /// Every rank's share of a sampling — its completions (per prompt) and their rewards —
    /// put together in rank order: each rank returns the whole batch's, bit for bit.
    pub fn gather_samples(
        &self,
        completions: Vec<Vec<Completion>>,
        rewards: RewardOutcome,
    ) -> Result<(Vec<Vec<Completion>>, RewardOutcome)> {
        if self.is_single() {
            return Ok((completions, rewards));
        }
        let shares = self.gather_bytes(&shares::encode(&completions, &rewards))?;
        let mut all = Vec::new();
        let mut outcome: Option<RewardOutcome> = None;
        for (rank, bytes) in shares.iter().enumerate() {
            let (completions, rewards) = shares::decode(bytes, rank)?;
            all.extend(completions);
            match &mut outcome {
                Some(o) => o.extend(rewards),
                None => outcome = Some(rewards),
            }
        }
        Ok((all, outcome.unwrap_or_default()))
    }

    /// [`DataParallel::gather_samples`] without rewards.
    pub fn gather_completions(
        &self,
        completions: Vec<Vec<Completion>>,
    ) -> Result<Vec<Vec<Completion>>> {
        Ok(self
            .gather_samples(completions, RewardOutcome::default())?
            .0)
    }

    /// Every rank's bytes, in rank order.
    pub fn gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(self.group.all_gather_bytes(mine)?)
    }

    /// The sum over ranks of a flat tensor (its length a multiple of the world size); this
    /// rank keeps its W-th ([`DataParallel::share`] of the elements).
    pub fn reduce_scatter(&self, t: &Tensor) -> Result<Tensor> {
        Ok(self.group.reduce_scatter_sum(t)?)
    }

    /// Every rank's flat part, end to end in rank order.
    pub fn all_gather(&self, part: &Tensor) -> Result<Tensor> {
        Ok(self.group.all_gather(part)?)
    }

    /// Sums host numbers over ranks in place.
    pub fn sum(&self, values: &mut [f64]) -> Result<()> {
        Ok(self.group.all_reduce_host(values)?)
    }

    /// Whether any rank says `flag`: ranks agree on stopping, so none waits in a collective
    /// for one that left.
    pub fn any(&self, flag: bool) -> Result<bool> {
        let mut v = [flag as u8 as f64];
        self.sum(&mut v)?;
        Ok(v[0] > 0.0)
    }

    /// Sums each rank's accumulated gradients in place, flattened into buckets of
    /// [`BUCKET_ELEMENTS`]: afterwards every rank holds the whole batch's gradients.
    pub fn sum_gradients(&self, grads: &mut [Tensor]) -> Result<()> {
        if self.is_single() {
            return Ok(());
        }
        let mut start = 0;
        while start < grads.len() {
            let mut end = start;
            let mut elements = 0;
            while end < grads.len()
                && (end == start || elements + grads[end].elem_count() <= BUCKET_ELEMENTS)
            {
                elements += grads[end].elem_count();
                end += 1;
            }
            let flat: Vec<Tensor> = grads[start..end]
                .iter()
                .map(|g| g.flatten_all())
                .collect::<candle_core::Result<_>>()?;
            let summed = self.group.all_reduce_sum(&Tensor::cat(&flat, 0)?)?;
            let mut at = 0;
            for g in &mut grads[start..end] {
                let n = g.elem_count();
                *g = summed.narrow(0, at, n)?.reshape(g.shape())?;
                at += n;
            }
            start = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in group of `world` ranks seen from `rank`, for the bookkeeping alone.
    struct Seat(usize, usize);

    impl Collective for Seat {
        fn rank(&self) -> usize {
            self.0
        }
        fn world_size(&self) -> usize {
            self.1
        }
        fn transport(&self) -> &'static str {
            "seat"
        }
        fn all_reduce_sum(&self, t: &Tensor) -> oxrl_dist::Result<Tensor> {
            Ok(t.clone())
        }
        fn reduce_scatter_sum(&self, t: &Tensor) -> oxrl_dist::Result<Tensor> {
            Ok(t.clone())
        }
        fn all_gather(&self, t: &Tensor) -> oxrl_dist::Result<Tensor> {
            Ok(t.clone())
        }
        fn broadcast(&self, t: &Tensor, _root: usize) -> oxrl_dist::Result<Tensor> {
            Ok(t.clone())
        }
        fn all_reduce_host(&self, _values: &mut [f64]) -> oxrl_dist::Result<()> {
            Ok(())
        }
        fn all_gather_bytes(&self, mine: &[u8]) -> oxrl_dist::Result<Vec<Vec<u8>>> {
            Ok(vec![mine.to_vec()])
        }
    }

    fn seat(rank: usize, world: usize) -> DataParallel {
        DataParallel::new(Arc::new(Seat(rank, world)))
    }

    #[test]
    fn every_mini_batch_is_split_across_the_ranks() {
        // 10 trajectories, mini-batches of 4 (4, 4, 2), 2 ranks.
        assert_eq!(seat(0, 2).update_shard(10, 4), vec![0, 1, 4, 5, 8]);
        assert_eq!(seat(1, 2).update_shard(10, 4), vec![2, 3, 6, 7, 9]);
        // More ranks than a mini-batch has trajectories: some ranks sit one out.
        assert_eq!(seat(0, 3).update_shard(4, 2), Vec::<usize>::new());
        assert_eq!(seat(1, 3).update_shard(4, 2), vec![0, 2]);
        assert_eq!(seat(2, 3).update_shard(4, 2), vec![1, 3]);
        let covered: Vec<usize> = {
            let mut all: Vec<usize> = (0..3)
                .flat_map(|r| seat(r, 3).update_shard(10, 4))
                .collect();
            all.sort();
            all
        };
        assert_eq!(covered, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn prompt_shares_are_contiguous() {
        assert_eq!(seat(0, 2).share(5), 0..2);
        assert_eq!(seat(1, 2).share(5), 2..5);
    }
}
