//! The GRPO loop: prompts → rollout engine → trajectories → rewards → advantages → policy update
//! → the engine samples from the new weights (it shares the trainer's weight storage) → next
//! batch. Checkpoints and `--resume`, metrics, the Prometheus endpoint and the reward chart hang
//! off the loop here.

use crate::config::RewardKind;
use crate::config::RunConfig;
use crate::data::{load_prompts, DataCursor, DataOrder, PromptRow};
use crate::observe::{write_svg_chart, Gauges, MetricsLog, Progress};
use crate::state::{self, TrainerState};
use crate::trajectory::Trajectory;
use crate::update::{PolicyTrainer, Result, TrainError};
use candle_core::{DType, Device};
use oxrl_models::{eos_token_ids, hub::resolve_model, ImagePrompting, Qwen3, Tokenizer};
use oxrl_reward::{
    build_rule, CodeReward, HttpReward, RewardFn, RewardInput, RewardModel, RewardOutcome,
    RewardSet, WeightedReward,
};
use oxrl_rollout::{Completion, Engine, LocalEngine, SamplerConfig, SamplingParams};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn dtype(name: &str) -> DType {
    match name {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    }
}

/// Builds the policy trainer of a run: the policy (from `policy_dir`), the reference model when
/// `kl_coef > 0` (default: the policy's initial weights), AdamW.
pub fn build_trainer(cfg: &RunConfig, policy_dir: &Path) -> Result<PolicyTrainer> {
    let dt = dtype(&cfg.dtype);
    let mut policy = Qwen3::load(policy_dir, dt, &Device::Cpu)?;
    if let Some(v) = &mut policy.vision {
        v.frozen = cfg.freeze_vision;
    }
    let reference = match cfg.algorithm.kl_coef > 0.0 {
        true => {
            let r = cfg.reference_path.as_deref().unwrap_or(&cfg.model_path);
            Some(Qwen3::load(&resolve_model(r)?, dt, &Device::Cpu)?)
        }
        false => None,
    };
    PolicyTrainer::new(policy, reference, cfg.algorithm.clone(), cfg.update.clone())
}

/// The run's reward functions, built before the policy loads: a code reward finds the sandbox's
/// isolation and its interpreter here and a reward model is loaded, so a machine that cannot
/// run them stops the run at once.
fn reward_set(cfg: &RunConfig) -> Result<RewardSet> {
    if cfg.reward.functions.is_empty() {
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
                Arc::new(RewardModel::load(&dir, spec.clone()).map_err(|e| invalid(e.to_string()))?)
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

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: u64,
    /// Mean reward of the first and of the last (up to) 10 steps.
    pub reward_start: f64,
    pub reward_end: f64,
    pub output_dir: PathBuf,
}

pub struct GrpoRun {
    cfg: RunConfig,
    model_dir: PathBuf,
    trainer: PolicyTrainer,
    engine: LocalEngine,
    tokenizer: Arc<Tokenizer>,
    rewards: RewardSet,
    prompts: Vec<PromptRow>,
    /// Validation prompts (`[data] val_files`), decoded greedily.
    val: Vec<PromptRow>,
    order: DataOrder,
    step: u64,
    metrics: MetricsLog,
    gauges: Gauges,
    save_rollouts: bool,
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
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
        let rewards = reward_set(&cfg)?;
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
        if dropped > 0 {
            eprintln!(
                "data: dropped {dropped} prompts longer than max_prompt_length = {}",
                cfg.data.max_prompt_length
            );
        }
        std::fs::create_dir_all(&cfg.output_dir)?;
        let resumed = match resume {
            true => state::latest(&cfg.output_dir),
            false => None,
        };
        let (policy_dir, trainer_state) = match &resumed {
            Some((_, dir)) => (dir.clone(), Some(state::load_state(dir)?)),
            None => (model_dir.clone(), None),
        };
        let mut trainer = build_trainer(&cfg, &policy_dir)?;
        let (step, cursor) = match &trainer_state {
            Some(s) => {
                state::load_optimizer(&policy_dir, &mut trainer, s.optimizer_step)?;
                eprintln!("resuming from {} (step {})", policy_dir.display(), s.step);
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
        let eos = eos_token_ids(&model_dir, Some(&tokenizer))?;
        let engine = LocalEngine::new(
            Arc::new(trainer.policy.detached()),
            Some(tokenizer.clone()),
            eos,
        );
        let order = DataOrder::new(prompts.len(), cfg.seed, cfg.data.shuffle, cursor);
        let metrics = MetricsLog::open(&cfg.output_dir.join("metrics.jsonl"), step)?;
        let gauges = Gauges::default();
        if let Some(port) = cfg.prometheus_port {
            let addr = gauges.serve(port)?;
            eprintln!("prometheus: serving http://{addr}/metrics");
        }
        Ok(Self {
            cfg,
            model_dir,
            trainer,
            engine,
            tokenizer,
            rewards,
            prompts,
            val,
            order,
            step,
            metrics,
            gauges,
            save_rollouts,
        })
    }

    /// Runs until `max_steps` steps are done (counting steps before a resume).
    pub fn run(&mut self, max_steps: u64) -> Result<RunSummary> {
        let progress = Progress::new(max_steps);
        let eval_every = self.cfg.eval_every;
        if self.step == 0 && !self.val.is_empty() {
            let v = self.validate()?;
            eprintln!(
                "validation before training: reward {:.3}",
                v["val/reward_mean"]
            );
            self.log(&v)?;
        }
        while self.step < max_steps {
            let mut m = self.step_once()?;
            if (eval_every > 0 && self.step.is_multiple_of(eval_every)) || self.step == max_steps {
                m.extend(self.validate()?);
            }
            self.log(&m)?;
            progress.step(self.step, &m);
            let periodic = self.cfg.save_every > 0 && self.step.is_multiple_of(self.cfg.save_every);
            if periodic || self.step == max_steps {
                self.save()?;
            }
        }
        let series = self.metrics.series("reward_mean");
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
        })
    }

    fn save(&self) -> Result<PathBuf> {
        let s = TrainerState {
            step: self.step,
            optimizer_step: self.trainer.optimizer.step,
            data: self.order.cursor,
            seed: self.cfg.seed,
        };
        state::save(
            &self.cfg.output_dir,
            &self.trainer,
            &s,
            Some(&self.model_dir),
        )
    }

    /// One step: sample, score, update; returns the step's metrics (also logged).
    pub fn step_once(&mut self) -> Result<BTreeMap<String, f64>> {
        let step_start = Instant::now();
        let cfg = &self.cfg;
        let rows: Vec<usize> = self.order.next_batch(cfg.batch_size);
        let prompt_ids: Vec<Vec<u32>> = rows
            .iter()
            .map(|&i| self.prompts[i].prompt_ids.clone())
            .collect();
        let r = &cfg.rollout;
        let params = SamplingParams {
            n: r.n_samples_per_prompt,
            max_new_tokens: r.max_new_tokens,
            sampler: SamplerConfig {
                temperature: r.temperature,
                top_k: r.top_k,
                top_p: r.top_p,
                min_p: r.min_p,
            },
            seed: cfg
                .seed
                .wrapping_add(self.step.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            stop_token_ids: Vec::new(),
            stop_strings: r.stop.clone(),
            ignore_eos: false,
        };
        let images: Vec<_> = rows
            .iter()
            .map(|&i| self.prompts[i].images.clone())
            .collect();
        let t = Instant::now();
        let completions = self
            .engine
            .generate_with_images(&prompt_ids, &images, &params)?;
        let time_rollout = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let asked: Vec<&PromptRow> = rows.iter().map(|&i| &self.prompts[i]).collect();
        let outcome = self.score(&asked, &completions)?;
        let time_reward = t.elapsed().as_secs_f64();

        let mut trajs = Vec::with_capacity(outcome.total.len());
        let mut k = 0;
        for (slot, (&row, samples)) in rows.iter().zip(&completions).enumerate() {
            for c in samples {
                trajs.push(Trajectory {
                    uid: format!("{}#{slot}", self.prompts[row].uid),
                    prompt_ids: self.prompts[row].prompt_ids.clone(),
                    response_ids: c.response_ids.clone(),
                    reward: outcome.total[k],
                    rollout_logprobs: c.logprobs.clone(),
                    finish_reason: Some(c.finish_reason.as_str().to_string()),
                    images: self.prompts[row].image_refs.clone(),
                    pixels: self.prompts[row].images.clone(),
                });
                k += 1;
            }
        }
        let report = self.trainer.step(&trajs)?;
        self.step += 1;
        if self.save_rollouts {
            self.write_rollouts(&trajs)?;
        }

        let mut m = report.metrics;
        let (reward_mean, reward_std) = mean_std(&outcome.total);
        m.insert("reward_mean".into(), reward_mean);
        m.insert("reward_std".into(), reward_std);
        for (name, scores) in &outcome.per_function {
            m.insert(format!("reward/{name}"), mean_std(scores).0);
        }
        for (name, failed) in &outcome.failures {
            m.insert(format!("reward_failures/{name}"), *failed as f64);
        }
        for (name, secs) in &outcome.latency {
            m.insert(format!("reward_latency_s/{name}"), *secs);
        }
        let lens: Vec<f64> = trajs.iter().map(|t| t.response_ids.len() as f64).collect();
        m.insert("response_length_mean".into(), mean_std(&lens).0);
        m.insert(
            "response_length_max".into(),
            lens.iter().copied().fold(0.0, f64::max),
        );
        let hit_max = trajs
            .iter()
            .filter(|t| t.finish_reason.as_deref() == Some("length"))
            .count();
        m.insert(
            "clip_ratio".into(),
            hit_max as f64 / trajs.len().max(1) as f64,
        );
        let time_step = step_start.elapsed().as_secs_f64();
        m.insert("time/rollout".into(), time_rollout);
        m.insert("time/reward".into(), time_reward);
        m.insert("time/step".into(), time_step);
        let tokens: usize = trajs
            .iter()
            .map(|t| t.prompt_ids.len() + t.response_ids.len())
            .sum();
        m.insert("tokens_per_s".into(), tokens as f64 / time_step);
        let generated: f64 = lens.iter().sum();
        m.insert(
            "rollout/tokens_per_s".into(),
            generated / time_rollout.max(1e-9),
        );
        Ok(m)
    }

    /// Rewards of every completion of `asked[i]` (`completions[i]`), prompt-major.
    fn score(
        &self,
        asked: &[&PromptRow],
        completions: &[Vec<Completion>],
    ) -> Result<RewardOutcome> {
        let mut inputs = Vec::new();
        for (p, samples) in asked.iter().zip(completions) {
            for c in samples {
                let response = match &c.text {
                    Some(t) => t.clone(),
                    None => self.tokenizer.decode(&c.response_ids, true)?,
                };
                inputs.push(RewardInput {
                    prompt: p.prompt_text.clone(),
                    response,
                    row: p.row.clone(),
                    response_tokens: c.response_ids.len(),
                });
            }
        }
        Ok(self.rewards.score(&inputs))
    }

    /// Greedy decoding of every validation prompt, scored: `val/reward_mean`, per function
    /// `val/reward/<name>`, `val/response_length_mean`. Empty without `[data] val_files`.
    pub fn validate(&mut self) -> Result<BTreeMap<String, f64>> {
        let mut m = BTreeMap::new();
        if self.val.is_empty() {
            return Ok(m);
        }
        let r = &self.cfg.rollout;
        let params = SamplingParams {
            n: 1,
            max_new_tokens: r.max_new_tokens,
            sampler: SamplerConfig {
                temperature: 0.0,
                ..Default::default()
            },
            stop_strings: r.stop.clone(),
            ..Default::default()
        };
        let prompt_ids: Vec<Vec<u32>> = self.val.iter().map(|p| p.prompt_ids.clone()).collect();
        let images: Vec<_> = self.val.iter().map(|p| p.images.clone()).collect();
        let completions = self
            .engine
            .generate_with_images(&prompt_ids, &images, &params)?;
        let asked: Vec<&PromptRow> = self.val.iter().collect();
        let outcome = self.score(&asked, &completions)?;
        m.insert("val/reward_mean".into(), mean_std(&outcome.total).0);
        for (name, scores) in &outcome.per_function {
            m.insert(format!("val/reward/{name}"), mean_std(scores).0);
        }
        let lens: Vec<f64> = completions
            .iter()
            .flatten()
            .map(|c| c.response_ids.len() as f64)
            .collect();
        m.insert("val/response_length_mean".into(), mean_std(&lens).0);
        Ok(m)
    }

    fn log(&self, m: &BTreeMap<String, f64>) -> Result<()> {
        self.metrics.append(m, self.step)?;
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

/// `train --rollouts`: one update on recorded trajectories (the whole file is one batch), then a
/// checkpoint and one metrics line in `output_dir`.
pub fn replay(cfg: &RunConfig, rollouts: &Path) -> Result<BTreeMap<String, f64>> {
    let mut trajs = crate::trajectory::read_trajectories(rollouts)?;
    let model_dir = resolve_model(&cfg.model_path)?;
    let prompting = ImagePrompting::from_dir(&model_dir)?;
    crate::trajectory::attach_images(&mut trajs, rollouts, prompting.as_ref())?;
    let mut trainer = build_trainer(cfg, &model_dir)?;
    let mut m = trainer.step(&trajs)?.metrics;
    let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
    let (mean, std) = mean_std(&rewards);
    m.insert("reward_mean".into(), mean);
    m.insert("reward_std".into(), std);
    std::fs::create_dir_all(&cfg.output_dir)?;
    MetricsLog::open(&cfg.output_dir.join("metrics.jsonl"), 0)?.append(&m, 1)?;
    let s = TrainerState {
        step: 1,
        optimizer_step: trainer.optimizer.step,
        data: DataCursor {
            epoch: 0,
            position: 0,
        },
        seed: cfg.seed,
    };
    state::save(&cfg.output_dir, &trainer, &s, Some(&model_dir))?;
    Ok(m)
}
