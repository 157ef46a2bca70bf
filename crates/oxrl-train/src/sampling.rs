//! Sampling a step: prompts from the data order → the engine (one generation per trajectory, or
//! multi-turn episodes with the run's environment) → rewards → trajectories, with DAPO's
//! dynamic sampling and soft overlong punishment, and greedy validation. It borrows what it
//! needs from the run ([`Sampling`]), so a step's sampling can run beside the trainer's update.

use crate::config::RunConfig;
use crate::data::{DataOrder, PromptRow};
use crate::episodes::{run_episodes, EpisodeLimits};
use crate::grpo::{distinct_groups, engine_prompts, mean_std, reward_inputs};
use crate::observe::PhaseTimes;
use crate::parallel::DataParallel;
use crate::trajectory::Trajectory;
use crate::update::{Result, TrainError};
use oxrl_algo::dapo::{informative_groups, soft_overlong_penalty};
use oxrl_env::EnvironmentFactory;
use oxrl_models::Tokenizer;
use oxrl_reward::{RewardOutcome, RewardSet};
use oxrl_rollout::{Completion, Engine, SamplerConfig, SamplingParams};
use std::collections::BTreeMap;

/// The sampling side of a run, borrowed from it.
pub(crate) struct Sampling<'a> {
    pub cfg: &'a RunConfig,
    pub engine: &'a mut dyn Engine,
    pub tokenizer: &'a Tokenizer,
    pub rewards: &'a RewardSet,
    pub environments: Option<&'a dyn EnvironmentFactory>,
    pub prompts: &'a [PromptRow],
    /// Validation prompts (`[data] val_files`), decoded greedily.
    pub val: &'a [PromptRow],
    pub order: &'a mut DataOrder,
    /// The group whose ranks share each step's prompts.
    pub parallel: &'a DataParallel,
    /// The policy's positions (multi-turn episodes end before them).
    pub max_positions: usize,
    /// The step being sampled, counted from 0 (it seeds the sampling).
    pub step: u64,
}

impl Sampling<'_> {
    /// The step's rewarded trajectories. With DAPO's dynamic sampling (`filter_groups`),
    /// batches are sampled until `batch_size` groups whose rewards differ are gathered (or
    /// `max_sample_batches` were drawn), and only those groups are kept; rewards carry the soft
    /// overlong punishment when `overlong_buffer_len` is set. Also returns the sampling metrics.
    pub(crate) fn sample(
        &mut self,
        time: &mut PhaseTimes,
    ) -> Result<(Vec<Trajectory>, RewardOutcome, BTreeMap<String, f64>)> {
        let dapo = self.cfg.dynamic_sampling.clone();
        let batch_size = self.cfg.batch_size;
        let mut kept: Vec<Trajectory> = Vec::new();
        let mut outcome: Option<RewardOutcome> = None;
        let mut batches: u64 = 0;
        loop {
            let rows = self.order.next_batch(batch_size);
            let (completions, mut rewards) = self.sample_share(&rows, batches, time)?;
            if dapo.overlong_buffer_len > 0 {
                self.punish_overlong(&mut rewards, &completions);
            }
            let trajs = self.trajectories(&rows, &completions, &rewards.total, batches);
            outcome = Some(match outcome.take() {
                Some(mut o) => {
                    o.extend(rewards);
                    o
                }
                None => rewards,
            });
            batches += 1;
            if !dapo.filter_groups {
                kept = trajs;
                break;
            }
            let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
            let uids: Vec<&str> = trajs.iter().map(|t| t.uid.as_str()).collect();
            let informative = informative_groups(&rewards, &uids);
            let last = trajs.clone();
            kept.extend(
                trajs
                    .into_iter()
                    .zip(informative)
                    .filter_map(|(t, keep)| keep.then_some(t)),
            );
            let groups = distinct_groups(&kept);
            if groups >= batch_size || batches >= dapo.max_sample_batches as u64 {
                if kept.is_empty() {
                    // No group carried a signal: train on the last batch as it is.
                    kept = last;
                }
                let cap = self.cfg.rollout.n_samples_per_prompt * batch_size;
                kept.truncate(cap.max(1));
                break;
            }
        }
        let mut m = BTreeMap::new();
        if dapo.filter_groups {
            m.insert("num_gen_batches".into(), batches as f64);
            m.insert(
                "dynamic_sampling_groups".into(),
                distinct_groups(&kept) as f64,
            );
        }
        let outcome = outcome.ok_or_else(|| TrainError::Invalid("no batch was sampled".into()))?;
        Ok((kept, outcome, m))
    }

    /// Samples and rewards this rank's share of `rows` (all of them in one process), then
    /// gathers every rank's: each rank returns the completions and rewards of all `rows`, in
    /// order, as one process sampling them all would have drawn them.
    fn sample_share(
        &mut self,
        rows: &[usize],
        batch: u64,
        time: &mut PhaseTimes,
    ) -> Result<(Vec<Vec<Completion>>, RewardOutcome)> {
        let share = self.parallel.share(rows.len());
        let first = share.start as u64;
        let mine = &rows[share];
        let (completions, rewards) = match self.environments.is_some() {
            true => {
                let params = SamplingParams {
                    first_prompt: first,
                    ..self.sampling_params(batch)
                };
                time.time("rollout", || self.episodes(mine, &params, false))?
            }
            false => {
                let completions = time.time("rollout", || self.rollout(mine, batch, first))?;
                let rewards =
                    time.time("reward", || self.score(mine, self.prompts, &completions))?;
                (completions, rewards)
            }
        };
        if self.parallel.is_single() {
            return Ok((completions, rewards));
        }
        time.time("gather", || {
            self.parallel.gather_samples(completions, rewards)
        })
    }

    /// Adds DAPO's soft overlong punishment to every response's total reward, and reports it
    /// as the reward function `overlong`.
    fn punish_overlong(&self, rewards: &mut RewardOutcome, completions: &[Vec<Completion>]) {
        let d = &self.cfg.dynamic_sampling;
        let max = self.cfg.rollout.max_new_tokens;
        let penalties: Vec<f64> = completions
            .iter()
            .flatten()
            .map(|c| {
                soft_overlong_penalty(
                    c.response_ids.len(),
                    max,
                    d.overlong_buffer_len,
                    d.overlong_penalty_factor,
                )
            })
            .collect();
        for (total, p) in rewards.total.iter_mut().zip(&penalties) {
            *total += p;
        }
        rewards.per_function.push(("overlong".into(), penalties));
    }

    /// The step's sampling parameters: the run's `[rollout]` settings, and a seed derived from
    /// the run's seed, the step and the batch within the step (dynamic sampling draws several),
    /// so a resumed run samples what an uninterrupted one would.
    fn sampling_params(&self, batch: u64) -> SamplingParams {
        let r = &self.cfg.rollout;
        SamplingParams {
            n: r.n_samples_per_prompt,
            max_new_tokens: r.max_new_tokens,
            sampler: SamplerConfig {
                temperature: r.temperature,
                top_k: r.top_k,
                top_p: r.top_p,
                min_p: r.min_p,
            },
            seed: self
                .cfg
                .seed
                .wrapping_add(self.step.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .wrapping_add(batch.wrapping_mul(0xD1B5_4A32_D192_ED03)),
            stop_token_ids: Vec::new(),
            stop_strings: r.stop.clone(),
            ignore_eos: false,
            first_prompt: 0,
        }
    }

    /// `params.n` multi-turn episodes of each prompt `rows[i]` (of the validation prompts with
    /// `validation`) with the run's environment, and their rewards (as the reward function
    /// `environment`).
    fn episodes(
        &mut self,
        rows: &[usize],
        params: &SamplingParams,
        validation: bool,
    ) -> Result<(Vec<Vec<Completion>>, RewardOutcome)> {
        let (Some(environments), Some(env)) = (self.environments, &self.cfg.environment) else {
            return Err(TrainError::Invalid("the run has no [environment]".into()));
        };
        let source = match validation {
            true => self.val,
            false => self.prompts,
        };
        let asked: Vec<&PromptRow> = rows.iter().map(|&i| &source[i]).collect();
        let limits = EpisodeLimits {
            max_turns: env.max_turns,
            max_positions: self.max_positions,
        };
        let (completions, scores) = run_episodes(
            &mut *self.engine,
            self.tokenizer,
            environments,
            &asked,
            params,
            limits,
        )?;
        let name = "environment".to_string();
        let turns = scores.turns.iter().map(|&t| t as f64).collect();
        Ok((
            completions,
            RewardOutcome {
                total: scores.rewards.clone(),
                per_function: vec![(name.clone(), scores.rewards), ("turns".into(), turns)],
                failures: vec![(name, scores.failures)],
                latency: Vec::new(),
            },
        ))
    }

    /// `n_samples_per_prompt` completions of each prompt `rows[i]`, in the step's `batch`-th
    /// sampling, drawn as prompt `first + i` of that sampling.
    fn rollout(&mut self, rows: &[usize], batch: u64, first: u64) -> Result<Vec<Vec<Completion>>> {
        let params = SamplingParams {
            first_prompt: first,
            ..self.sampling_params(batch)
        };
        let asked: Vec<&PromptRow> = rows.iter().map(|&i| &self.prompts[i]).collect();
        let (ids, images) = engine_prompts(&asked);
        Ok(self.engine.generate_with_images(&ids, &images, &params)?)
    }

    /// One trajectory per completion, prompt-major, rewarded by `rewards`. The group of a
    /// prompt is its uid and its place in the step's samplings (a prompt drawn twice makes two
    /// groups).
    fn trajectories(
        &self,
        rows: &[usize],
        completions: &[Vec<Completion>],
        rewards: &[f64],
        batch: u64,
    ) -> Vec<Trajectory> {
        let mut rewards = rewards.iter();
        let mut trajs = Vec::with_capacity(rewards.len());
        let first_slot = batch as usize * rows.len();
        for (i, (&row, samples)) in rows.iter().zip(completions).enumerate() {
            let slot = first_slot + i;
            let p = &self.prompts[row];
            for (c, &reward) in samples.iter().zip(&mut rewards) {
                let episode = c.episode.as_ref();
                trajs.push(Trajectory {
                    uid: format!("{}#{slot}", p.uid),
                    prompt_ids: episode
                        .and_then(|e| e.prompt_ids.clone())
                        .unwrap_or_else(|| p.prompt_ids.clone()),
                    response_ids: c.response_ids.clone(),
                    reward,
                    rollout_logprobs: c.logprobs.clone(),
                    finish_reason: Some(c.finish_reason.as_str().to_string()),
                    weight_version: Some(c.weight_version),
                    images: p.image_refs.clone(),
                    pixels: p.images.clone(),
                    loss_mask: episode.map(|e| e.generated.clone()).unwrap_or_default(),
                });
            }
        }
        trajs
    }

    /// Rewards of every completion of prompt `prompts[rows[i]]` (`completions[i]`),
    /// prompt-major.
    fn score(
        &self,
        rows: &[usize],
        prompts: &[PromptRow],
        completions: &[Vec<Completion>],
    ) -> Result<RewardOutcome> {
        let asked: Vec<&PromptRow> = rows.iter().map(|&i| &prompts[i]).collect();
        let inputs = reward_inputs(&asked, completions, self.tokenizer)?;
        Ok(self.rewards.score(&inputs))
    }

    /// Greedy decoding of every validation prompt, scored (see [`crate::GrpoRun::validate`]).
    pub(crate) fn validate(&mut self) -> Result<BTreeMap<String, f64>> {
        let mut m = BTreeMap::new();
        // Rank 0 validates; the others go on to the next step and wait for it there.
        if self.val.is_empty() || !self.parallel.is_main() {
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
        let rows: Vec<usize> = (0..self.val.len()).collect();
        let (completions, outcome) = match self.environments.is_some() {
            true => self.episodes(&rows, &params, true)?,
            false => {
                let asked: Vec<&PromptRow> = self.val.iter().collect();
                let (ids, images) = engine_prompts(&asked);
                let completions = self.engine.generate_with_images(&ids, &images, &params)?;
                let outcome = self.score(&rows, self.val, &completions)?;
                (completions, outcome)
            }
        };
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
}
