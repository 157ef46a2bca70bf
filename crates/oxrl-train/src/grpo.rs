//! The GRPO loop: prompts → rollout engine → trajectories → rewards → advantages → policy update
//! → the engine samples from the new weights (it shares the trainer's weight storage) → next
//! batch. Checkpoints and `--resume`, metrics, the Prometheus endpoint and the reward chart hang
//! off the loop here.

use crate::config::RewardKind;
use crate::config::{EnvironmentKind, RunConfig};
use crate::critic::{Critic, CRITIC_DIR};
use crate::data::{load_prompts, DataCursor, DataOrder, PromptRow};
use crate::interrupt::Interrupt;
use crate::note;
use crate::observe::{write_svg_chart, Gauges, MetricsLog, PhaseTimes, Progress};
use crate::one_step::{mean_staleness, Prefetched, WeightSnapshot};
use crate::parallel::DataParallel;
use crate::run_dir::RunDir;
use crate::sampling::Sampling;
use crate::state::{self, TrainerState};
use crate::trajectory::Trajectory;
use crate::update::{
    rollout_logprob_diff, OldLogprobs, OldPolicy, PolicyTrainer, Result, TrainError, UpdateReport,
};
use candle_core::{DType, Device};
use oxrl_algo::advantage::frac_zero_std_groups;
use oxrl_algo::value_loss::explained_variance;
use oxrl_algo::{
    estimate_advantages, AdvantageConfig, AdvantageEstimator, AdvantageInputs, TokenAdvantages,
};
use oxrl_env::{EnvironmentFactory, HttpEnvironmentFactory, ToolEnvironmentFactory};
use oxrl_models::{eos_token_ids, hub::resolve_model, load_policy, ImagePrompting, Tokenizer};
use oxrl_reward::sandbox::Limits;
use oxrl_reward::{
    build_rule, CodeReward, HttpReward, RewardFn, RewardInput, RewardModel, RewardOutcome,
    RewardSet, WeightedReward,
};
use oxrl_rollout::{Completion, Engine, LocalEngine, PromptImage, VllmEngine, WeightVersion};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) fn dtype(name: &str) -> DType {
    match name {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    }
}

/// Builds the policy trainer of a run: the policy (from `policy_dir`) on the run's device, the
/// reference model when `kl_coef > 0` (default: the policy's initial weights), AdamW with f32
/// master weights read from `policy_dir` (a bf16 policy computes with their rounding) — unless
/// `resuming`, when the saved optimizer state brings them.
///
/// With `advantage = "gae"` the trainer carries PPO's critic: from `[critic] path` (the policy's
/// checkpoint by default, with a fresh value head), or the checkpoint's `critic/` on a resume.
///
/// With `[model.lora]` the policy is the base model (`[model] path`) with adapters: fresh ones
/// drawn from the run's seed, or on a resume the checkpoint's (`policy_dir` then holds only
/// the adapter). The default reference is that same base with the adapters off, not a
/// second copy of its weights.
pub fn build_trainer(
    cfg: &RunConfig,
    policy_dir: &Path,
    device: &Device,
    resuming: bool,
) -> Result<PolicyTrainer> {
    let dt = dtype(&cfg.dtype);
    let base_dir = match (&cfg.lora, resuming) {
        (Some(_), true) => resolve_model(&cfg.model_path)?,
        _ => policy_dir.to_path_buf(),
    };
    let mut policy = load_policy(&base_dir, dt, device)?;
    policy.set_vision_frozen(cfg.freeze_vision);
    policy.set_gradient_checkpointing(cfg.gradient_checkpointing);
    if let Some(lora) = &cfg.lora {
        attach_adapters(cfg, lora, policy.as_mut(), policy_dir, resuming)?;
    }
    let reference = match (cfg.algorithm.kl_coef > 0.0, &cfg.reference_path, &cfg.lora) {
        (false, _, _) => None,
        (true, None, Some(_)) => {
            let base = policy.detached();
            base.set_adapters_enabled(false);
            Some(base)
        }
        (true, path, _) => {
            let r = path.as_deref().unwrap_or(&cfg.model_path);
            Some(load_policy(&resolve_model(r)?, dt, device)?)
        }
    };
    let mut trainer =
        PolicyTrainer::new(policy, reference, cfg.algorithm.clone(), cfg.update.clone())?;
    trainer.max_staleness = cfg.max_staleness;
    if let Some(critic) = &cfg.critic {
        // A resumed run's critic is the checkpoint's (its optimizer follows in `load_optimizer`).
        let dir = match resuming {
            true => policy_dir.join(CRITIC_DIR),
            false => resolve_model(&critic.path)?,
        };
        trainer.critic = Some(Critic::load(critic.clone(), &dir, dt, device, cfg.seed)?);
    }
    // A LoRA run's trainable tensors are its adapters, which no checkpoint holds yet: their
    // masters are their own starting values.
    if !resuming && cfg.lora.is_none() {
        trainer.master_weights_from(policy_dir)?;
    }
    Ok(trainer)
}

/// Puts the run's adapters on the base `policy`: the checkpoint's on a resume (refusing one
/// whose shape the config no longer describes), fresh ones otherwise.
fn attach_adapters(
    cfg: &RunConfig,
    lora: &oxrl_models::LoraConfig,
    policy: &mut dyn oxrl_models::PolicyModel,
    checkpoint: &Path,
    resuming: bool,
) -> Result<()> {
    if !resuming {
        policy.attach_lora(lora, cfg.seed)?;
        return Ok(());
    }
    policy.load_adapter(checkpoint)?;
    let saved = policy.lora();
    let same = saved.as_ref().is_some_and(|s| {
        s.rank == lora.rank
            && s.alpha == lora.alpha
            && s.rslora == lora.rslora
            && s.targets == lora.targets
    });
    if !same {
        return Err(TrainError::Invalid(format!(
            "{}: [model.lora] differs from the adapter in {} ({saved:?}); resume with the \
             configuration the run started with",
            cfg.source.display(),
            checkpoint.display()
        )));
    }
    Ok(())
}

/// The run's `[model] device`, opened; the error names the config file.
pub(crate) fn open_device(cfg: &RunConfig) -> Result<Device> {
    cfg.device
        .open()
        .map_err(|e| TrainError::Invalid(format!("{}: [model] device: {e}", cfg.source.display())))
}

/// The run's reward functions, built before the policy loads: a code reward finds the sandbox's
/// isolation and its interpreter here and a reward model is loaded, so a machine that cannot
/// run them stops the run at once.
pub(crate) fn reward_set(cfg: &RunConfig, device: &Device) -> Result<RewardSet> {
    if cfg.reward.functions.is_empty() && cfg.environment.is_none() {
        return Err(TrainError::Invalid(format!(
            "{}: a sampling run needs at least one [[reward.functions]] table",
            cfg.source.display()
        )));
    }
    let mut functions = Vec::new();
    for f in &cfg.reward.functions {
        let invalid = |e: String| {
            TrainError::Invalid(format!(
                "{}: reward function `{}`: {e}",
                cfg.source.display(),
                f.name
            ))
        };
        let function: Arc<dyn RewardFn> = match &f.kind {
            RewardKind::Rule(spec) => build_rule(spec).map_err(invalid)?.into(),
            RewardKind::Code(spec) => {
                Arc::new(CodeReward::new(spec.clone()).map_err(|e| invalid(e.to_string()))?)
            }
            RewardKind::Http(spec) => Arc::new(HttpReward::new(spec.clone())),
            RewardKind::Model(spec) => {
                let dir = resolve_model(&spec.path)?;
                Arc::new(
                    RewardModel::load(&dir, spec.clone(), device)
                        .map_err(|e| invalid(e.to_string()))?,
                )
            }
        };
        functions.push(WeightedReward {
            name: f.name.clone(),
            weight: f.weight,
            function,
        });
    }
    Ok(RewardSet {
        functions,
        failure_score: cfg.reward.failure_score,
        timeout: Duration::from_secs_f64(cfg.reward.timeout_s),
    })
}

/// The run's environment factory (`[environment]`), built before the policy loads so a
/// machine without the sandbox stops the run at once.
pub(crate) fn environments(cfg: &RunConfig) -> Result<Option<Box<dyn EnvironmentFactory>>> {
    let Some(env) = &cfg.environment else {
        return Ok(None);
    };
    let invalid = |e: oxrl_env::EnvError| {
        TrainError::Invalid(format!("{}: [environment]: {e}", cfg.source.display()))
    };
    Ok(Some(match &env.kind {
        EnvironmentKind::Tools { tools, answer_key } => Box::new(
            ToolEnvironmentFactory::new(tools, answer_key, Limits::default()).map_err(invalid)?,
        ),
        EnvironmentKind::Http(spec) => Box::new(HttpEnvironmentFactory::new(spec.clone())),
    }))
}

/// Every row has what the environment reads (the tools' ground truth), and no images: the
/// episodes are text-only for now.
pub(crate) fn check_environment_rows(cfg: &RunConfig, rows: &[PromptRow]) -> Result<()> {
    let Some(env) = &cfg.environment else {
        return Ok(());
    };
    for p in rows {
        if !p.images.is_empty() {
            return Err(TrainError::Invalid(format!(
                "{}: a prompt with images; [environment] episodes take text prompts only",
                p.at
            )));
        }
        if let EnvironmentKind::Tools { answer_key, .. } = &env.kind {
            if !p.row.contains_key(answer_key) {
                return Err(TrainError::Invalid(format!(
                    "{}: no `{answer_key}` column, which the tools environment checks final answers against",
                    p.at
                )));
            }
        }
    }
    Ok(())
}

/// Every row has the columns the run's reward functions read: a missing answer would
/// otherwise score every response of its prompt 0, and the run would train on noise.
pub(crate) fn check_reward_columns(cfg: &RunConfig, rows: &[PromptRow]) -> Result<()> {
    for f in &cfg.reward.functions {
        let Some((column, key)) = f.required_column() else {
            continue;
        };
        if let Some(row) = rows.iter().find(|r| !r.row.contains_key(column)) {
            return Err(TrainError::Invalid(format!(
                "{}: no `{column}` column, which reward function `{}` reads ({key} in {})",
                row.at,
                f.name,
                cfg.source.display()
            )));
        }
    }
    Ok(())
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: u64,
    /// Mean reward of the first and of the last (up to) 10 steps.
    pub reward_start: f64,
    pub reward_end: f64,
    pub output_dir: PathBuf,
    /// The signal that stopped the run before `max_steps`, and the checkpoint it left.
    pub interrupted: Option<(i32, Option<PathBuf>)>,
}

pub struct GrpoRun {
    cfg: RunConfig,
    model_dir: PathBuf,
    trainer: PolicyTrainer,
    engine: Box<dyn Engine>,
    tokenizer: Arc<Tokenizer>,
    rewards: RewardSet,
    /// `[environment]`: each trajectory is a multi-turn episode with one of these.
    environments: Option<Box<dyn EnvironmentFactory>>,
    prompts: Vec<PromptRow>,
    /// Validation prompts (`[data] val_files`), decoded greedily.
    val: Vec<PromptRow>,
    order: DataOrder,
    step: u64,
    /// The metrics log; rank 0's alone in a data-parallel group.
    metrics: Option<MetricsLog>,
    gauges: Gauges,
    save_rollouts: bool,
    /// Held for the run: the lock on the output directory (rank 0's).
    _run_dir: Option<RunDir>,
    /// One-step off-policy with the local engine: the engine's own copy of the weights.
    snapshot: Option<WeightSnapshot>,
    /// One-step off-policy: the next step's batch, sampled during this step's update.
    prefetched: Option<Prefetched>,
}

pub(crate) fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    (
        m,
        (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n).sqrt(),
    )
}

impl GrpoRun {
    /// Loads everything a sampling run needs; with `resume`, continues from the newest complete
    /// checkpoint in the output directory.
    pub fn new(cfg: RunConfig, resume: bool, save_rollouts: bool) -> Result<Self> {
        Self::new_parallel(cfg, resume, save_rollouts, DataParallel::default())
    }

    /// [`GrpoRun::new`] as one rank of a data-parallel group: every rank loads the run and
    /// samples its share of each step; rank 0 alone writes the output directory (which the
    /// ranks must share to resume).
    pub fn new_parallel(
        cfg: RunConfig,
        resume: bool,
        save_rollouts: bool,
        parallel: DataParallel,
    ) -> Result<Self> {
        if cfg.batch_size < parallel.world_size() {
            return Err(TrainError::Invalid(format!(
                "{}: batch_size = {} prompts cannot be shared by {} ranks; use at least one \
                 prompt per rank",
                cfg.source.display(),
                cfg.batch_size,
                parallel.world_size()
            )));
        }
        let device = open_device(&cfg)?;
        let rewards = reward_set(&cfg, &device)?;
        let environments = environments(&cfg)?;
        if cfg.data.train_files.is_empty() {
            return Err(TrainError::Invalid(format!(
                "{}: [data] train_files is required for a sampling run",
                cfg.source.display()
            )));
        }
        let model_dir = resolve_model(&cfg.model_path)?;
        let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir)?);
        let prompting = ImagePrompting::from_dir(&model_dir)?;
        let (prompts, dropped) = load_prompts(
            &cfg.data.train_files,
            &cfg.data,
            &tokenizer,
            prompting.as_ref(),
        )?;
        let val = match cfg.data.val_files.is_empty() {
            true => Vec::new(),
            false => {
                load_prompts(
                    &cfg.data.val_files,
                    &cfg.data,
                    &tokenizer,
                    prompting.as_ref(),
                )?
                .0
            }
        };
        for rows in [&prompts, &val] {
            check_reward_columns(&cfg, rows)?;
            check_environment_rows(&cfg, rows)?;
        }
        if dropped > 0 {
            note!(
                "data: dropped {dropped} prompts longer than max_prompt_length = {}",
                cfg.data.max_prompt_length
            );
        }
        let run_dir = match parallel.is_main() {
            true => Some(RunDir::open(&cfg.output_dir, resume)?),
            false => None,
        };
        let resumed = match &run_dir {
            Some(dir) => dir.resumed.clone(),
            None => resume.then(|| state::latest(&cfg.output_dir)).flatten(),
        };
        if let (Some(dir), true) = (&run_dir, resumed.is_none()) {
            dir.keep_config(&cfg.source_text)?;
        }
        agree_on_checkpoint(&parallel, &resumed, &cfg.output_dir)?;
        let (policy_dir, trainer_state) = match &resumed {
            Some((_, dir)) => (dir.clone(), Some(state::load_state(dir)?)),
            None => (model_dir.clone(), None),
        };
        let mut trainer = build_trainer(&cfg, &policy_dir, &device, trainer_state.is_some())?;
        trainer.join(parallel);
        if cfg.zero_stage == 2 {
            trainer.shard_optimizer()?;
        }
        let (step, cursor) = match &trainer_state {
            Some(s) => {
                state::load_optimizer(&policy_dir, &mut trainer, s)?;
                note!("resuming from {} (step {})", policy_dir.display(), s.step);
                (s.step, s.data)
            }
            None => (
                0,
                DataCursor {
                    epoch: 0,
                    position: 0,
                },
            ),
        };
        trainer.weight_version = WeightVersion(step);
        let eos = eos_token_ids(&model_dir, Some(&tokenizer))?;
        if cfg.one_step_async {
            if !trainer.parallel.is_single() || cfg.lora.is_some() {
                return Err(TrainError::Invalid(format!(
                    "{}: [trainer] async = \"one_step\" runs in one process without LoRA for now",
                    cfg.source.display()
                )));
            }
            // Every batch after the first is one version behind the trainer.
            trainer.max_staleness = trainer.max_staleness.max(1);
        }
        let mut snapshot = None;
        let engine: Box<dyn Engine> = match &cfg.rollout.vllm {
            None if cfg.one_step_async => {
                let (copy, model) = WeightSnapshot::load(
                    &policy_dir,
                    dtype(&cfg.dtype),
                    &device,
                    cfg.freeze_vision,
                    &trainer,
                )?;
                snapshot = Some(copy);
                Box::new(LocalEngine::new(
                    Arc::from(model),
                    Some(tokenizer.clone()),
                    eos,
                ))
            }
            None => Box::new(LocalEngine::new(
                Arc::from(trainer.policy.detached()),
                Some(tokenizer.clone()),
                eos,
            )),
            Some(spec) => {
                let remote = VllmEngine::connect(
                    spec.clone(),
                    &cfg.output_dir.join("sync-weights"),
                    Some(tokenizer.clone()),
                    eos,
                )?
                .with_image_token_id(
                    trainer
                        .policy
                        .image_prompting()
                        .map(|p| p.tokens.image_token_id),
                )
                .with_checkpoint_files(&model_dir);
                // The ranks share the servers; rank 0 alone moves their weights.
                match trainer.parallel.is_main() {
                    true => Box::new(with_nccl(remote, trainer.policy.device())?),
                    false => Box::new(remote.as_follower()),
                }
            }
        };
        let order = DataOrder::new(prompts.len(), cfg.seed, cfg.data.shuffle, cursor);
        let main = trainer.parallel.is_main();
        let metrics = match main {
            true => Some(MetricsLog::open(
                &cfg.output_dir.join("metrics.jsonl"),
                step,
            )?),
            false => None,
        };
        let gauges = Gauges::default();
        if let (Some(port), true) = (cfg.prometheus_port, main) {
            let addr = gauges.serve(&cfg.prometheus_host, port)?;
            note!("prometheus: serving http://{addr}/metrics");
        }
        let mut run = Self {
            cfg,
            model_dir,
            trainer,
            engine,
            tokenizer,
            rewards,
            environments,
            prompts,
            val,
            order,
            step,
            metrics,
            gauges,
            save_rollouts,
            _run_dir: run_dir,
            snapshot,
            prefetched: None,
        };
        run.sync_engine()?;
        Ok(run)
    }

    /// Puts the trainer's weights on the engine. Ranks sharing vLLM servers: rank 0 moves them,
    /// every rank waits until it has, then the others take the new version.
    fn sync_engine(&mut self) -> Result<()> {
        if let Some(snapshot) = &self.snapshot {
            snapshot.copy_from(&self.trainer)?;
        }
        let version = self.trainer.weight_version;
        let policy = self.trainer.policy.as_ref();
        let shared = self.cfg.rollout.vllm.is_some() && !self.trainer.parallel.is_single();
        if !shared {
            return Ok(self.engine.sync_weights(policy, version)?);
        }
        let main = self.trainer.parallel.is_main();
        if main {
            self.engine.sync_weights(policy, version)?;
        }
        self.trainer.parallel.any(false)?;
        if !main {
            self.engine.sync_weights(policy, version)?;
        }
        Ok(())
    }

    /// Runs until `max_steps` steps are done (counting steps before a resume), or until
    /// `interrupt` asks it to stop: then it finishes the step it is in, checkpoints it, and
    /// returns.
    pub fn run(&mut self, max_steps: u64, interrupt: &Interrupt) -> Result<RunSummary> {
        let progress = Progress::new(max_steps);
        let eval_every = self.cfg.eval_every;
        if self.step == 0 && !self.val.is_empty() && self.trainer.parallel.is_main() {
            let v = self.validate()?;
            note!(
                "validation before training: reward {:.3}",
                v["val/reward_mean"]
            );
            self.log(&v)?;
        }
        let mut interrupted = None;
        let mut saved = None;
        let main = self.trainer.parallel.is_main();
        while self.step < max_steps {
            // Every rank stops at the same step, so none waits for one that left.
            if self.trainer.parallel.any(interrupt.signal().is_some())? {
                interrupted = Some((interrupt.signal().unwrap_or(SIGTERM), saved));
                break;
            }
            let mut m = match self.cfg.one_step_async {
                true => self.step_one_ahead(self.step + 1 < max_steps)?,
                false => self.step_once()?,
            };
            if (eval_every > 0 && self.step.is_multiple_of(eval_every)) || self.step == max_steps {
                m.extend(self.validate()?);
            }
            self.log(&m)?;
            if main {
                progress.step(self.step, &m);
            }
            let periodic = self.cfg.save_every > 0 && self.step.is_multiple_of(self.cfg.save_every);
            let stopping = self.trainer.parallel.any(interrupt.signal().is_some())?;
            saved = None;
            if periodic || self.step == max_steps || stopping {
                saved = self.save()?;
            }
        }
        let series = match &self.metrics {
            Some(log) => log.series("reward_mean"),
            None => Vec::new(),
        };
        if !series.is_empty() {
            write_svg_chart(
                &self.cfg.output_dir.join("reward.svg"),
                "mean reward per step",
                &series,
            )?;
        }
        let values: Vec<f64> = series.iter().map(|(_, v)| *v).collect();
        let k = values.len().min(10);
        let avg = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
        Ok(RunSummary {
            steps: self.step,
            reward_start: avg(&values[..k]),
            reward_end: avg(&values[values.len() - k..]),
            output_dir: self.cfg.output_dir.clone(),
            interrupted,
        })
    }

    /// Rank 0 writes a checkpoint (every rank holds the same weights), with the whole optimizer
    /// state or, under ZeRO-2, every rank's part of it; `None` on the other ranks.
    fn save(&self) -> Result<Option<PathBuf>> {
        if !self.trainer.parallel.is_main() {
            // ZeRO-2: every rank adds its part of the optimizer state.
            if self.trainer.zero.is_some() {
                state::save_optimizer_shard(&self.trainer)?;
            }
            return Ok(None);
        }
        let s = TrainerState {
            step: self.step,
            optimizer_step: self.trainer.optimizer_steps(),
            data: self
                .prefetched
                .as_ref()
                .map_or(self.order.cursor, |p| p.cursor),
            seed: self.cfg.seed,
            optimizer_shards: None,
            critic_optimizer_step: None,
            kl_reward_coef: None,
        };
        state::save(
            &self.cfg.output_dir,
            &self.trainer,
            &s,
            Some(&self.model_dir),
        )
        .map(Some)
    }

    /// One step of the algorithm: rollout → rewards → advantages → policy update → weight
    /// sync. Returns the step's metrics.
    pub fn step_once(&mut self) -> Result<BTreeMap<String, f64>> {
        let mut time = PhaseTimes::default();
        let step_start = Instant::now();
        let (trajs, rewards, sampling) = self.sampling().sample(&mut time)?;
        let learned = learn(&mut self.trainer, &trajs, &mut time)?;
        self.step += 1;
        time.time("weight_sync", || self.sync_engine())?;
        if self.save_rollouts && self.trainer.parallel.is_main() {
            self.write_rollouts(&trajs)?;
        }
        let mut m = step_metrics(
            &rewards,
            &trajs,
            learned,
            time,
            step_start.elapsed().as_secs_f64(),
        );
        m.extend(self.engine.take_metrics());
        m.extend(sampling);
        Ok(m)
    }

    /// One step one ahead (`[trainer] async = "one_step"`): learns from the batch sampled
    /// during the previous step's update (the first step samples its own), while the engine,
    /// synced to the trainer's current weights, samples the next step's batch (`prefetch`).
    fn step_one_ahead(&mut self, prefetch: bool) -> Result<BTreeMap<String, f64>> {
        let step_start = Instant::now();
        let ahead = match self.prefetched.take() {
            Some(p) => p,
            None => {
                let cursor = self.order.cursor;
                let mut time = PhaseTimes::default();
                let (trajs, rewards, sampling) = self.sampling().sample(&mut time)?;
                Prefetched {
                    trajs,
                    rewards,
                    sampling,
                    time,
                    cursor,
                }
            }
        };
        let mut time = ahead.time;
        time.time("weight_sync", || self.sync_engine())?;
        let staleness = mean_staleness(&ahead.trajs, self.trainer.weight_version.0);
        let cursor = self.order.cursor;
        let max_positions = self.trainer.policy.max_positions();
        let one_process = DataParallel::default();
        let Self {
            cfg,
            trainer,
            engine,
            tokenizer,
            rewards,
            environments,
            prompts,
            val,
            order,
            step,
            ..
        } = self;
        let mut sampling = Sampling {
            cfg,
            engine: engine.as_mut(),
            tokenizer,
            rewards,
            environments: environments.as_deref(),
            prompts,
            val,
            order,
            parallel: &one_process,
            max_positions,
            step: *step + 1,
        };
        let (mut learn_time, mut next_time) = (PhaseTimes::default(), PhaseTimes::default());
        let trajs = &ahead.trajs;
        let (learned, next) = std::thread::scope(|s| {
            let update = s.spawn(|| learn(trainer, trajs, &mut learn_time));
            let next = prefetch.then(|| sampling.sample(&mut next_time));
            let learned = update
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (learned, next)
        });
        let learned = learned?;
        time.absorb(learn_time);
        if let Some(next) = next {
            let (trajs, rewards, sampling) = next?;
            self.prefetched = Some(Prefetched {
                trajs,
                rewards,
                sampling,
                time: next_time,
                cursor,
            });
        }
        self.step += 1;
        if self.save_rollouts {
            self.write_rollouts(&ahead.trajs)?;
        }
        let mut m = step_metrics(
            &ahead.rewards,
            &ahead.trajs,
            learned,
            time,
            step_start.elapsed().as_secs_f64(),
        );
        m.insert("async/staleness".into(), staleness);
        m.extend(self.engine.take_metrics());
        m.extend(ahead.sampling);
        Ok(m)
    }

    /// The sampling side of the run, borrowed: what sampling a step and validating need.
    fn sampling(&mut self) -> Sampling<'_> {
        Sampling {
            cfg: &self.cfg,
            engine: self.engine.as_mut(),
            tokenizer: &self.tokenizer,
            rewards: &self.rewards,
            environments: self.environments.as_deref(),
            prompts: &self.prompts,
            val: &self.val,
            order: &mut self.order,
            parallel: &self.trainer.parallel,
            max_positions: self.trainer.policy.max_positions(),
            step: self.step,
        }
    }

    /// Greedy decoding of every validation prompt, scored: `val/reward_mean`, per function
    /// `val/reward/<name>`, `val/response_length_mean`. Empty without `[data] val_files`, and
    /// on every rank but 0 (the others go on to the next step and wait for it there).
    pub fn validate(&mut self) -> Result<BTreeMap<String, f64>> {
        // One step ahead, the engine still holds the weights from before the last update.
        if self.cfg.one_step_async && !self.val.is_empty() {
            self.sync_engine()?;
        }
        self.sampling().validate()
    }

    fn log(&self, m: &BTreeMap<String, f64>) -> Result<()> {
        let Some(metrics) = &self.metrics else {
            return Ok(());
        };
        metrics.append(m, self.step)?;
        self.gauges.set(m);
        self.gauges
            .set(&BTreeMap::from([("step".to_string(), self.step as f64)]));
        Ok(())
    }

    fn write_rollouts(&self, trajs: &[Trajectory]) -> Result<()> {
        let dir = self.cfg.output_dir.join("rollouts");
        std::fs::create_dir_all(&dir)?;
        let text: String = trajs
            .iter()
            .map(|t| serde_json::to_string(t).unwrap_or_default() + "\n")
            .collect();
        let path = dir.join(format!("step-{}.jsonl", self.step));
        let tmp = dir.join(format!(".step-{}.jsonl.tmp", self.step));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }
}

/// The signal a rank reports when another rank's signal stopped the group.
const SIGTERM: i32 = 15;

/// Every rank resumes from the same checkpoint, or none does: ranks that see different
/// checkpoints (no shared output directory, or one written mid-start) would train apart.
fn agree_on_checkpoint(
    parallel: &DataParallel,
    resumed: &Option<(u64, PathBuf)>,
    output_dir: &Path,
) -> Result<()> {
    if parallel.is_single() {
        return Ok(());
    }
    let mine = resumed.as_ref().map_or(-1, |(step, _)| *step as i64);
    let seen = parallel.gather_bytes(&mine.to_le_bytes())?;
    for (rank, bytes) in seen.iter().enumerate() {
        let theirs = i64::from_le_bytes(bytes[..8].try_into().unwrap_or([0xff; 8]));
        if theirs != mine {
            let says = |s: i64| match s {
                -1 => "no checkpoint".to_string(),
                s => format!("checkpoint-{s}"),
            };
            return Err(TrainError::Invalid(format!(
                "{}: rank {} finds {} and rank {rank} finds {}: every rank must see the same \
                 output directory (a shared filesystem) to resume",
                output_dir.display(),
                parallel.rank(),
                says(mine),
                says(theirs)
            )));
        }
    }
    Ok(())
}

/// What the reward functions see of each completion of prompt `rows[i]` (`completions[i]`),
/// prompt-major: the rendered prompt, the response's text, the row, the response's length.
pub(crate) fn reward_inputs(
    rows: &[&PromptRow],
    completions: &[Vec<Completion>],
    tokenizer: &Tokenizer,
) -> Result<Vec<RewardInput>> {
    let mut inputs = Vec::new();
    for (p, samples) in rows.iter().zip(completions) {
        for c in samples {
            let response = match &c.text {
                Some(t) => t.clone(),
                None => tokenizer.decode(&c.response_ids, true)?,
            };
            inputs.push(RewardInput {
                prompt: p.prompt_text.clone(),
                response,
                row: p.row.clone(),
                response_tokens: c.response_ids.len(),
            });
        }
    }
    Ok(inputs)
}

/// The engine's view of prompts: their token ids, and their images with where they came from.
pub(crate) fn engine_prompts(asked: &[&PromptRow]) -> (Vec<Vec<u32>>, Vec<Vec<PromptImage>>) {
    asked
        .iter()
        .map(|p| {
            let images = p
                .images
                .iter()
                .zip(&p.image_refs)
                .map(|(pixels, source)| PromptImage {
                    pixels: pixels.clone(),
                    source: Some(source.clone()),
                })
                .collect();
            (p.prompt_ids.clone(), images)
        })
        .unzip()
}

/// Advantages of every response token from the outcome rewards, grouped by uid
/// (`docs/rl-algorithms.md`, advantage estimators): the estimators that need no critic values
/// and no per-token reward terms.
pub fn advantages(trajs: &[Trajectory], cfg: &AdvantageConfig) -> Result<Vec<Vec<f64>>> {
    Ok(estimate(trajs, cfg, None, None)?.advantages)
}

/// The estimator on `trajs`, with the per-token reward terms and the critic's values when the
/// run has them.
fn estimate(
    trajs: &[Trajectory],
    cfg: &AdvantageConfig,
    token_penalties: Option<&[Vec<f64>]>,
    values: Option<&[Vec<f64>]>,
) -> Result<TokenAdvantages> {
    let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
    let uids: Vec<&str> = trajs.iter().map(|t| t.uid.as_str()).collect();
    let lens: Vec<usize> = trajs.iter().map(|t| t.response_ids.len()).collect();
    let inputs = AdvantageInputs {
        rewards: &rewards,
        uids: &uids,
        token_counts: &lens,
        token_penalties,
        values,
    };
    estimate_advantages(&inputs, cfg).map_err(|e| TrainError::Invalid(e.to_string()))
}

/// What learning from one batch computed, phase by phase.
#[derive(Debug, Clone)]
pub struct Learned {
    /// Per trajectory trained on (all of them, unless overlong filtering dropped some), one per
    /// response token.
    pub advantages: Vec<Vec<f64>>,
    pub old: OldPolicy,
    pub reference: Option<Vec<Vec<f32>>>,
    pub report: UpdateReport,
}

/// Rows `keep` says of `rows`.
fn kept<T: Clone>(rows: &[T], keep: &[bool]) -> Vec<T> {
    rows.iter()
        .zip(keep)
        .filter(|(_, &k)| k)
        .map(|(r, _)| r.clone())
        .collect()
}

/// Learning from one batch of rewarded trajectories, each a timed phase: the critic's values
/// (PPO) → the reward's KL penalty (which needs `logp_old` and the reference first) →
/// advantages → `logp_old` → reference log-probs → the policy update → the critic update.
/// The sampling loop and `--rollouts` share it; it refuses trajectories from weights the
/// trainer no longer has.
pub fn learn(
    trainer: &mut PolicyTrainer,
    trajs: &[Trajectory],
    time: &mut PhaseTimes,
) -> Result<Learned> {
    trainer.check_weight_versions(trajs)?;
    check_loss_masks(trajs, &trainer.algorithm)?;
    let mut metrics = BTreeMap::new();
    // The KL penalty in the reward is part of the advantages' input: the log-probs come first.
    let early = match trainer.algorithm.kl_in_reward.is_some() {
        true => Some(policy_logprobs(trainer, trajs, time)?),
        false => None,
    };
    let values = match &trainer.critic {
        Some(c) => Some(time.time("values", || c.values(trajs))?),
        None => None,
    };
    let penalty = match (&mut trainer.algorithm.kl_in_reward, &early) {
        (Some(k), Some((old, Some(reference)))) => Some(k.apply(&old.logprobs, reference)?),
        (Some(_), _) => {
            return Err(TrainError::Invalid(
                "use_kl_in_reward needs a reference model (kl_coef > 0)".into(),
            ))
        }
        _ => None,
    };
    if let Some(p) = &penalty {
        metrics.insert("reward_kl_penalty".to_string(), p.kl);
        metrics.insert("reward_kl_penalty_coeff".to_string(), p.coef);
    }
    let estimated = time.time("advantage", || {
        estimate(
            trajs,
            &trainer.algorithm.advantage,
            penalty.as_ref().map(|p| &p.penalties[..]),
            values.as_deref(),
        )
    })?;
    // DAPO overlong filtering: the truncated responses counted in their groups' advantages
    // but leave the update.
    let keep: Vec<bool> = trajs
        .iter()
        .map(|t| !(trainer.algorithm.overlong_filter && truncated(t)))
        .collect();
    let trained = kept(trajs, &keep);
    let advantages = kept(&estimated.advantages, &keep);
    let dropped = (trajs.len() - trained.len()) as f64 / trajs.len().max(1) as f64;
    if trainer.algorithm.overlong_filter {
        metrics.insert("overlong_filtered".into(), dropped);
    }
    if trained.is_empty() {
        let report = UpdateReport {
            metrics,
            ..Default::default()
        };
        return Ok(Learned {
            advantages,
            old: OldPolicy::default(),
            reference: None,
            report,
        });
    }
    let (mut old, reference) = match early {
        Some((old, reference)) => (
            OldPolicy {
                logprobs: kept(&old.logprobs, &keep),
                entropy: old.entropy.map(|e| kept(&e, &keep)),
                ..old
            },
            reference.map(|r| kept(&r, &keep)),
        ),
        None => policy_logprobs(trainer, &trained, time)?,
    };
    if let Some(cfg) = &trainer.algorithm.rollout_correction {
        old.correction = Some(correct_rollouts(
            cfg,
            &trained,
            &old,
            trainer.algorithm.old_logprobs,
        )?);
    }
    old.keep = loss_keep(
        &trained,
        old.correction.as_ref().and_then(|c| c.keep.as_ref()),
    );
    // With the KL in the reward there is no KL loss term.
    let loss_reference = match penalty {
        Some(_) => None,
        None => reference.as_deref(),
    };
    let warming_up = trainer
        .critic
        .as_ref()
        .is_some_and(|c| trainer.weight_version.0 < c.config.warmup_steps);
    let mut report = match warming_up {
        // The critic's warmup: the policy keeps its weights, the step still counts.
        true => {
            trainer.weight_version = WeightVersion(trainer.weight_version.0 + 1);
            UpdateReport::default()
        }
        false => time.time("update", || {
            trainer.update(&trained, &advantages, &old, loss_reference)
        })?,
    };
    if let (Some(critic), Some(values)) = (&mut trainer.critic, &values) {
        let values = kept(values, &keep);
        let returns = kept(&estimated.returns, &keep);
        let critic_metrics = time.time("critic_update", || {
            critic.update(&trained, &values, &returns)
        })?;
        report.metrics.extend(critic_metrics);
        if let Some(ev) = explained_variance(&returns, &values) {
            report.metrics.insert("critic/vf_explained_var".into(), ev);
        }
        let n: usize = returns.iter().map(Vec::len).sum();
        let mean = |rows: &[Vec<f64>]| rows.iter().flatten().sum::<f64>() / n.max(1) as f64;
        report
            .metrics
            .insert("critic/returns_mean".into(), mean(&returns));
        report
            .metrics
            .insert("critic/values_mean".into(), mean(&values));
    }
    report.metrics.extend(metrics);
    if let Some(c) = &old.correction {
        report.metrics.extend(c.metrics.clone());
    }
    Ok(Learned {
        advantages,
        old,
        reference,
        report,
    })
}

/// Refuses loss masks (multi-turn episodes) that do not fit their responses, or an algorithm
/// that cannot take them yet: the token-level estimators would discount and whiten through the
/// environment's tokens, and rollout correction would compare log-probs the engine never made.
fn check_loss_masks(trajs: &[Trajectory], algo: &crate::update::AlgorithmConfig) -> Result<()> {
    let Some(first) = trajs.iter().position(|t| !t.loss_mask.is_empty()) else {
        return Ok(());
    };
    if let Some((i, t)) = trajs
        .iter()
        .enumerate()
        .find(|(_, t)| !t.loss_mask.is_empty() && t.loss_mask.len() != t.response_ids.len())
    {
        return Err(TrainError::Invalid(format!(
            "trajectory {i} (uid {}): loss_mask has {} entries for {} response tokens",
            t.uid,
            t.loss_mask.len(),
            t.response_ids.len()
        )));
    }
    let token_level = matches!(
        algo.advantage.estimator,
        AdvantageEstimator::ReinforcePlusPlus | AdvantageEstimator::Gae
    );
    let refused = match (token_level, &algo.rollout_correction) {
        (true, _) => "the token-level advantage estimators (reinforce_plus_plus, gae)",
        (false, Some(_)) => "rollout correction (rollout_is / rollout_rs)",
        (false, None) => return Ok(()),
    };
    Err(TrainError::Invalid(format!(
        "trajectory {first} (uid {}) is a multi-turn episode (it has a loss_mask): {refused} \
         do not take environment tokens yet; use a group estimator (grpo, rloo, ...)",
        trajs[first].uid
    )))
}

/// The tokens that enter the loss: each trajectory's loss mask (environment tokens out), and
/// of those what rollout correction keeps. `None` when every token enters.
fn loss_keep(trajs: &[Trajectory], kept: Option<&Vec<Vec<bool>>>) -> Option<Vec<Vec<bool>>> {
    if trajs.iter().all(|t| t.loss_mask.is_empty()) {
        return kept.cloned();
    }
    Some(
        trajs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                (0..t.response_ids.len())
                    .map(|k| {
                        t.loss_mask.get(k).copied().unwrap_or(true) && kept.is_none_or(|r| r[i][k])
                    })
                    .collect()
            })
            .collect(),
    )
}

/// `logp_old` and the reference log-probs of `trajs`: computed here in a single process, shared
/// out by the ranks of a data-parallel group.
fn policy_logprobs(
    trainer: &PolicyTrainer,
    trajs: &[Trajectory],
    time: &mut PhaseTimes,
) -> Result<(OldPolicy, Option<Vec<Vec<f32>>>)> {
    match trainer.parallel.is_single() {
        true => Ok((
            time.time("old_logprobs", || trainer.old_logprobs(trajs))?,
            time.time("ref", || trainer.ref_logprobs(trajs))?,
        )),
        false => shared_logprobs(trainer, trajs, time),
    }
}

/// Rollout correction of `trained` from the trainer's recomputed `logp_old` and the engine's
/// log-probs (`oxrl_algo::rollout_corr`). Both must be there: with `old_logprobs = "rollout"` the
/// two are the same numbers and there is nothing to correct.
fn correct_rollouts(
    cfg: &oxrl_algo::rollout_corr::RolloutCorrectionConfig,
    trained: &[Trajectory],
    old: &OldPolicy,
    mode: OldLogprobs,
) -> Result<oxrl_algo::rollout_corr::Correction> {
    if mode != OldLogprobs::Recompute {
        return Err(TrainError::Invalid(
            "rollout correction (rollout_is / rollout_rs) compares the engine's log-probs with the \
             trainer's: it needs [algorithm] old_logprobs = \"recompute\""
                .into(),
        ));
    }
    if let Some((i, t)) = trained
        .iter()
        .enumerate()
        .find(|(_, t)| t.rollout_logprobs.len() != t.response_ids.len())
    {
        return Err(TrainError::Invalid(format!(
            "rollout correction needs the engine's log-prob of every response token, and \
             trajectory {i} (uid {}) has {} for {} tokens",
            t.uid,
            t.rollout_logprobs.len(),
            t.response_ids.len()
        )));
    }
    let rollout: Vec<Vec<f32>> = trained.iter().map(|t| t.rollout_logprobs.clone()).collect();
    Ok(oxrl_algo::rollout_corr::rollout_correction(
        &old.logprobs,
        &rollout,
        cfg.is.as_ref(),
        &cfg.rules,
    ))
}

/// `logp_old` and the reference log-probs in a data-parallel group: each rank computes them
/// for the trajectories it updates on, and the ranks exchange them, so every rank holds all
/// (as one process computing them would).
fn shared_logprobs(
    trainer: &PolicyTrainer,
    trained: &[Trajectory],
    time: &mut PhaseTimes,
) -> Result<(OldPolicy, Option<Vec<Vec<f32>>>)> {
    let p = &trainer.parallel;
    let n = trained.len();
    let mini = trainer.mini_batch_len(n);
    let mine: Vec<Trajectory> = p
        .update_shard(n, mini)
        .iter()
        .map(|&i| trained[i].clone())
        .collect();
    let recompute = trainer.algorithm.old_logprobs == OldLogprobs::Recompute;
    let (old, reference) = match mine.is_empty() {
        // More ranks than trajectories in a mini-batch: this rank sits it out.
        true => (
            OldPolicy {
                entropy: recompute.then(Vec::new),
                ..Default::default()
            },
            (trainer.algorithm.kl_coef > 0.0).then(Vec::new),
        ),
        false => (
            time.time("old_logprobs", || trainer.old_logprobs(&mine))?,
            time.time("ref", || trainer.ref_logprobs(&mine))?,
        ),
    };
    let logprobs = p.gather_rows(old.logprobs, n, mini)?;
    let entropy = old.entropy.map(|e| p.gather_rows(e, n, mini)).transpose()?;
    let reference = reference.map(|r| p.gather_rows(r, n, mini)).transpose()?;
    let old = OldPolicy {
        rollout_logprob_diff: recompute
            .then(|| rollout_logprob_diff(trained, &logprobs))
            .flatten(),
        logprobs,
        entropy,
        correction: None,
        keep: None,
    };
    Ok((old, reference))
}

/// How many groups (uids) `trajs` hold.
pub(crate) fn distinct_groups(trajs: &[Trajectory]) -> usize {
    let uids: std::collections::HashSet<&str> = trajs.iter().map(|t| t.uid.as_str()).collect();
    uids.len()
}

/// Whether sampling stopped the response at `max_new_tokens`.
fn truncated(t: &Trajectory) -> bool {
    t.finish_reason.as_deref() == Some("length")
}

/// What learning from `trajs` measured: the update's metrics, the rewards' mean and spread,
/// the share of groups whose rewards all tie (no signal), and the engine-vs-trainer log-prob
/// gap.
fn learned_metrics(learned: Learned, trajs: &[Trajectory]) -> BTreeMap<String, f64> {
    let mut m = learned.report.metrics;
    if let Some(diff) = learned.old.rollout_logprob_diff {
        m.insert("rollout_logprob_diff".into(), diff);
    }
    let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
    let uids: Vec<&str> = trajs.iter().map(|t| t.uid.as_str()).collect();
    m.insert(
        "frac_reward_zero_std".into(),
        frac_zero_std_groups(&rewards, &uids),
    );
    let (mean, std) = mean_std(&rewards);
    m.insert("reward_mean".into(), mean);
    m.insert("reward_std".into(), std);
    m
}

/// A step's metrics: the update's, the rewards' (total, per function, failures, latency), the
/// responses' lengths and truncation, the phase times and throughput.
fn step_metrics(
    rewards: &RewardOutcome,
    trajs: &[Trajectory],
    learned: Learned,
    time: PhaseTimes,
    step_seconds: f64,
) -> BTreeMap<String, f64> {
    let mut m = learned_metrics(learned, trajs);
    for (name, scores) in &rewards.per_function {
        m.insert(format!("reward/{name}"), mean_std(scores).0);
    }
    for (name, failed) in &rewards.failures {
        m.insert(format!("reward_failures/{name}"), *failed as f64);
    }
    for (name, secs) in &rewards.latency {
        m.insert(format!("reward_latency_s/{name}"), *secs);
    }
    let lens: Vec<f64> = trajs.iter().map(|t| t.response_ids.len() as f64).collect();
    m.insert("response_length_mean".into(), mean_std(&lens).0);
    m.insert(
        "response_length_max".into(),
        lens.iter().copied().fold(0.0, f64::max),
    );
    let hit_max = trajs.iter().filter(|t| truncated(t)).count();
    m.insert(
        "clip_ratio".into(),
        hit_max as f64 / trajs.len().max(1) as f64,
    );
    let tokens: usize = trajs
        .iter()
        .map(|t| t.prompt_ids.len() + t.response_ids.len())
        .sum();
    m.insert("tokens_per_s".into(), tokens as f64 / step_seconds);
    let generated: f64 = lens.iter().sum();
    m.insert(
        "rollout/tokens_per_s".into(),
        generated / time.seconds("rollout").max(1e-9),
    );
    m.extend(time.into_metrics());
    m.insert("time/step".into(), step_seconds);
    m
}

/// `train --rollouts`: one update on recorded trajectories (the whole file is one batch), then a
/// checkpoint and one metrics line in `output_dir`.
pub fn replay(cfg: &RunConfig, rollouts: &Path) -> Result<BTreeMap<String, f64>> {
    replay_parallel(cfg, rollouts, DataParallel::default())
}

/// [`replay`] as one rank of a data-parallel group: every rank reads the whole file and
/// updates on its share; rank 0 writes the checkpoint and the metrics.
pub fn replay_parallel(
    cfg: &RunConfig,
    rollouts: &Path,
    parallel: DataParallel,
) -> Result<BTreeMap<String, f64>> {
    let mut trajs = crate::trajectory::read_trajectories(rollouts)?;
    // A file's weight versions count the updates of the run that wrote it, not this trainer's:
    // training on it is off-policy by the user's choice.
    for t in &mut trajs {
        t.weight_version = None;
    }
    let model_dir = resolve_model(&cfg.model_path)?;
    let prompting = ImagePrompting::from_dir(&model_dir)?;
    crate::trajectory::attach_images(&mut trajs, rollouts, prompting.as_ref())?;
    let run_dir = match parallel.is_main() {
        true => Some(RunDir::open(&cfg.output_dir, false)?),
        false => None,
    };
    let mut trainer = build_trainer(cfg, &model_dir, &open_device(cfg)?, false)?;
    trainer.join(parallel);
    if cfg.zero_stage == 2 {
        trainer.shard_optimizer()?;
    }
    let mut time = PhaseTimes::default();
    let learned = learn(&mut trainer, &trajs, &mut time)?;
    let mut m = learned_metrics(learned, &trajs);
    m.extend(time.into_metrics());
    if run_dir.is_none() {
        if trainer.zero.is_some() {
            state::save_optimizer_shard(&trainer)?;
        }
        return Ok(m);
    }
    MetricsLog::open(&cfg.output_dir.join("metrics.jsonl"), 0)?.append(&m, 1)?;
    let s = TrainerState {
        step: 1,
        optimizer_step: trainer.optimizer_steps(),
        data: DataCursor {
            epoch: 0,
            position: 0,
        },
        seed: cfg.seed,
        optimizer_shards: None,
        critic_optimizer_step: None,
        kl_reward_coef: None,
    };
    state::save(&cfg.output_dir, &trainer, &s, Some(&model_dir))?;
    Ok(m)
}

/// `sync = "nccl"`: the CUDA build's broadcaster, on the policy's GPU.
#[cfg(feature = "cuda")]
fn with_nccl(
    engine: VllmEngine,
    device: &candle_core::Device,
) -> std::result::Result<VllmEngine, oxrl_rollout::EngineError> {
    if engine.sync() != oxrl_rollout::WeightSync::Nccl {
        return Ok(engine);
    }
    let gpu = oxrl_rollout::nccl::NcclBroadcaster::new(device)?;
    Ok(engine.with_broadcaster(Box::new(gpu)))
}

/// A CPU build never gets here with `sync = "nccl"`: the config refuses it.
#[cfg(not(feature = "cuda"))]
fn with_nccl(
    engine: VllmEngine,
    _device: &candle_core::Device,
) -> std::result::Result<VllmEngine, oxrl_rollout::EngineError> {
    Ok(engine)
}
