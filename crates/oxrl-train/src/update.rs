//! The policy update: the trainer's side of a training step. The loop (`grpo.rs`) calls its
//! phases in order — [`PolicyTrainer::old_logprobs`], [`PolicyTrainer::ref_logprobs`], then
//! [`PolicyTrainer::update`] with the advantages it computed — and each PPO epoch and
//! mini-batch is one optimizer step over micro-batches with gradients accumulated, reduced
//! ([`PolicyTrainer::reduce_gradients`], where a data-parallel all-reduce goes), clipped and
//! applied by the [`Optimizer`].
//!
//! Every per-token loss is aggregated with weights built from the whole mini-batch's totals
//! ([`oxrl_algo::token_weights`]), so the accumulated gradient equals the unsplit batch's.

use crate::critic::Critic;
use crate::loss::{micro_batch_loss, LossMetrics, MicroBatch};
use crate::optim::{
    accumulate, adamw_on, clip_grad_norm, dense_gradients, host_values, squared_norms, AdamW,
    AdamWConfig, LrSchedule, Optimizer, ParamState,
};
use crate::parallel::DataParallel;
use crate::trajectory::Trajectory;
use crate::zero::{ZeroLayout, ZeroOptimizer};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use oxrl_algo::kl_reward::KlInReward;
use oxrl_algo::rollout_corr::{Correction, RolloutCorrectionConfig};
use oxrl_algo::{AdvantageConfig, BatchTotals, KlEstimator, LossAgg, PolicyLossConfig};
use oxrl_dist::chunk;
use oxrl_models::{checkpoint, BatchLogprobs, Entropy, PolicyModel, ScoreRequest};
use oxrl_rollout::WeightVersion;
use std::collections::{BTreeMap, HashMap};

pub use crate::error::{Result, TrainError};

/// Where `logp_old` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldLogprobs {
    /// The current policy before the update (exact on-policy ratio 1 at the first epoch).
    Recompute,
    /// The engine's log-probs as sampled (cheaper; their mismatch is logged).
    Rollout,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AlgorithmConfig {
    pub advantage: AdvantageConfig,
    pub policy_loss: PolicyLossConfig,
    /// β of the KL loss term; 0 means no reference model at all.
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    pub loss_agg: LossAgg,
    pub kl_loss_agg: LossAgg,
    /// L_max of `seq_mean_token_sum_norm`.
    pub loss_scale_factor: f64,
    pub old_logprobs: OldLogprobs,
    pub entropy_coef: f64,
    /// DAPO overlong filtering: truncated responses leave the update.
    pub overlong_filter: bool,
    /// Importance weights and rejection for the engine-vs-trainer mismatch
    /// (`oxrl_algo::rollout_corr`); `None`: off.
    pub rollout_correction: Option<RolloutCorrectionConfig>,
    /// The KL penalty in the reward instead of the loss (its β moves during a run under
    /// adaptive control); `None`: a KL loss term when `kl_coef > 0`.
    pub kl_in_reward: Option<KlInReward>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct UpdateConfig {
    /// Temperature of every log-prob (the sampling temperature).
    pub temperature: f64,
    /// Trajectories per optimizer step; `None` = the whole batch.
    pub mini_batch_size: Option<usize>,
    /// Trajectories per forward/backward.
    pub micro_batch_size: usize,
    pub ppo_epochs: usize,
    pub max_grad_norm: f64,
    pub optimizer: AdamWConfig,
    pub lr_schedule: LrSchedule,
    pub warmup_steps: u64,
    /// Optimizer steps the schedule spans.
    pub total_steps: u64,
}

/// What one update did: step metrics by name plus the per-trajectory detail.
#[derive(Debug, Clone, Default)]
pub struct UpdateReport {
    pub metrics: BTreeMap<String, f64>,
    /// The policy's log-probs at each trajectory's first forward of the update.
    pub logprobs: Vec<Vec<f32>>,
    /// ρ per token at each trajectory's first forward.
    pub ratios: Vec<Vec<f32>>,
    /// L2 norm of each parameter's gradient before clipping, at the last optimizer step.
    pub grad_norm_per_param: Vec<(String, f64)>,
}

/// What the policy said of a batch before the update, without gradients: `logp_old`, and the
/// entropies when the recompute pass produced them (so the update need not recompute them).
#[derive(Debug, Clone, Default)]
pub struct OldPolicy {
    pub logprobs: Vec<Vec<f32>>,
    pub entropy: Option<Vec<Vec<f32>>>,
    /// Mean |rollout − recomputed| log-prob over the tokens that have both: how far the engine's
    /// numbers are from the trainer's for the same weights.
    pub rollout_logprob_diff: Option<f64>,
    /// Rollout correction's weights and rejection for these trajectories, when it is on.
    pub correction: Option<Correction>,
    /// Per trajectory and response token, whether it enters the loss: an environment's
    /// observation tokens and the tokens rollout correction rejects do not. `None`: all do.
    pub keep: Option<Vec<Vec<bool>>>,
}

pub struct PolicyTrainer {
    pub policy: Box<dyn PolicyModel>,
    vars: Vec<(String, Var)>,
    pub reference: Option<Box<dyn PolicyModel>>,
    pub optimizer: Box<dyn Optimizer>,
    pub algorithm: AlgorithmConfig,
    pub update: UpdateConfig,
    /// The version of the policy's weights: training steps applied (one per [`update`] call),
    /// counted from the run's start, so a resumed run continues the count.
    ///
    /// [`update`]: PolicyTrainer::update
    pub weight_version: WeightVersion,
    /// How many versions older than the trainer's a sampled trajectory may be (0: strictly
    /// on-policy).
    pub max_staleness: u64,
    /// The data-parallel group this trainer shares steps with (one process by default).
    pub parallel: DataParallel,
    /// ZeRO-2: this rank's part of the optimizer state, when the group shards it (then
    /// `optimizer` holds nothing).
    pub zero: Option<ZeroOptimizer>,
    /// PPO's value model (`advantage = "gae"`), trained beside the policy.
    pub critic: Option<Critic>,
}

/// What one optimizer step did.
struct Applied {
    /// Global gradient norm before clipping.
    grad_norm: f64,
    lr: f64,
    /// Each parameter's gradient norm before clipping.
    per_param: Vec<(String, f64)>,
}

/// Running sums of one update's metrics.
#[derive(Default)]
struct Sums {
    loss: LossMetrics,
    grad_norm: f64,
    optimizer_steps: usize,
}

impl Sums {
    /// The sums over every rank's share: loss terms, counts and every ratio.
    fn across(mut self, parallel: &DataParallel) -> Result<Self> {
        if parallel.is_single() {
            return Ok(self);
        }
        let s = &mut self.loss;
        let mut totals = [
            s.loss,
            s.pg_loss,
            s.kl,
            s.entropy,
            s.tokens as f64,
            s.clipped as f64,
            s.dual_clipped as f64,
            s.ppo_kl_sum,
        ];
        parallel.sum(&mut totals)?;
        let [loss, pg_loss, kl, entropy, tokens, clipped, dual_clipped, ppo_kl_sum] = totals;
        (s.loss, s.pg_loss, s.kl, s.entropy) = (loss, pg_loss, kl, entropy);
        (s.tokens, s.clipped, s.dual_clipped) =
            (tokens as usize, clipped as usize, dual_clipped as usize);
        s.ppo_kl_sum = ppo_kl_sum;
        let mine: Vec<u8> = s.ratio.iter().flat_map(|r| r.to_le_bytes()).collect();
        s.ratio = parallel
            .gather_bytes(&mine)?
            .iter()
            .flat_map(|b| {
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            })
            .collect();
        Ok(self)
    }

    fn add(&mut self, m: LossMetrics) {
        let s = &mut self.loss;
        s.loss += m.loss;
        s.pg_loss += m.pg_loss;
        s.kl += m.kl;
        s.entropy += m.entropy;
        s.tokens += m.tokens;
        s.clipped += m.clipped;
        s.dual_clipped += m.dual_clipped;
        s.ppo_kl_sum += m.ppo_kl_sum;
        s.ratio.extend(m.ratio);
    }

    /// The update's metrics: loss terms per optimizer step, fractions per token.
    fn metrics(&self) -> BTreeMap<String, f64> {
        let s = &self.loss;
        let steps = self.optimizer_steps.max(1) as f64;
        let tokens = s.tokens.max(1) as f64;
        let n = s.ratio.len().max(1) as f64;
        let fold = |init: f32, f: fn(f32, f32) -> f32| s.ratio.iter().copied().fold(init, f) as f64;
        BTreeMap::from([
            ("loss".to_string(), s.loss / steps),
            ("pg_loss".to_string(), s.pg_loss / steps),
            ("kl".to_string(), s.kl / steps),
            ("entropy".to_string(), s.entropy / steps),
            ("grad_norm".to_string(), self.grad_norm / steps),
            ("pg_clipfrac".to_string(), s.clipped as f64 / tokens),
            (
                "pg_clipfrac_lower".to_string(),
                s.dual_clipped as f64 / tokens,
            ),
            ("ppo_kl".to_string(), s.ppo_kl_sum / tokens),
            (
                "ratio_mean".to_string(),
                s.ratio.iter().map(|&r| r as f64).sum::<f64>() / n,
            ),
            ("ratio_max".to_string(), fold(f32::NEG_INFINITY, f32::max)),
            ("ratio_min".to_string(), fold(f32::INFINITY, f32::min)),
        ])
    }
}

/// Refuses trajectories sampled under weights more than `max_staleness` versions behind
/// `current` (and any from a later version, which only a bug makes), naming the first one.
/// Trajectories without a version (a rollout file given to `--rollouts`) are off-policy by the
/// user's choice and pass.
pub fn check_weight_versions(
    trajs: &[Trajectory],
    current: WeightVersion,
    max_staleness: u64,
) -> Result<()> {
    for (i, t) in trajs.iter().enumerate() {
        let Some(v) = t.weight_version else { continue };
        let behind = current.0.checked_sub(v.0);
        if behind.is_none_or(|b| b > max_staleness) {
            return Err(TrainError::StaleWeights(format!(
                "trajectory {i} (uid {}) was sampled with weights {v}, and the trainer is at \
                 {current} (max_staleness = {max_staleness}): the engine did not sample from the \
                 trainer's weights",
                t.uid
            )));
        }
    }
    Ok(())
}

/// Mean |rollout − recomputed| log-prob over the tokens that have both (the policy's own: an
/// environment's tokens have no engine log-prob).
pub fn rollout_logprob_diff(trajs: &[Trajectory], recomputed: &[Vec<f32>]) -> Option<f64> {
    let pairs: Vec<(f32, f32)> = trajs
        .iter()
        .zip(recomputed)
        .flat_map(|(t, o)| {
            t.rollout_logprobs
                .iter()
                .copied()
                .zip(o.iter().copied())
                .enumerate()
                .filter(|(k, _)| t.loss_mask.get(*k).copied().unwrap_or(true))
                .map(|(_, pair)| pair)
        })
        .collect();
    (!pairs.is_empty())
        .then(|| pairs.iter().map(|(a, b)| (a - b).abs() as f64).sum::<f64>() / pairs.len() as f64)
}

pub(crate) fn requests(trajs: &[&Trajectory], temperature: f64) -> Vec<ScoreRequest> {
    trajs
        .iter()
        .map(|t| ScoreRequest {
            prompt_ids: t.prompt_ids.clone(),
            response_ids: t.response_ids.clone(),
            temperature,
            images: t.pixels.clone(),
        })
        .collect()
}

/// The values of trajectories `idx` of `t`, concatenated into one `[N]` tensor.
fn flat(t: &[Vec<f32>], idx: &[usize], dev: &Device) -> candle_core::Result<Tensor> {
    let v: Vec<f32> = idx.iter().flat_map(|&i| t[i].iter().copied()).collect();
    let n = v.len();
    Tensor::from_vec(v, n, dev)
}

impl PolicyTrainer {
    /// Makes `policy` trainable and starts AdamW from its weights, on the policy's device.
    pub fn new(
        mut policy: Box<dyn PolicyModel>,
        reference: Option<Box<dyn PolicyModel>>,
        algorithm: AlgorithmConfig,
        update: UpdateConfig,
    ) -> Result<Self> {
        if algorithm.kl_coef > 0.0 && reference.is_none() {
            return Err(TrainError::Invalid(
                "kl_coef > 0 needs a reference model".into(),
            ));
        }
        let vars = policy.make_trainable()?;
        let initial = host_values(&vars)?;
        let mut trainer = Self {
            optimizer: Box::new(AdamW::new(update.optimizer, Vec::new())),
            policy,
            vars,
            reference,
            algorithm,
            update,
            weight_version: WeightVersion::default(),
            max_staleness: 0,
            parallel: DataParallel::default(),
            zero: None,
            critic: None,
        };
        trainer.restore_optimizer(AdamW::new(trainer.update.optimizer, initial))?;
        Ok(trainer)
    }

    /// Mixed precision: the optimizer's f32 master weights from the checkpoint in `dir` (the one
    /// the policy was loaded from) instead of the policy's own values, so that a bf16 policy
    /// trains full-precision weights whose bf16 rounding it computes with — a step of 1e-3 on a
    /// weight near 1 is below bf16's spacing there (2⁻⁸) and would otherwise be lost. Nothing
    /// to do for an f32 policy.
    pub fn master_weights_from(&mut self, dir: &std::path::Path) -> Result<()> {
        if self.optimizer_steps() > 0 {
            return Err(TrainError::Invalid(
                "master weights are taken from a checkpoint before the first step only".into(),
            ));
        }
        if self
            .vars
            .iter()
            .all(|(_, v)| v.as_tensor().dtype() == DType::F32)
        {
            return Ok(());
        }
        // Shard by shard in their stored dtype, so the host holds the masters and one shard,
        // never the whole checkpoint in f32 beside them.
        let slot: HashMap<&str, usize> = self
            .vars
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.as_str(), i))
            .collect();
        let mut masters: Vec<Option<Vec<f32>>> = vec![None; self.vars.len()];
        for file in checkpoint::weight_files(dir)? {
            for (name, t) in checkpoint::load_shard(&file, &oxrl_models::HOST)? {
                let Some(&i) = slot.get(name.as_str()) else {
                    continue;
                };
                let own = self.vars[i].1.as_tensor();
                if t.dims() != own.dims() {
                    return Err(TrainError::Invalid(format!(
                        "master weights from {}: `{name}` is {:?} there and {:?} in the policy",
                        file.display(),
                        t.dims(),
                        own.dims()
                    )));
                }
                masters[i] = Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        let masters = masters
            .into_iter()
            .zip(&self.vars)
            .map(|(m, (name, _))| {
                m.ok_or_else(|| {
                    TrainError::Invalid(format!(
                        "master weights from {}: the checkpoint has no `{name}`",
                        dir.display()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.restore_optimizer(AdamW::new(self.update.optimizer, masters))
    }

    /// Puts `state` (host f32 master weights and moments, in variable order) in charge of the
    /// weights: the host AdamW on a CPU, the tensor AdamW on the policy's device elsewhere; under
    /// ZeRO-2, this rank's part of it.
    pub fn restore_optimizer(&mut self, state: AdamW) -> Result<()> {
        if let Some(zero) = &self.zero {
            let layout = zero.layout.clone();
            self.zero = Some(ZeroOptimizer::new(layout, &state, self.policy.device())?);
            return Ok(());
        }
        let vars: Vec<Var> = self.vars.iter().map(|(_, v)| v.clone()).collect();
        self.optimizer = adamw_on(self.policy.device(), state, &vars)?;
        Ok(())
    }

    /// ZeRO-2: resumes this rank's part of the optimizer state, saved by the same rank of a
    /// group of the same size.
    pub fn restore_optimizer_shard(&mut self, part: ParamState, step: u64) -> Result<()> {
        let Some(zero) = &self.zero else {
            return Err(TrainError::Invalid(
                "an optimizer shard for a run without ZeRO-2".into(),
            ));
        };
        let layout = zero.layout.clone();
        let device = self.policy.device().clone();
        self.zero = Some(ZeroOptimizer::from_shard(
            layout,
            self.update.optimizer,
            step,
            part,
            &device,
        )?);
        Ok(())
    }

    /// Optimizer steps taken.
    pub fn optimizer_steps(&self) -> u64 {
        match &self.zero {
            Some(zero) => zero.steps(),
            None => self.optimizer.steps(),
        }
    }

    /// ZeRO-2 over the trainer's data-parallel group: each rank keeps its part of the current
    /// optimizer state and drops the rest. Nothing to do in a group of one.
    pub fn shard_optimizer(&mut self) -> Result<()> {
        if self.parallel.is_single() || self.zero.is_some() {
            return Ok(());
        }
        let state = AdamW {
            config: self.update.optimizer,
            step: self.optimizer.steps(),
            params: self.optimizer.state()?,
        };
        let sizes: Vec<usize> = self.vars.iter().map(|(_, v)| v.elem_count()).collect();
        let layout = ZeroLayout::grouped(
            &decoder_layers(self.vars.iter().map(|(n, _)| n.as_str())),
            &sizes,
            self.parallel.rank(),
            self.parallel.world_size(),
        );
        self.zero = Some(ZeroOptimizer::new(layout, &state, self.policy.device())?);
        self.optimizer = Box::new(AdamW::new(self.update.optimizer, Vec::new()));
        Ok(())
    }

    /// Makes this trainer (and its critic) one rank of `parallel`.
    pub fn join(&mut self, parallel: DataParallel) {
        if let Some(critic) = &mut self.critic {
            critic.parallel = parallel.clone();
        }
        self.parallel = parallel;
    }

    /// Trajectories per optimizer step in an update of `n`.
    pub fn mini_batch_len(&self, n: usize) -> usize {
        self.update.mini_batch_size.unwrap_or(n).clamp(1, n.max(1))
    }

    /// The trainable parameters by name, in optimizer order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Names of the trainable parameters, in optimizer order.
    pub fn parameter_names(&self) -> Vec<&str> {
        self.vars.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Refuses trajectories the trainer may not learn from: see [`check_weight_versions`].
    pub fn check_weight_versions(&self, trajs: &[Trajectory]) -> Result<()> {
        check_weight_versions(trajs, self.weight_version, self.max_staleness)
    }

    /// `logp_old` of every trajectory: recomputed by the policy before the update (with its
    /// entropies), or the engine's rollout log-probs.
    pub fn old_logprobs(&self, trajs: &[Trajectory]) -> Result<OldPolicy> {
        match self.algorithm.old_logprobs {
            OldLogprobs::Rollout => {
                if let Some(i) = trajs.iter().position(|t| t.rollout_logprobs.is_empty()) {
                    return Err(TrainError::Invalid(format!(
                        "old_logprobs = \"rollout\" needs `rollout_logprobs`, and trajectory {i} has none"
                    )));
                }
                Ok(OldPolicy {
                    logprobs: trajs.iter().map(|t| t.rollout_logprobs.clone()).collect(),
                    ..Default::default()
                })
            }
            OldLogprobs::Recompute => {
                let all: Vec<&Trajectory> = trajs.iter().collect();
                let (old, entropy) = self
                    .policy
                    .detached()
                    .score_batch_with_entropy(&requests(&all, self.update.temperature))?;
                Ok(OldPolicy {
                    rollout_logprob_diff: rollout_logprob_diff(trajs, &old),
                    logprobs: old,
                    entropy: Some(entropy),
                    correction: None,
                    keep: None,
                })
            }
        }
    }

    /// The reference model's log-probs of every trajectory, when the KL term is on (through a
    /// detached view, so no autograd graph is recorded).
    pub fn ref_logprobs(&self, trajs: &[Trajectory]) -> Result<Option<Vec<Vec<f32>>>> {
        match (&self.reference, self.algorithm.kl_coef > 0.0) {
            (Some(r), true) => {
                let all: Vec<&Trajectory> = trajs.iter().collect();
                Ok(Some(
                    r.detached()
                        .score_batch(&requests(&all, self.update.temperature))?,
                ))
            }
            _ => Ok(None),
        }
    }

    /// The policy update of one training step on `trajs` with their `advantages` (one per
    /// response token): for each PPO epoch and mini-batch, one optimizer step. Advances
    /// [`PolicyTrainer::weight_version`].
    ///
    /// In a data-parallel group every rank holds the whole batch and computes its share of each
    /// mini-batch ([`DataParallel::update_shard`]), weighted by the whole mini-batch's totals;
    /// the optimizer step sums the shares' gradients. `old` and `reference` need only this
    /// rank's rows; the report holds every rank's.
    pub fn update(
        &mut self,
        trajs: &[Trajectory],
        advantages: &[Vec<f64>],
        old: &OldPolicy,
        reference: Option<&[Vec<f32>]>,
    ) -> Result<UpdateReport> {
        let mut report = UpdateReport {
            logprobs: vec![Vec::new(); trajs.len()],
            ratios: vec![Vec::new(); trajs.len()],
            ..Default::default()
        };
        let mini = self.mini_batch_len(trajs.len());
        let mut sums = Sums::default();
        let mut lr = 0.0;
        for _epoch in 0..self.update.ppo_epochs.max(1) {
            let order: Vec<usize> = (0..trajs.len()).collect();
            for batch in order.chunks(mini) {
                let mut acc: Vec<Option<Tensor>> = vec![None; self.vars.len()];
                let lsf = self.algorithm.loss_scale_factor;
                let totals = match old.keep.as_ref() {
                    Some(keep) => BatchTotals::kept(
                        &batch.iter().map(|&i| &keep[i][..]).collect::<Vec<_>>(),
                        lsf,
                    ),
                    None => BatchTotals {
                        tokens: batch.iter().map(|&i| trajs[i].response_ids.len()).sum(),
                        sequences: batch.len(),
                        loss_scale_factor: lsf,
                    },
                };
                let share = &batch[self.parallel.share(batch.len())];
                let micro_len = self.update.micro_batch_size.max(1);
                let mut micros = share.chunks(micro_len);
                // ZeRO-2 reduce-scatters every micro-batch's gradients as it ends; every rank
                // takes part in as many rounds as the busiest one (a rank with fewer
                // micro-batches sends zeros).
                let rounds = match self.zero.is_some() {
                    true => (0..self.parallel.world_size())
                        .map(|r| chunk(r, batch.len(), self.parallel.world_size()).len())
                        .max()
                        .unwrap_or(0)
                        .div_ceil(micro_len),
                    false => share.len().div_ceil(micro_len),
                };
                let mut shard_parts: Option<Vec<Tensor>> = None;
                for _ in 0..rounds {
                    let Some(micro) = micros.next() else {
                        let parts = self.idle_parts()?;
                        add_parts(&mut shard_parts, parts)?;
                        continue;
                    };
                    let (loss, m, out) =
                        self.micro_batch(trajs, micro, advantages, old, reference, &totals)?;
                    let mut at = 0;
                    for &i in micro {
                        let n = trajs[i].response_ids.len();
                        if report.logprobs[i].is_empty() {
                            report.logprobs[i] = m.logp[at..at + n].to_vec();
                            report.ratios[i] = m.metrics.ratio[at..at + n].to_vec();
                        }
                        at += n;
                    }
                    sums.add(m.metrics);
                    match self.zero.is_some() {
                        true => {
                            let parts = self.backward_sharded(&out, &loss)?;
                            add_parts(&mut shard_parts, parts)?;
                        }
                        false => self.accumulate(&mut acc, &out.backward(&loss)?)?,
                    }
                }
                let applied = match shard_parts {
                    Some(parts) => self.apply_sharded(Tensor::cat(&parts, 0)?)?,
                    None => self.apply(acc)?,
                };
                report.grad_norm_per_param = applied.per_param;
                sums.grad_norm += applied.grad_norm;
                sums.optimizer_steps += 1;
                lr = applied.lr;
            }
        }
        self.weight_version = WeightVersion(self.weight_version.0 + 1);
        let sums = sums.across(&self.parallel)?;
        report.metrics = sums.metrics();
        report.metrics.insert("lr".into(), lr);
        if !self.parallel.is_single() {
            let n = trajs.len();
            let mine = self.parallel.update_shard(n, mini);
            let own = |rows: &[Vec<f32>]| mine.iter().map(|&i| rows[i].clone()).collect();
            report.logprobs = self.parallel.gather_rows(own(&report.logprobs), n, mini)?;
            report.ratios = self.parallel.gather_rows(own(&report.ratios), n, mini)?;
        }
        Ok(report)
    }

    /// The forward of micro-batch `micro` (indexes into `trajs`) and its loss.
    fn micro_batch(
        &self,
        trajs: &[Trajectory],
        micro: &[usize],
        advantages: &[Vec<f64>],
        old: &OldPolicy,
        reference: Option<&[Vec<f32>]>,
        totals: &BatchTotals,
    ) -> Result<(Tensor, MicroBatchOutput, BatchLogprobs)> {
        let algo = &self.algorithm;
        let dev = self.policy.device().clone();
        let mtrajs: Vec<&Trajectory> = micro.iter().map(|&i| &trajs[i]).collect();
        let lens: Vec<usize> = mtrajs.iter().map(|t| t.response_ids.len()).collect();
        let entropy_mode = match (algo.entropy_coef != 0.0, &old.entropy) {
            (true, _) => Entropy::Differentiable,
            (false, Some(_)) => Entropy::None,
            (false, None) => Entropy::Value,
        };
        let mut out = self
            .policy
            .response_logprobs(&requests(&mtrajs, self.update.temperature), entropy_mode)?;
        let entropy = match (out.entropy.take(), &old.entropy) {
            (Some(h), _) => h,
            (None, Some(before)) => flat(before, micro, &dev)?,
            (None, None) => return Err(TrainError::Invalid("entropy was not computed".into())),
        };
        let adv: Vec<f32> = micro
            .iter()
            .flat_map(|&i| advantages[i].iter().map(|&a| a as f32))
            .collect();
        let adv = Tensor::from_vec(adv, out.logprobs.dims1()?, &dev)?;
        let old_logp = flat(&old.logprobs, micro, &dev)?;
        let ref_logp = reference.map(|r| flat(r, micro, &dev)).transpose()?;
        let correction = old.correction.as_ref();
        let is_weights = correction
            .and_then(|c| c.weights.as_ref())
            .map(|w| {
                let v: Vec<f32> = micro
                    .iter()
                    .flat_map(|&i| w[i].iter().map(|&x| x as f32))
                    .collect();
                let n = v.len();
                Tensor::from_vec(v, n, &dev)
            })
            .transpose()?;
        let keep: Option<Vec<bool>> = old
            .keep
            .as_ref()
            .map(|k| micro.iter().flat_map(|&i| k[i].iter().copied()).collect());
        let (loss, metrics) = micro_batch_loss(
            algo,
            &MicroBatch {
                logp: &out.logprobs,
                entropy: &entropy,
                old_logp: &old_logp,
                advantages: &adv,
                ref_logp: ref_logp.as_ref(),
                lens: &lens,
                totals,
                is_weights: is_weights.as_ref(),
                keep: keep.as_deref(),
            },
        )?;
        let logp = out.logprobs.to_vec1::<f32>()?;
        Ok((loss, MicroBatchOutput { logp, metrics }, out))
    }

    /// Adds a micro-batch's gradients to `acc` (one slot per parameter).
    fn accumulate(&self, acc: &mut [Option<Tensor>], grads: &GradStore) -> Result<()> {
        Ok(accumulate(&self.vars, acc, grads)?)
    }

    /// The mini-batch's gradients as one f32 tensor per parameter (zeros where the loss did not
    /// reach it), summed over the data-parallel group. This is the one place gradients are
    /// read after the backward passes.
    pub fn reduce_gradients(&self, acc: Vec<Option<Tensor>>) -> Result<Vec<Tensor>> {
        let mut grads = self.local_gradients(acc)?;
        self.parallel.sum_gradients(&mut grads)?;
        Ok(grads)
    }

    /// This rank's accumulated gradients, one f32 tensor per parameter (zeros where the loss
    /// did not reach it).
    fn local_gradients(&self, acc: Vec<Option<Tensor>>) -> Result<Vec<Tensor>> {
        Ok(dense_gradients(&self.vars, acc)?)
    }

    /// Reduces and clips the accumulated gradients and takes one optimizer step, which writes
    /// the new weights into the policy; returns the pre-clip norm, the learning rate used and
    /// each parameter's grad norm.
    fn apply(&mut self, acc: Vec<Option<Tensor>>) -> Result<Applied> {
        let mut grads = self.reduce_gradients(acc)?;
        let squared = squared_norms(&grads)?;
        let (grad_norm, per_param) = self.clip(&mut grads, &squared)?;
        let lr = self.scheduled_lr();
        let vars: Vec<Var> = self.vars.iter().map(|(_, v)| v.clone()).collect();
        self.optimizer.update(&vars, &grads, lr)?;
        Ok(Applied {
            grad_norm,
            lr,
            per_param,
        })
    }

    /// The learning rate of the next optimizer step.
    fn scheduled_lr(&self) -> f64 {
        let u = &self.update;
        u.lr_schedule.lr(
            u.optimizer.lr,
            self.optimizer_steps(),
            u.warmup_steps,
            u.total_steps,
        )
    }

    /// ZeRO-2: a micro-batch's backward with each bucket's gradients reduce-scattered and
    /// dropped — a decoder layer's as soon as the checkpointed backward has finished it, the
    /// others after it — in the layout's reduce order, which every rank keeps. Returns this
    /// rank's part of each bucket's sums, in bucket order.
    fn backward_sharded(&self, out: &BatchLogprobs, loss: &Tensor) -> Result<Vec<Tensor>> {
        let zero = self.sharded()?;
        let layout = &zero.layout;
        let mut parts: Vec<Option<Tensor>> = vec![None; layout.buckets()];
        let mut store = out.backward_with(loss, |l, grads| {
            let Some(b) = layout.layer_bucket(l) else {
                return Ok(());
            };
            let g = self.take_gradients(layout.bucket_params(b), grads)?;
            let part = zero
                .reduce_scatter_bucket(b, &g, &self.parallel)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            parts[b] = Some(part);
            Ok(())
        })?;
        for b in layout.reduce_order() {
            if parts[b].is_none() {
                let g = self.take_gradients(layout.bucket_params(b), &mut store)?;
                parts[b] = Some(zero.reduce_scatter_bucket(b, &g, &self.parallel)?);
            }
        }
        Ok(parts.into_iter().flatten().collect())
    }

    /// ZeRO-2: a round without a micro-batch on this rank (its share ran out before the
    /// others'): zeros reduce-scattered in the same order, so every rank's collectives match.
    fn idle_parts(&self) -> Result<Vec<Tensor>> {
        let zero = self.sharded()?;
        let layout = &zero.layout;
        let mut parts: Vec<Option<Tensor>> = vec![None; layout.buckets()];
        let mut nothing = GradStore::default();
        for b in layout.reduce_order() {
            let g = self.take_gradients(layout.bucket_params(b), &mut nothing)?;
            parts[b] = Some(zero.reduce_scatter_bucket(b, &g, &self.parallel)?);
        }
        Ok(parts.into_iter().flatten().collect())
    }

    fn sharded(&self) -> Result<&ZeroOptimizer> {
        self.zero
            .as_ref()
            .ok_or_else(|| TrainError::Invalid("a ZeRO-2 step without a sharded optimizer".into()))
    }

    /// The f32 gradients of parameters `params` taken out of `grads` (zeros for one the loss
    /// did not reach), so the store no longer holds them.
    fn take_gradients(
        &self,
        params: &[usize],
        grads: &mut GradStore,
    ) -> candle_core::Result<Vec<Tensor>> {
        params
            .iter()
            .map(|&p| {
                let var = self.vars[p].1.as_tensor();
                match grads.remove(var) {
                    Some(g) => g.to_dtype(DType::F32),
                    None => Tensor::zeros(var.shape(), DType::F32, var.device()),
                }
            })
            .collect()
    }

    /// [`PolicyTrainer::apply`] under ZeRO-2 with this rank's part of the summed gradients:
    /// the global norm from every rank's partial sums, clipping and AdamW on this rank's part,
    /// all-gather of the new weights.
    fn apply_sharded(&mut self, mut shard: Tensor) -> Result<Applied> {
        let lr = self.scheduled_lr();
        let squared = match &self.zero {
            Some(zero) => zero.squared_norms(&shard, &self.parallel)?,
            None => {
                return Err(TrainError::Invalid(
                    "ZeRO-2 step without a sharded optimizer".into(),
                ))
            }
        };
        let (grad_norm, per_param) = self.clip(std::slice::from_mut(&mut shard), &squared)?;
        let vars: Vec<Var> = self.vars.iter().map(|(_, v)| v.clone()).collect();
        if let Some(zero) = self.zero.as_mut() {
            zero.step(&vars, &shard, lr, &self.parallel)?;
        }
        Ok(Applied {
            grad_norm,
            lr,
            per_param,
        })
    }

    /// Clips `grads` (whole gradients, or this rank's part) to the global norm their
    /// parameters' `squared` norms give; returns the norm before clipping and each parameter's.
    /// A norm that is not finite stops the step before any weight moves.
    fn clip(&self, grads: &mut [Tensor], squared: &[f64]) -> Result<(f64, Vec<(String, f64)>)> {
        let per_param = self
            .vars
            .iter()
            .zip(squared)
            .map(|((name, _), sq)| (name.clone(), sq.sqrt()))
            .collect();
        let grad_norm = clip_grad_norm(grads, squared, self.update.max_grad_norm)?;
        if !grad_norm.is_finite() {
            return Err(TrainError::Invalid(format!(
                "gradient norm is {grad_norm}: the update was skipped to keep the weights intact"
            )));
        }
        Ok((grad_norm, per_param))
    }

    /// One supervised step: mean negative log-likelihood of the response tokens over the batch
    /// (token_mean, micro-batched with accumulation), then clipping and AdamW.
    pub fn sft_step(&mut self, batch: &[ScoreRequest]) -> Result<BTreeMap<String, f64>> {
        let tokens: usize = batch.iter().map(|r| r.response_ids.len()).sum();
        let mut acc: Vec<Option<Tensor>> = vec![None; self.vars.len()];
        let mut nll = 0.0;
        for micro in batch.chunks(self.update.micro_batch_size.max(1)) {
            let out = self.policy.response_logprobs(micro, Entropy::None)?;
            let loss = (out.logprobs.sum_all()? * (-1.0 / tokens as f64))?;
            nll += loss.to_scalar::<f32>()? as f64;
            self.accumulate(&mut acc, &out.backward(&loss)?)?;
        }
        let Applied { grad_norm, lr, .. } = self.apply(acc)?;
        Ok(BTreeMap::from([
            ("loss".to_string(), nll),
            ("grad_norm".to_string(), grad_norm),
            ("lr".to_string(), lr),
            ("tokens".to_string(), tokens as f64),
        ]))
    }
}

/// The decoder layers among parameter `names` (`….layers.<l>.…`), each with its parameters'
/// indexes, by layer: ZeRO-2's per-layer buckets.
fn decoder_layers<'a>(names: impl Iterator<Item = &'a str>) -> Vec<(usize, Vec<usize>)> {
    let mut layers: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, name) in names.enumerate() {
        let layer = name
            .split_once(".layers.")
            .and_then(|(_, rest)| rest.split('.').next())
            .and_then(|l| l.parse::<usize>().ok());
        if let Some(l) = layer {
            layers.entry(l).or_default().push(i);
        }
    }
    layers.into_iter().collect()
}

/// Adds one micro-batch's parts of the bucket sums (ZeRO-2) to the accumulated ones.
fn add_parts(acc: &mut Option<Vec<Tensor>>, parts: Vec<Tensor>) -> Result<()> {
    *acc = Some(match acc.take() {
        None => parts,
        Some(prev) => prev
            .into_iter()
            .zip(parts)
            .map(|(a, b)| a + b)
            .collect::<candle_core::Result<_>>()?,
    });
    Ok(())
}

/// A micro-batch's log-probs (host copy, for the report) and loss metrics.
struct MicroBatchOutput {
    logp: Vec<f32>,
    metrics: LossMetrics,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled_at(versions: &[Option<u64>]) -> Vec<Trajectory> {
        versions
            .iter()
            .enumerate()
            .map(|(i, v)| Trajectory {
                uid: format!("p{i}"),
                prompt_ids: vec![1],
                response_ids: vec![2],
                reward: 0.0,
                rollout_logprobs: Vec::new(),
                finish_reason: None,
                weight_version: v.map(WeightVersion),
                images: Vec::new(),
                pixels: Vec::new(),
                loss_mask: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn on_policy_accepts_only_the_current_version() {
        let now = WeightVersion(3);
        assert!(check_weight_versions(&sampled_at(&[Some(3), Some(3)]), now, 0).is_ok());
        let e = check_weight_versions(&sampled_at(&[Some(3), Some(2)]), now, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("trajectory 1 (uid p1)") && e.contains("v2") && e.contains("v3"),
            "{e}"
        );
        assert!(matches!(
            check_weight_versions(&sampled_at(&[Some(4)]), now, 5),
            Err(TrainError::StaleWeights(_))
        ));
    }

    #[test]
    fn max_staleness_admits_that_many_versions_behind() {
        let now = WeightVersion(5);
        assert!(check_weight_versions(&sampled_at(&[Some(5), Some(4), Some(3)]), now, 2).is_ok());
        assert!(check_weight_versions(&sampled_at(&[Some(2)]), now, 2).is_err());
    }

    #[test]
    fn unversioned_trajectories_pass() {
        assert!(check_weight_versions(&sampled_at(&[None, None]), WeightVersion(9), 0).is_ok());
    }
}
