//! One-step off-policy training (`[trainer] async = "one_step"`): while the trainer learns from
//! step t's batch, the engine samples step t+1's with the weights from before that update, so
//! the two overlap. Every batch but the first is one weight version behind the trainer (the
//! version checks allow it: such a run's `max_staleness` is at least 1).
//!
//! The local engine shares the trainer's weight storage in a synchronous run; here it gets a
//! copy of its own ([`WeightSnapshot`]), overwritten from the trainer's at each sync, so the
//! update never changes the weights under a sampling in flight.

use crate::data::DataCursor;
use crate::observe::PhaseTimes;
use crate::trajectory::Trajectory;
use crate::update::{PolicyTrainer, Result, TrainError};
use candle_core::{DType, Device, Var};
use oxrl_models::{load_policy, PolicyModel};
use oxrl_reward::RewardOutcome;
use std::collections::BTreeMap;
use std::path::Path;

/// The engine's own copy of the policy's trainable weights.
pub(crate) struct WeightSnapshot {
    vars: Vec<(String, Var)>,
}

impl WeightSnapshot {
    /// A second copy of the policy in `dir` (the one the trainer loaded), holding `trainer`'s
    /// current weights; returns it and the model the engine samples from, which reads them.
    pub fn load(
        dir: &Path,
        dtype: DType,
        device: &Device,
        freeze_vision: bool,
        trainer: &PolicyTrainer,
    ) -> Result<(Self, Box<dyn PolicyModel>)> {
        let mut copy = load_policy(dir, dtype, device)?;
        copy.set_vision_frozen(freeze_vision);
        let vars = copy.make_trainable()?;
        let names = |v: &[(String, Var)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        if names(&vars) != names(trainer.vars()) {
            return Err(TrainError::Invalid(format!(
                "{}: the engine's copy of the policy has other parameters than the trainer's",
                dir.display()
            )));
        }
        let snapshot = Self { vars };
        snapshot.copy_from(trainer)?;
        Ok((snapshot, copy.detached()))
    }

    /// Overwrites the copy with the trainer's current weights.
    pub fn copy_from(&self, trainer: &PolicyTrainer) -> Result<()> {
        for ((_, mine), (_, theirs)) in self.vars.iter().zip(trainer.vars()) {
            mine.set(theirs.as_tensor())?;
        }
        Ok(())
    }
}

/// A batch sampled during the previous step's update, waiting for its own step.
pub(crate) struct Prefetched {
    pub trajs: Vec<Trajectory>,
    pub rewards: RewardOutcome,
    /// The sampling's own metrics (dynamic sampling's).
    pub sampling: BTreeMap<String, f64>,
    /// Its rollout and reward phases.
    pub time: PhaseTimes,
    /// The data order before this batch was drawn: a checkpoint written while it waits
    /// records this, so a resumed run samples the batch again.
    pub cursor: DataCursor,
}

/// How many weight versions behind `current` the trajectories were sampled, on average.
pub(crate) fn mean_staleness(trajs: &[Trajectory], current: u64) -> f64 {
    let lags: Vec<f64> = trajs
        .iter()
        .filter_map(|t| t.weight_version)
        .map(|v| current.saturating_sub(v.0) as f64)
        .collect();
    lags.iter().sum::<f64>() / lags.len().max(1) as f64
}
