//! Evaluating checkpoints (`oxrl eval`): each model answers every prompt of a dataset `n` times
//! (greedy at temperature 0) through the local engine or the vLLM / `oxrl serve` servers that
//! serve it, scored as a training run would score them — its `[[reward.functions]]`, or its `[environment]`'s episodes — with the mean reward,
//! pass@k and every response kept.

use crate::config::RunConfig;
use crate::data::{load_prompts, PromptRow};
use crate::episodes::{run_episodes, EpisodeLimits};
use crate::grpo::{
    check_environment_rows, check_reward_columns, dtype, engine_prompts, environments, open_device,
    reward_inputs, reward_set,
};
use crate::update::{Result, TrainError};
use oxrl_models::{eos_token_ids, hub::resolve_model, load_policy, ImagePrompting, Tokenizer};
use oxrl_rollout::{
    Completion, Engine, LocalEngine, SamplerConfig, SamplingParams, VllmEngine, VllmSpec,
    WeightSync, MAX_SEQUENCES_PER_REQUEST,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// How each model is asked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalSettings {
    /// Samples per prompt.
    pub n: usize,
    /// 0: greedy (then `n` must be 1).
    pub temperature: f64,
    /// A sample counts as solved for pass@k when its reward is at least this.
    pub pass_threshold: f64,
    pub seed: u64,
}

/// One response and its scores.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSample {
    pub uid: String,
    /// Which of the prompt's `n` samples.
    pub sample: usize,
    pub prompt: String,
    pub response: String,
    pub reward: f64,
    /// Each reward function's score (or the environment's, and its turns).
    pub scores: Vec<(String, f64)>,
    pub response_tokens: usize,
}

/// One model's evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    pub model: String,
    pub prompts: usize,
    pub samples: Vec<EvalSample>,
    pub mean_reward: f64,
    /// `(k, pass@k)` for k = 1, 2, 4, … up to `n` (and `n` itself).
    pub pass_at: Vec<(usize, f64)>,
    /// Each reward function's mean score.
    pub per_function: Vec<(String, f64)>,
    pub failures: usize,
    pub seconds: f64,
    pub generated_tokens: usize,
}

/// The unbiased pass@k of a prompt with `c` of `n` samples solved (Chen et al., 2021):
/// `1 − C(n − c, k) / C(n, k)`, computed as a product so it never overflows.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if n - c < k {
        return 1.0;
    }
    1.0 - ((n - c + 1)..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// The k pass@k is reported for: powers of two below `n`, and `n`.
fn ks(n: usize) -> Vec<usize> {
    let mut out: Vec<usize> = std::iter::successors(Some(1), |k| Some(k * 2))
        .take_while(|&k| k < n)
        .collect();
    out.push(n);
    out
}

/// Evaluates `model` (a checkpoint directory or hub id) on the prompts of `data`, read with
/// the run configuration's `[data]` settings and scored with its rewards or environment.
/// With `servers` (base URLs of vLLM or `oxrl serve` servers already serving `model`), the
/// answers come from them, through vLLM's token route, and `model` gives the tokenizer, chat
/// template and eos ids; otherwise the local engine loads it.
pub fn evaluate(
    cfg: &RunConfig,
    model: &str,
    data: &[PathBuf],
    settings: EvalSettings,
    servers: &[String],
) -> Result<EvalReport> {
    if settings.n == 0 || (settings.temperature == 0.0 && settings.n > 1) {
        return Err(TrainError::Invalid(format!(
            "n = {} with temperature {}: greedy decoding gives one answer per prompt; sample \
             (temperature > 0) for n > 1",
            settings.n, settings.temperature
        )));
    }
    let device = open_device(cfg)?;
    let dir = resolve_model(model)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir)?);
    let prompting = ImagePrompting::from_dir(&dir)?;
    let (rows, _) = load_prompts(data, &cfg.data, &tokenizer, prompting.as_ref())?;
    if rows.is_empty() {
        return Err(TrainError::Invalid(format!(
            "{}: no prompts to evaluate",
            data.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    check_reward_columns(cfg, &rows)?;
    check_environment_rows(cfg, &rows)?;
    let rewards = reward_set(cfg, &device)?;
    let envs = environments(cfg)?;
    let eos = eos_token_ids(&dir, Some(&tokenizer))?;
    let (mut engine, max_positions): (Box<dyn Engine>, usize) = match servers.is_empty() {
        true => {
            let policy = load_policy(&dir, dtype(&cfg.dtype), &device)?;
            let max_positions = policy.max_positions();
            let engine = LocalEngine::new(Arc::from(policy), Some(tokenizer.clone()), eos);
            (Box::new(engine), max_positions)
        }
        false => {
            let spec = remote_spec(cfg, servers);
            let engine = VllmEngine::connect(spec, &dir, Some(tokenizer.clone()), eos)?
                .with_image_token_id(prompting.as_ref().map(|p| p.tokens.image_token_id));
            (Box::new(engine), max_positions(&dir)?)
        }
    };
    let r = &cfg.rollout;
    let params = SamplingParams {
        n: settings.n,
        max_new_tokens: r.max_new_tokens,
        sampler: SamplerConfig {
            temperature: settings.temperature,
            top_k: r.top_k,
            top_p: r.top_p,
            min_p: r.min_p,
        },
        seed: settings.seed,
        stop_strings: r.stop.clone(),
        ..Default::default()
    };
    let start = Instant::now();
    let mut samples = Vec::with_capacity(rows.len() * settings.n);
    let mut failures = 0;
    let chunk = (MAX_SEQUENCES_PER_REQUEST / settings.n).max(1);
    let mut first = 0;
    for part in rows.chunks(chunk) {
        let asked: Vec<&PromptRow> = part.iter().collect();
        let params = SamplingParams {
            first_prompt: first as u64,
            ..params.clone()
        };
        first += part.len();
        let (completions, outcome) = match &envs {
            Some(envs) => {
                let env = cfg.environment.as_ref().map_or(1, |e| e.max_turns);
                let limits = EpisodeLimits {
                    max_turns: env,
                    max_positions,
                };
                let (completions, scores) = run_episodes(
                    engine.as_mut(),
                    &tokenizer,
                    envs.as_ref(),
                    &asked,
                    &params,
                    limits,
                )?;
                failures += scores.failures;
                let turns = scores.turns.iter().map(|&t| t as f64).collect();
                let per = vec![
                    ("environment".to_string(), scores.rewards.clone()),
                    ("turns".to_string(), turns),
                ];
                (completions, (scores.rewards, per))
            }
            None => {
                let (ids, images) = engine_prompts(&asked);
                let completions = engine.generate_with_images(&ids, &images, &params)?;
                let outcome = rewards.score(&reward_inputs(&asked, &completions, &tokenizer)?);
                failures += outcome.failures.iter().map(|(_, f)| f).sum::<usize>();
                (completions, (outcome.total, outcome.per_function))
            }
        };
        collect(&asked, &completions, outcome, &tokenizer, &mut samples)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(report(
        model,
        rows.len(),
        samples,
        failures,
        seconds,
        settings,
    ))
}

/// The servers `oxrl eval --server` asks: the config's request timeout and retries when it has
/// a `[rollout] backend = "vllm"`, and no weight sync (they serve the model being evaluated).
fn remote_spec(cfg: &RunConfig, servers: &[String]) -> VllmSpec {
    let base = cfg.rollout.vllm.clone().unwrap_or(VllmSpec {
        server_urls: Vec::new(),
        sync: WeightSync::None,
        sync_dir: None,
        timeout: std::time::Duration::from_secs(600),
        max_retries: 3,
        backoff: std::time::Duration::from_millis(500),
    });
    VllmSpec {
        server_urls: servers.to_vec(),
        sync: WeightSync::None,
        ..base
    }
}

/// The longest sequence the checkpoint in `dir` takes (`max_position_embeddings` of its text
/// config), for multi-turn episodes when no local model is loaded.
fn max_positions(dir: &Path) -> Result<usize> {
    let path = dir.join("config.json");
    let v = oxrl_models::config::read_json(&path)?;
    let text = v.get("text_config").unwrap_or(&v);
    Ok(oxrl_models::Qwen3Config::from_value(text, &path)?.max_position_embeddings)
}

/// Appends each completion of `asked[i]` with its scores to `samples`.
fn collect(
    asked: &[&PromptRow],
    completions: &[Vec<Completion>],
    (total, per_function): (Vec<f64>, Vec<(String, Vec<f64>)>),
    tokenizer: &Tokenizer,
    samples: &mut Vec<EvalSample>,
) -> Result<()> {
    let mut at = 0;
    for (p, group) in asked.iter().zip(completions) {
        for (j, c) in group.iter().enumerate() {
            let response = match &c.text {
                Some(t) => t.clone(),
                None => tokenizer.decode(&c.response_ids, true)?,
            };
            samples.push(EvalSample {
                uid: p.uid.clone(),
                sample: j,
                prompt: p.prompt_text.clone(),
                response,
                reward: total[at],
                scores: per_function
                    .iter()
                    .map(|(name, s)| (name.clone(), s[at]))
                    .collect(),
                response_tokens: c.response_ids.len(),
            });
            at += 1;
        }
    }
    Ok(())
}

fn report(
    model: &str,
    prompts: usize,
    samples: Vec<EvalSample>,
    failures: usize,
    seconds: f64,
    settings: EvalSettings,
) -> EvalReport {
    let n = settings.n;
    let count = samples.len().max(1) as f64;
    let mean_reward = samples.iter().map(|s| s.reward).sum::<f64>() / count;
    let pass_at = ks(n)
        .into_iter()
        .map(|k| {
            let per_prompt: f64 = samples
                .chunks(n)
                .map(|group| {
                    let solved = group
                        .iter()
                        .filter(|s| s.reward >= settings.pass_threshold)
                        .count();
                    pass_at_k(group.len(), solved, k.min(group.len()))
                })
                .sum();
            (k, per_prompt / prompts.max(1) as f64)
        })
        .collect();
    let names: Vec<String> = samples
        .first()
        .map(|s| s.scores.iter().map(|(name, _)| name.clone()).collect())
        .unwrap_or_default();
    let per_function = names
        .iter()
        .enumerate()
        .map(|(f, name)| {
            let sum: f64 = samples.iter().map(|s| s.scores[f].1).sum();
            (name.clone(), sum / count)
        })
        .collect();
    let generated_tokens = samples.iter().map(|s| s.response_tokens).sum();
    EvalReport {
        model: model.to_string(),
        prompts,
        samples,
        mean_reward,
        pass_at,
        per_function,
        failures,
        seconds,
        generated_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_is_the_chance_that_k_draws_hold_a_solved_one() {
        // n = 4, c = 1: pass@1 = 1/4; pass@2 = 1 − C(3,2)/C(4,2) = 1 − 3/6 = 0.5.
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
        assert!((pass_at_k(4, 1, 2) - 0.5).abs() < 1e-12);
        // n = 5, c = 2, k = 2: 1 − C(3,2)/C(5,2) = 1 − 3/10 = 0.7.
        assert!((pass_at_k(5, 2, 2) - 0.7).abs() < 1e-12);
        assert_eq!(pass_at_k(4, 0, 4), 0.0);
        assert_eq!(pass_at_k(4, 3, 2), 1.0, "every pair holds a solved one");
        assert_eq!(ks(8), vec![1, 2, 4, 8]);
        assert_eq!(ks(6), vec![1, 2, 4, 6]);
        assert_eq!(ks(1), vec![1]);
    }
}
