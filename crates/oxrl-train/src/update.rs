//! The policy update of one training step: advantages from rewards, old and reference
//! log-probs, then for each PPO epoch and mini-batch (one optimizer step each) the loss over
//! micro-batches with gradients accumulated, global-norm clipping and AdamW.
//!
//! Every per-token loss is aggregated with weights built from the whole mini-batch's totals
//! ([`oxrl_algo::token_weights`]), so the accumulated gradient equals the unsplit batch's.

use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::trajectory::Trajectory;
use candle_core::{DType, Tensor, Var};
use oxrl_algo::advantage::frac_zero_std_groups;
use oxrl_algo::{
    compute_advantages, kl_per_token, policy_loss, token_weights, AdvantageConfig, BatchTotals,
    KlEstimator, LossAgg, PolicyLossConfig,
};
use oxrl_models::{Entropy, Qwen3, ScoreRequest};
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Model(#[from] oxrl_models::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Engine(#[from] oxrl_rollout::EngineError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    Trajectory(#[from] crate::trajectory::TrajectoryError),
    #[error("{0}")]
    Io(String),
}

impl From<std::io::Error> for TrainError {
    fn from(e: std::io::Error) -> Self {
        TrainError::Io(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, TrainError>;

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
    pub advantages: Vec<f64>,
    /// The policy's log-probs at each trajectory's first forward of the update.
    pub logprobs: Vec<Vec<f32>>,
    pub old_logprobs: Vec<Vec<f32>>,
    pub ref_logprobs: Option<Vec<Vec<f32>>>,
    /// ρ per token at each trajectory's first forward.
    pub ratios: Vec<Vec<f32>>,
    /// L2 norm of each parameter's gradient before clipping, at the last optimizer step.
    pub grad_norm_per_param: Vec<(String, f64)>,
}

pub struct PolicyTrainer {
    pub policy: Qwen3,
    vars: Vec<(String, Var)>,
    pub reference: Option<Qwen3>,
    pub optimizer: AdamW,
    pub algorithm: AlgorithmConfig,
    pub update: UpdateConfig,
}

/// Per-trajectory numbers computed before the update, without gradient.
struct ScoredBefore<'a> {
    old: &'a [Vec<f32>],
    reference: Option<&'a [Vec<f32>]>,
    /// Entropies of the pre-update policy (from the recompute pass), if it ran.
    entropy: Option<&'a [Vec<f32>]>,
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
    loss: f64,
    pg_loss: f64,
    kl: f64,
    entropy: f64,
    tokens: usize,
    clipped: usize,
    dual_clipped: usize,
    ppo_kl: f64,
    grad_norm: f64,
    optimizer_steps: usize,
    ratios: Vec<f32>,
}

fn requests(trajs: &[&Trajectory], temperature: f64) -> Vec<ScoreRequest> {
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

fn flat(t: &[Vec<f32>], idx: &[usize], dev: &candle_core::Device) -> candle_core::Result<Tensor> {
    let v: Vec<f32> = idx.iter().flat_map(|&i| t[i].iter().copied()).collect();
    let n = v.len();
    Tensor::from_vec(v, n, dev)
}

impl PolicyTrainer {
    /// Makes `policy` trainable and starts AdamW from its weights.
    pub fn new(
        mut policy: Qwen3,
        reference: Option<Qwen3>,
        algorithm: AlgorithmConfig,
        update: UpdateConfig,
    ) -> Result<Self> {
        if algorithm.kl_coef > 0.0 && reference.is_none() {
            return Err(TrainError::Invalid(
                "kl_coef > 0 needs a reference model".into(),
            ));
        }
        let vars = policy.make_trainable()?;
        let initial = vars
            .iter()
            .map(|(_, v)| {
                v.as_tensor()
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let optimizer = AdamW::new(update.optimizer, initial);
        Ok(Self {
            policy,
            vars,
            reference,
            optimizer,
            algorithm,
            update,
        })
    }

    /// The trainable parameters by name, in optimizer order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Names of the trainable parameters, in optimizer order.
    pub fn parameter_names(&self) -> Vec<&str> {
        self.vars.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Log-probs of every trajectory's response under `model`, without gradients (through a
    /// detached view, so no autograd graph is recorded for the trainable policy).
    fn score(&self, model: &Qwen3, trajs: &[&Trajectory]) -> Result<Vec<Vec<f32>>> {
        Ok(model
            .detached()
            .score_batch(&requests(trajs, self.update.temperature))?)
    }

    /// One training step's update on `trajs` (one batch).
    pub fn step(&mut self, trajs: &[Trajectory]) -> Result<UpdateReport> {
        let all: Vec<&Trajectory> = trajs.iter().collect();
        let algo = self.algorithm.clone();
        let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
        let uids: Vec<&str> = trajs.iter().map(|t| t.uid.as_str()).collect();
        let lens: Vec<usize> = trajs.iter().map(|t| t.response_ids.len()).collect();
        let advantages = compute_advantages(&rewards, &uids, &lens, &algo.advantage);
        let mut report = UpdateReport {
            advantages: advantages.clone(),
            ..Default::default()
        };
        let started = std::time::Instant::now();
        // The pre-update policy's entropies, when the recompute pass already produced them.
        let mut entropy_before: Option<Vec<Vec<f32>>> = None;
        let old = match algo.old_logprobs {
            OldLogprobs::Rollout => {
                if let Some(i) = trajs.iter().position(|t| t.rollout_logprobs.is_empty()) {
                    return Err(TrainError::Invalid(format!(
                        "old_logprobs = \"rollout\" needs `rollout_logprobs`, and trajectory {i} has none"
                    )));
                }
                trajs.iter().map(|t| t.rollout_logprobs.clone()).collect()
            }
            OldLogprobs::Recompute => {
                let (old, h) = self
                    .policy
                    .detached()
                    .score_batch_with_entropy(&requests(&all, self.update.temperature))?;
                entropy_before = Some(h);
                let pairs: Vec<(f32, f32)> = trajs
                    .iter()
                    .zip(&old)
                    .flat_map(|(t, o)| t.rollout_logprobs.iter().copied().zip(o.iter().copied()))
                    .collect();
                if !pairs.is_empty() {
                    let diff = pairs.iter().map(|(a, b)| (a - b).abs() as f64).sum::<f64>();
                    report
                        .metrics
                        .insert("rollout_logprob_diff".into(), diff / pairs.len() as f64);
                }
                old
            }
        };
        report
            .metrics
            .insert("time/old_logprobs".into(), started.elapsed().as_secs_f64());
        let started = std::time::Instant::now();
        let reference = match (&self.reference, algo.kl_coef > 0.0) {
            (Some(r), true) => Some(self.score(r, &all)?),
            _ => None,
        };
        report
            .metrics
            .insert("time/ref".into(), started.elapsed().as_secs_f64());
        let started = std::time::Instant::now();
        report.logprobs = vec![Vec::new(); trajs.len()];
        report.ratios = vec![Vec::new(); trajs.len()];
        let mini = self
            .update
            .mini_batch_size
            .unwrap_or(trajs.len())
            .clamp(1, trajs.len());
        let mut sums = Sums::default();
        for _epoch in 0..self.update.ppo_epochs.max(1) {
            let order: Vec<usize> = (0..trajs.len()).collect();
            for batch in order.chunks(mini) {
                let known = ScoredBefore {
                    old: &old,
                    reference: reference.as_deref(),
                    entropy: entropy_before.as_deref(),
                };
                self.optimizer_step(trajs, batch, &advantages, &known, &mut sums, &mut report)?;
            }
        }
        report
            .metrics
            .insert("time/update".into(), started.elapsed().as_secs_f64());
        let steps = sums.optimizer_steps.max(1) as f64;
        let m = &mut report.metrics;
        m.insert("loss".into(), sums.loss / steps);
        m.insert("pg_loss".into(), sums.pg_loss / steps);
        m.insert("kl".into(), sums.kl / steps);
        m.insert("entropy".into(), sums.entropy / steps);
        m.insert("grad_norm".into(), sums.grad_norm / steps);
        m.insert(
            "pg_clipfrac".into(),
            sums.clipped as f64 / sums.tokens.max(1) as f64,
        );
        m.insert(
            "pg_clipfrac_lower".into(),
            sums.dual_clipped as f64 / sums.tokens.max(1) as f64,
        );
        m.insert("ppo_kl".into(), sums.ppo_kl / sums.tokens.max(1) as f64);
        m.insert(
            "frac_reward_zero_std".into(),
            frac_zero_std_groups(&rewards, &uids),
        );
        let n = sums.ratios.len().max(1) as f64;
        let mean = sums.ratios.iter().map(|&r| r as f64).sum::<f64>() / n;
        m.insert("ratio_mean".into(), mean);
        m.insert(
            "ratio_max".into(),
            sums.ratios
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max) as f64,
        );
        m.insert(
            "ratio_min".into(),
            sums.ratios.iter().copied().fold(f32::INFINITY, f32::min) as f64,
        );
        report.old_logprobs = old;
        report.ref_logprobs = reference;
        Ok(report)
    }

    /// The loss over one mini-batch (`batch` indexes `trajs`), micro-batch by micro-batch, then
    /// one optimizer step.
    fn optimizer_step(
        &mut self,
        trajs: &[Trajectory],
        batch: &[usize],
        advantages: &[f64],
        known: &ScoredBefore,
        sums: &mut Sums,
        report: &mut UpdateReport,
    ) -> Result<()> {
        let (old, reference) = (known.old, known.reference);
        let algo = &self.algorithm;
        let dev = self.policy.device.clone();
        let totals = BatchTotals {
            tokens: batch.iter().map(|&i| trajs[i].response_ids.len()).sum(),
            sequences: batch.len(),
            loss_scale_factor: algo.loss_scale_factor,
        };
        let mut acc: Vec<Option<Tensor>> = vec![None; self.vars.len()];
        for micro in batch.chunks(self.update.micro_batch_size.max(1)) {
            let mtrajs: Vec<&Trajectory> = micro.iter().map(|&i| &trajs[i]).collect();
            let lens: Vec<usize> = mtrajs.iter().map(|t| t.response_ids.len()).collect();
            let entropy_mode = match (algo.entropy_coef != 0.0, known.entropy) {
                (true, _) => Entropy::Differentiable,
                (false, Some(_)) => Entropy::None,
                (false, None) => Entropy::Value,
            };
            let out = self
                .policy
                .response_logprobs(&requests(&mtrajs, self.update.temperature), entropy_mode)?;
            let logp = out.logprobs;
            let entropy = match (out.entropy, known.entropy) {
                (Some(h), _) => h,
                (None, Some(before)) => flat(before, micro, &dev)?,
                (None, None) => return Err(TrainError::Invalid("entropy was not computed".into())),
            };
            let adv: Vec<f32> = micro
                .iter()
                .flat_map(|&i| {
                    std::iter::repeat_n(advantages[i] as f32, trajs[i].response_ids.len())
                })
                .collect();
            let adv = Tensor::from_vec(adv, logp.dims1()?, &dev)?;
            let old_t = flat(old, micro, &dev)?;
            let pl = policy_loss(&algo.policy_loss, &logp, &old_t, &adv, &lens)?;
            let w = Tensor::from_vec(
                token_weights(algo.loss_agg, &lens, &totals),
                logp.dims1()?,
                &dev,
            )?;
            let pg = (&pl.per_token * &w)?.sum_all()?;
            let mut loss = pg.clone();
            if let Some(r) = reference {
                let ref_t = flat(r, micro, &dev)?;
                let kw = token_weights(algo.kl_loss_agg, &lens, &totals);
                let kw = Tensor::from_vec(kw, logp.dims1()?, &dev)?;
                let kl = (kl_per_token(algo.kl_estimator, &logp, &ref_t)? * kw)?.sum_all()?;
                sums.kl += kl.to_scalar::<f32>()? as f64;
                loss = (loss + (kl * algo.kl_coef)?)?;
            }
            let ent = (&entropy * &w)?.sum_all()?;
            sums.entropy += ent.to_scalar::<f32>()? as f64;
            if algo.entropy_coef != 0.0 {
                loss = (loss - (ent * algo.entropy_coef)?)?;
            }
            sums.pg_loss += pg.to_scalar::<f32>()? as f64;
            sums.loss += loss.to_scalar::<f32>()? as f64;
            sums.tokens += lens.iter().sum::<usize>();
            sums.clipped += pl.clipped;
            sums.dual_clipped += pl.dual_clipped;
            let logp_v = logp.to_vec1::<f32>()?;
            let old_v = old_t.to_vec1::<f32>()?;
            sums.ppo_kl += old_v
                .iter()
                .zip(&logp_v)
                .map(|(o, l)| (o - l) as f64)
                .sum::<f64>();
            sums.ratios.extend(&pl.ratio);
            let mut at = 0;
            for (&i, &n) in micro.iter().zip(&lens) {
                if report.logprobs[i].is_empty() {
                    report.logprobs[i] = logp_v[at..at + n].to_vec();
                    report.ratios[i] = pl.ratio[at..at + n].to_vec();
                }
                at += n;
            }
            self.accumulate(&mut acc, &loss)?;
        }
        let Applied {
            grad_norm,
            lr,
            per_param,
        } = self.apply(acc)?;
        report.grad_norm_per_param = per_param;
        sums.grad_norm += grad_norm;
        sums.optimizer_steps += 1;
        report.metrics.insert("lr".into(), lr);
        Ok(())
    }

    /// Adds the gradient of `loss` to `acc` (one slot per parameter).
    fn accumulate(&self, acc: &mut [Option<Tensor>], loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        for ((_, var), slot) in self.vars.iter().zip(acc.iter_mut()) {
            if let Some(g) = grads.get(var.as_tensor()) {
                let g = g.to_dtype(DType::F32)?;
                *slot = Some(match slot.take() {
                    Some(prev) => (prev + g)?,
                    None => g,
                });
            }
        }
        Ok(())
    }

    /// Clips the accumulated gradients and takes one AdamW step, writing the new weights into the
    /// policy; returns the pre-clip norm, the learning rate used and each parameter's grad norm.
    fn apply(&mut self, acc: Vec<Option<Tensor>>) -> Result<Applied> {
        let mut grads: Vec<Vec<f32>> = Vec::with_capacity(self.vars.len());
        for ((_, var), g) in self.vars.iter().zip(acc) {
            grads.push(match g {
                Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                None => vec![0.0; var.as_tensor().elem_count()],
            });
        }
        let per_param = self
            .vars
            .iter()
            .zip(&grads)
            .map(|((name, _), g)| {
                let norm = g
                    .iter()
                    .map(|&x| (x as f64) * (x as f64))
                    .sum::<f64>()
                    .sqrt();
                (name.clone(), norm)
            })
            .collect();
        let grad_norm = clip_grad_norm(&mut grads, self.update.max_grad_norm);
        if !grad_norm.is_finite() {
            return Err(TrainError::Invalid(format!(
                "gradient norm is {grad_norm}: the update was skipped to keep the weights intact"
            )));
        }
        let u = &self.update;
        let lr = u.lr_schedule.lr(
            u.optimizer.lr,
            self.optimizer.step,
            u.warmup_steps,
            u.total_steps,
        );
        self.optimizer.step(&grads, lr);
        for ((_, var), state) in self.vars.iter().zip(&self.optimizer.params) {
            let t =
                Tensor::from_slice(&state.master, var.as_tensor().shape(), &self.policy.device)?;
            var.set(&t.to_dtype(var.as_tensor().dtype())?)?;
        }
        Ok(Applied {
            grad_norm,
            lr,
            per_param,
        })
    }

    /// One supervised step: mean negative log-likelihood of the response tokens over the batch
    /// (token_mean, micro-batched with accumulation), then clipping and AdamW.
    pub fn sft_step(&mut self, batch: &[ScoreRequest]) -> Result<BTreeMap<String, f64>> {
        let tokens: usize = batch.iter().map(|r| r.response_ids.len()).sum();
        let mut acc: Vec<Option<Tensor>> = vec![None; self.vars.len()];
        let mut nll = 0.0;
        for micro in batch.chunks(self.update.micro_batch_size.max(1)) {
            let logp = self
                .policy
                .response_logprobs(micro, Entropy::None)?
                .logprobs;
            let loss = (logp.sum_all()? * (-1.0 / tokens as f64))?;
            nll += loss.to_scalar::<f32>()? as f64;
            self.accumulate(&mut acc, &loss)?;
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
