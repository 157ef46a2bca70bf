//! The run configuration: one TOML file whose sections follow the loop (`[model]`,
//! `[reference]`, `[data]`, `[rollout]`, `[reward]`, `[algorithm]`, `[trainer]`, `[logging]`),
//! plus the flat quick-start keys of SkyRL-style deployments (`policy_model`, `reward_model`,
//! `algorithm = "GRPO"`, `num_gpus`, `batch_size`, `gradient_accumulation_steps`).
//!
//! Every key is checked before any model loads: an unknown key or a bad value is an error that
//! names the file, the line, the key and what was expected (and the closest valid key).
//! [`KEYS`] is the single list of keys with their defaults and meanings (`oxrl config --explain`).

use crate::optim::{AdamWConfig, LrSchedule};
use crate::reward_config::{applies, keys_of, resolve_function, reward_types};
pub use crate::reward_config::{
    RewardFunction, RewardFunctionConfig, RewardKind, REWARD_FUNCTION_KEYS,
};
use crate::update::{AlgorithmConfig, OldLogprobs, UpdateConfig};
use oxrl_algo::{
    AdvantageConfig, AdvantageEstimator, KlEstimator, LossAgg, PolicyLoss, PolicyLossConfig,
};
use oxrl_models::DeviceSpec;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

/// One configuration key: where it lives, its default, what it means.
pub struct KeyDoc {
    /// The section, or "" for a flat quick-start key.
    pub section: &'static str,
    pub key: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
}

macro_rules! keys {
    ($( $section:literal $key:literal = $default:literal : $meaning:literal ;)*) => {
        &[$(KeyDoc { section: $section, key: $key, default: $default, meaning: $meaning }),*]
    };
}

pub const KEYS: &[KeyDoc] = keys! {
    "model" "path" = "(required)" : "policy checkpoint: a directory or a hub id";
    "model" "dtype" = "\"f32\"" : "compute dtype: f32, bf16 or f16";
    "model" "device" = "\"cpu\"" : "where the policy and reference run and train: cpu, cuda (the first GPU) or cuda:N (needs a build with --features cuda)";
    "model" "freeze_vision" = "false" : "Qwen3-VL: keep the vision tower's weights fixed (train the language model only)";
    "reference" "path" = "the policy's initial weights" : "reference model for the KL term (loaded only when kl_coef > 0)";
    "data" "train_files" = "(required unless --rollouts)" : "JSONL or Parquet dataset(s), paths relative to this file";
    "data" "val_files" = "none" : "validation dataset(s), decoded greedily and scored before training, every eval_every steps and at the end";
    "data" "prompt_key" = "\"prompt\"" : "column with the prompt: a string or chat messages";
    "data" "answer_key" = "\"answer\"" : "column with the ground truth passed to rewards";
    "data" "image_key" = "\"images\"" : "column with a row's images (Qwen3-VL): paths relative to the dataset file, data URLs, or {bytes, path} cells";
    "data" "max_prompt_length" = "1024" : "prompt tokens after the chat template";
    "data" "overlong_prompts" = "\"filter\"" : "\"filter\" drops longer prompts, \"error\" stops the run";
    "data" "enable_thinking" = "template default" : "enable_thinking passed to the chat template";
    "data" "shuffle" = "true" : "shuffle the prompts each epoch with the run's seed";
    "rollout" "n_samples_per_prompt" = "8" : "group size G: responses sampled per prompt";
    "rollout" "max_new_tokens" = "256" : "response length limit";
    "rollout" "temperature" = "1.0" : "sampling temperature, also the temperature of the trainer's log-probs";
    "rollout" "top_p" = "1.0" : "nucleus sampling";
    "rollout" "top_k" = "0" : "top-k sampling (0 = off)";
    "rollout" "min_p" = "0.0" : "min-p sampling (0 = off)";
    "rollout" "stop" = "[]" : "stop strings";
    "reward" "functions" = "(required for sampling runs)" : "[[reward.functions]] tables: type, name, weight and the type's options";
    "reward" "failure_score" = "0.0" : "score of a reward function that fails or times out";
    "reward" "timeout_s" = "10.0" : "time limit of one reward call (one response; one batch for http)";
    "reward.functions" "type" = "(required)" : "math_answer, exact_match, regex_match, format, length_penalty, code, http, reward_model";
    "reward.functions" "name" = "the type" : "name in metrics: reward/<name>, reward_failures/<name>, reward_latency_s/<name>";
    "reward.functions" "weight" = "1.0" : "the total reward is the weighted sum of the functions' scores";
    "reward.functions" "answer_key" = "[data] answer_key" : "math_answer, exact_match: the ground-truth column";
    "reward.functions" "tolerance" = "1e-6" : "math_answer: relative tolerance";
    "reward.functions" "pattern" = "(required)" : "regex_match, format: the regex";
    "reward.functions" "target_length" = "(required)" : "length_penalty: tokens before the penalty starts";
    "reward.functions" "language" = "\"python\"" : "code: the code block's fence tag (python also takes py, python3)";
    "reward.functions" "command" = "[\"python3\", \"-I\", \"-B\", \"{file}\"]" : "code: program and arguments, {file} = the solution file (required for other languages)";
    "reward.functions" "file_name" = "\"main.py\" (python), \"main\"" : "code: name of the solution file";
    "reward.functions" "tests_key" = "\"tests\"" : "code: the row column with the tests (asserts, or stdin/stdout pairs)";
    "reward.functions" "scoring" = "\"fraction\"" : "code: \"fraction\" of tests passed, or \"all\" (1 only if every test passes)";
    "reward.functions" "workers" = "available parallelism" : "code: sandboxed runs at once";
    "reward.functions" "timeout_s" = "5.0 (code), 3.0 (http)" : "code: wall clock of one test run; http: one request";
    "reward.functions" "cpu_s" = "5" : "code: CPU seconds per process";
    "reward.functions" "memory_mb" = "1024" : "code: address space per process (MiB)";
    "reward.functions" "file_size_mb" = "16" : "code: largest file a process may write (MiB)";
    "reward.functions" "max_processes" = "32" : "code: processes and threads of one run";
    "reward.functions" "max_open_files" = "64" : "code: open files per process";
    "reward.functions" "output_bytes" = "65536" : "code: stdout and stderr kept each; more kills the run";
    "reward.functions" "scratch_mb" = "64" : "code: size of the writable scratch directory (MiB)";
    "reward.functions" "url" = "(required)" : "http: POST {items: [{prompt, response, row}]} here, read {scores: [...]}";
    "reward.functions" "max_retries" = "2" : "http: retries after a transport error, timeout, 408, 429 or 5xx";
    "reward.functions" "backoff_s" = "0.25" : "http: wait before the first retry, doubled for each next one";
    "reward.functions" "max_concurrency" = "4" : "http: requests in flight at once";
    "reward.functions" "batch_size" = "16 (http), 8 (reward_model)" : "http: items per request; reward_model: sequences per forward";
    "reward.functions" "path" = "(required)" : "reward_model: a Qwen3ForSequenceClassification checkpoint (directory or hub id)";
    "reward.functions" "dtype" = "\"f32\"" : "reward_model: compute dtype: f32, bf16 or f16";
    "reward.functions" "normalize" = "\"none\"" : "reward_model: \"none\", or \"running\" (minus the running mean, over the running std)";
    "reward.functions" "scale" = "1.0" : "reward_model: the score is scale * (normalised score) + shift";
    "reward.functions" "shift" = "0.0" : "reward_model: added after scale";
    "algorithm" "advantage" = "\"grpo\"" : "grpo, dr_grpo, rloo, reinforce_baseline";
    "algorithm" "norm_adv_by_std" = "true (false for dr_grpo)" : "divide GRPO advantages by the group std";
    "algorithm" "adv_eps" = "1e-6" : "epsilon of the GRPO std";
    "algorithm" "policy_loss" = "\"ppo_clip\"" : "ppo_clip, gspo, cispo";
    "algorithm" "clip_low" = "0.2" : "lower clip epsilon";
    "algorithm" "clip_high" = "0.2" : "upper clip epsilon (0.28 = DAPO clip-higher)";
    "algorithm" "dual_clip_c" = "none" : "dual-clip constant for negative advantages (ppo_clip)";
    "algorithm" "kl_coef" = "0.0" : "beta of the KL loss term; 0 loads no reference model";
    "algorithm" "kl_estimator" = "\"k3\"" : "k1, k2, k3 (low_var_kl), abs";
    "algorithm" "loss_agg" = "\"token_mean\"" : "token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm";
    "algorithm" "kl_loss_agg" = "= loss_agg" : "aggregation of the KL term";
    "algorithm" "loss_scale_factor" = "= max_new_tokens" : "L_max of seq_mean_token_sum_norm";
    "algorithm" "old_logprobs" = "\"recompute\"" : "\"recompute\" with the policy before the update, or \"rollout\" (the engine's)";
    "algorithm" "entropy_coef" = "0.0" : "entropy bonus coefficient";
    "trainer" "batch_size" = "8" : "prompts per step (x n_samples_per_prompt trajectories)";
    "trainer" "micro_batch_size" = "8" : "trajectories per forward/backward";
    "trainer" "gradient_accumulation_steps" = "whole batch" : "micro-batches per optimizer step";
    "trainer" "ppo_epochs" = "1" : "passes over each batch";
    "trainer" "max_steps" = "100" : "training steps (a replay run does one per --rollouts file)";
    "trainer" "lr" = "1e-6" : "AdamW learning rate";
    "trainer" "adam_betas" = "[0.9, 0.999]" : "AdamW betas";
    "trainer" "adam_eps" = "1e-8" : "AdamW epsilon";
    "trainer" "weight_decay" = "0.01" : "decoupled weight decay, every parameter";
    "trainer" "max_grad_norm" = "1.0" : "global gradient-norm clip";
    "trainer" "lr_schedule" = "\"constant\"" : "constant, linear, cosine (each after warmup)";
    "trainer" "warmup_steps" = "0" : "linear warmup optimizer steps";
    "trainer" "eval_every" = "0 (start and end only)" : "validation every N steps, when [data] val_files is set";
    "trainer" "save_every" = "0" : "checkpoint every N steps (0 = only at the end)";
    "trainer" "max_staleness" = "0" : "weight versions a sampled trajectory may lag the trainer's (0 = strictly on-policy: any older sample stops the run)";
    "trainer" "seed" = "42" : "data order and sampling seed";
    "trainer" "output_dir" = "\"runs/<config name>\"" : "checkpoints, metrics.jsonl, reward.svg";
    "logging" "prometheus_port" = "none" : "serve /metrics on this port";
    "" "policy_model" = "-" : "quick-start: [model] path";
    "" "reward_model" = "-" : "quick-start: a [[reward.functions]] table of type reward_model with this path, weight 1";
    "" "algorithm" = "-" : "quick-start: \"GRPO\", \"DR_GRPO\", \"RLOO\", \"REINFORCE_BASELINE\", \"GSPO\", \"DAPO\"";
    "" "num_gpus" = "-" : "quick-start: accelerators to use (0 or 1 on one machine today)";
    "" "batch_size" = "-" : "quick-start: [trainer] batch_size";
    "" "gradient_accumulation_steps" = "-" : "quick-start: [trainer] gradient_accumulation_steps";
};

#[derive(Debug, thiserror::Error)]
#[error("{path}:{line}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub line: usize,
    pub message: String,
}

// ---- the raw file, as serde reads it ------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawModel {
    path: Option<String>,
    dtype: Option<String>,
    device: Option<String>,
    freeze_vision: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawReference {
    path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawData {
    train_files: Option<OneOrMany>,
    val_files: Option<OneOrMany>,
    prompt_key: Option<String>,
    answer_key: Option<String>,
    image_key: Option<String>,
    max_prompt_length: Option<usize>,
    overlong_prompts: Option<String>,
    enable_thinking: Option<bool>,
    shuffle: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawRollout {
    n_samples_per_prompt: Option<usize>,
    max_new_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<usize>,
    min_p: Option<f64>,
    stop: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawReward {
    functions: Vec<RewardFunctionConfig>,
    failure_score: Option<f64>,
    timeout_s: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawAlgorithm {
    advantage: Option<String>,
    norm_adv_by_std: Option<bool>,
    adv_eps: Option<f64>,
    policy_loss: Option<String>,
    clip_low: Option<f64>,
    clip_high: Option<f64>,
    dual_clip_c: Option<f64>,
    kl_coef: Option<f64>,
    kl_estimator: Option<String>,
    kl_loss_agg: Option<String>,
    loss_agg: Option<String>,
    loss_scale_factor: Option<f64>,
    old_logprobs: Option<String>,
    entropy_coef: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawTrainer {
    batch_size: Option<usize>,
    micro_batch_size: Option<usize>,
    gradient_accumulation_steps: Option<usize>,
    ppo_epochs: Option<usize>,
    max_steps: Option<u64>,
    lr: Option<f64>,
    adam_betas: Option<(f64, f64)>,
    adam_eps: Option<f64>,
    weight_decay: Option<f64>,
    max_grad_norm: Option<f64>,
    lr_schedule: Option<String>,
    warmup_steps: Option<u64>,
    save_every: Option<u64>,
    eval_every: Option<u64>,
    max_staleness: Option<u64>,
    seed: Option<u64>,
    output_dir: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawLogging {
    prometheus_port: Option<u16>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    model: RawModel,
    reference: RawReference,
    data: RawData,
    rollout: RawRollout,
    reward: RawReward,
    /// `[algorithm]` section, or the flat `algorithm = "GRPO"` preset.
    algorithm: Option<toml::Value>,
    trainer: RawTrainer,
    logging: RawLogging,
    policy_model: Option<String>,
    reward_model: Option<String>,
    num_gpus: Option<u32>,
    batch_size: Option<usize>,
    gradient_accumulation_steps: Option<usize>,
}

// ---- the resolved run ---------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
pub struct DataConfig {
    pub train_files: Vec<PathBuf>,
    pub val_files: Vec<PathBuf>,
    pub prompt_key: String,
    pub answer_key: String,
    pub image_key: String,
    pub max_prompt_length: usize,
    pub filter_overlong: bool,
    pub enable_thinking: Option<bool>,
    pub shuffle: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RolloutConfig {
    pub n_samples_per_prompt: usize,
    pub max_new_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    pub min_p: f64,
    pub stop: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RewardConfig {
    pub functions: Vec<RewardFunction>,
    pub failure_score: f64,
    pub timeout_s: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The file the config came from; relative paths in it are relative to its directory.
    pub source: PathBuf,
    pub model_path: String,
    pub dtype: String,
    /// Where the policy and reference run and train.
    pub device: DeviceSpec,
    /// Weight versions a sampled trajectory may lag the trainer's.
    pub max_staleness: u64,
    /// Qwen3-VL: the vision tower's weights stay fixed.
    pub freeze_vision: bool,
    pub reference_path: Option<String>,
    pub data: DataConfig,
    pub rollout: RolloutConfig,
    pub reward: RewardConfig,
    pub algorithm: AlgorithmConfig,
    pub update: UpdateConfig,
    pub batch_size: usize,
    pub max_steps: u64,
    pub save_every: u64,
    pub eval_every: u64,
    pub seed: u64,
    pub output_dir: PathBuf,
    pub prometheus_port: Option<u16>,
}

/// 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The valid name nearest to `name`, if any is near enough to be a likely typo.
fn closest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .map(|c| (edit_distance(name, c), c))
        .filter(|(d, c)| *d <= (c.len().max(name.len()) / 3).max(2))
        .min()
        .map(|(_, c)| c)
}

const SECTIONS: [&str; 8] = [
    "model",
    "reference",
    "data",
    "rollout",
    "reward",
    "algorithm",
    "trainer",
    "logging",
];

/// Where each key of the file sits, and the checks that need the file's text.
struct Located<'a> {
    path: &'a Path,
    text: &'a str,
    lines: Vec<(String, usize)>,
}

impl Located<'_> {
    fn err(&self, line: usize, message: String) -> ConfigError {
        ConfigError {
            path: self.path.display().to_string(),
            line,
            message,
        }
    }

    /// The line of `dotted` (e.g. `trainer.lr`), or of its section, or 1.
    fn line(&self, dotted: &str) -> usize {
        let section = dotted.split('.').next().unwrap_or_default();
        self.lines
            .iter()
            .find(|(k, _)| k == dotted)
            .or_else(|| self.lines.iter().find(|(k, _)| k == section))
            .map_or(1, |(_, l)| *l)
    }

    fn bad(&self, dotted: &str, expected: impl std::fmt::Display) -> ConfigError {
        self.err(self.line(dotted), format!("key `{dotted}`: {expected}"))
    }

    fn unknown(&self, dotted: &str, span: usize, candidates: Vec<String>) -> ConfigError {
        let name = dotted.rsplit('.').next().unwrap_or(dotted);
        let hint = match closest(name, candidates.iter().map(String::as_str)) {
            Some(c) => format!("; did you mean `{c}`?"),
            None => String::new(),
        };
        self.err(
            line_of(self.text, span),
            format!("unknown key `{dotted}`{hint}"),
        )
    }

    /// Records every key's line and rejects keys that are not in [`KEYS`].
    fn walk(&mut self, root: &Spanned<DeTable>) -> Result<(), ConfigError> {
        for (key, value) in root.get_ref() {
            let k = key.get_ref().as_ref();
            let at = line_of(self.text, key.span().start);
            self.lines.push((k.to_string(), at));
            match value.get_ref() {
                DeValue::Table(table) if SECTIONS.contains(&k) => {
                    for (sub, v) in table {
                        let s = sub.get_ref().as_ref();
                        let dotted = format!("{k}.{s}");
                        self.lines
                            .push((dotted.clone(), line_of(self.text, sub.span().start)));
                        if !KEYS.iter().any(|d| d.section == k && d.key == s) {
                            let valid = KEYS
                                .iter()
                                .filter(|d| d.section == k)
                                .map(|d| d.key.to_string())
                                .collect();
                            return Err(self.unknown(&dotted, sub.span().start, valid));
                        }
                        if dotted == "reward.functions" {
                            self.walk_reward_functions(v)?;
                        }
                    }
                }
                _ if KEYS.iter().any(|d| d.section.is_empty() && d.key == k) => {}
                _ if SECTIONS.contains(&k) => {
                    return Err(self.err(at, format!("key `{k}`: expected a [{k}] section")));
                }
                _ => {
                    let mut valid: Vec<String> = SECTIONS.iter().map(|s| s.to_string()).collect();
                    valid.extend(
                        KEYS.iter()
                            .filter(|d| d.section.is_empty())
                            .map(|d| d.key.to_string()),
                    );
                    if let Some(d) = KEYS.iter().find(|d| d.key == k) {
                        return Err(self.err(
                            at,
                            format!(
                                "unknown key `{k}`; did you mean `{}` in [{}]?",
                                d.key, d.section
                            ),
                        ));
                    }
                    return Err(self.unknown(k, key.span().start, valid));
                }
            }
        }
        Ok(())
    }

    /// Records the line of each function table and key (`reward.functions.<i>.<key>`), and
    /// rejects unknown keys, a missing or unknown `type`, and keys of another type.
    fn walk_reward_functions(&mut self, v: &Spanned<DeValue>) -> Result<(), ConfigError> {
        let DeValue::Array(items) = v.get_ref() else {
            return Err(self.err(
                line_of(self.text, v.span().start),
                "key `reward.functions`: expected [[reward.functions]] tables".into(),
            ));
        };
        for (i, item) in items.iter().enumerate() {
            let DeValue::Table(t) = item.get_ref() else {
                continue;
            };
            let table_line = t
                .iter()
                .map(|(k, _)| line_of(self.text, k.span().start))
                .min()
                .unwrap_or_else(|| line_of(self.text, item.span().start));
            self.lines
                .push((format!("reward.functions.{i}"), table_line));
            let mut kind = None;
            for (k, value) in t {
                let name = k.get_ref().as_ref();
                let at = line_of(self.text, k.span().start);
                self.lines
                    .push((format!("reward.functions.{i}.{name}"), at));
                if !REWARD_FUNCTION_KEYS.contains(&name) {
                    let valid = REWARD_FUNCTION_KEYS.iter().map(|s| s.to_string()).collect();
                    return Err(self.unknown(
                        &format!("reward.functions.{name}"),
                        k.span().start,
                        valid,
                    ));
                }
                if name == "type" {
                    match value.get_ref() {
                        DeValue::String(s) => kind = Some((s.to_string(), at)),
                        _ => {
                            return Err(self
                                .err(at, "key `reward.functions.type`: expected a string".into()))
                        }
                    }
                }
            }
            let Some((kind, type_line)) = kind else {
                return Err(self.err(
                    table_line,
                    format!(
                        "[[reward.functions]] needs a `type`: one of {}",
                        reward_types().join(", ")
                    ),
                ));
            };
            if keys_of(&kind).is_none() {
                let hint = match closest(&kind, reward_types().into_iter()) {
                    Some(c) => format!("; did you mean \"{c}\"?"),
                    None => format!("; expected one of {}", reward_types().join(", ")),
                };
                return Err(self.err(
                    type_line,
                    format!("key `reward.functions.type`: unknown reward type \"{kind}\"{hint}"),
                ));
            }
            for (k, _) in t {
                let name = k.get_ref().as_ref();
                if !applies(&kind, name) {
                    let own = keys_of(&kind).unwrap_or_default().join(", ");
                    return Err(self.err(
                        line_of(self.text, k.span().start),
                        format!("key `reward.functions.{name}` does not apply to type \"{kind}\" (its keys: {own})"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// An error about key `key` of the `i`-th function table, at its line.
    fn function_err(&self, i: usize, key: &str, message: &str) -> ConfigError {
        let line = self
            .lines
            .iter()
            .find(|(k, _)| *k == format!("reward.functions.{i}.{key}"))
            .or_else(|| {
                self.lines
                    .iter()
                    .find(|(k, _)| *k == format!("reward.functions.{i}"))
            })
            .map_or_else(|| self.line("reward"), |(_, l)| *l);
        self.err(line, format!("key `reward.functions.{key}`: {message}"))
    }
}

/// `algorithm = "<preset>"`: the estimator and loss settings that name stands for.
fn preset(name: &str) -> Option<RawAlgorithm> {
    let mut a = RawAlgorithm::default();
    match name.to_ascii_uppercase().as_str() {
        "GRPO" => a.advantage = Some("grpo".into()),
        "DR_GRPO" | "DR-GRPO" => {
            a.advantage = Some("dr_grpo".into());
            a.loss_agg = Some("seq_mean_token_sum_norm".into());
        }
        "RLOO" => a.advantage = Some("rloo".into()),
        "REINFORCE_BASELINE" | "REINFORCE++" => a.advantage = Some("reinforce_baseline".into()),
        "GSPO" => {
            a.policy_loss = Some("gspo".into());
            a.loss_agg = Some("seq_mean_token_mean".into());
            a.clip_low = Some(3e-4);
            a.clip_high = Some(4e-4);
        }
        "DAPO" => {
            a.clip_high = Some(0.28);
            a.loss_agg = Some("token_mean".into());
        }
        _ => return None,
    }
    Some(a)
}

/// `base/rel` with `.` and `..` resolved lexically (`examples/a/../../runs` → `runs`).
fn join_clean(base: &Path, rel: &str) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir
                if matches!(out.components().next_back(), Some(Component::Normal(_))) =>
            {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn resolve_paths(base: &Path, files: Option<OneOrMany>) -> Vec<PathBuf> {
    let list = match files {
        None => Vec::new(),
        Some(OneOrMany::One(f)) => vec![f],
        Some(OneOrMany::Many(v)) => v,
    };
    list.into_iter().map(|f| join_clean(base, &f)).collect()
}

impl RunConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.display().to_string(),
            line: 0,
            message: e.to_string(),
        })?;
        Self::from_str(&text, path)
    }

    /// Parses and validates `text`, the contents of `path`.
    pub fn from_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let mut loc = Located {
            path,
            text,
            lines: Vec::new(),
        };
        let parse_err = |e: toml::de::Error| {
            let line = e.span().map_or(1, |s| line_of(text, s.start));
            loc_err(path, line, e.message().trim().to_string())
        };
        let doc = DeTable::parse(text).map_err(parse_err)?;
        loc.walk(&doc)?;
        let raw: RawConfig = toml::from_str(text).map_err(parse_err)?;
        resolve(raw, &loc)
    }
}

fn loc_err(path: &Path, line: usize, message: String) -> ConfigError {
    ConfigError {
        path: path.display().to_string(),
        line,
        message,
    }
}

fn resolve(raw: RawConfig, loc: &Located) -> Result<RunConfig, ConfigError> {
    let base = loc.path.parent().unwrap_or(Path::new(".")).to_path_buf();
    let model_path =
        match (raw.model.path, raw.policy_model) {
            (Some(_), Some(_)) => {
                return Err(loc.bad(
                    "policy_model",
                    "give either [model] path or policy_model, not both",
                ))
            }
            (Some(p), None) | (None, Some(p)) => p,
            (None, None) => return Err(loc.bad(
                "model.path",
                "the policy model is required ([model] path = \"...\" or policy_model = \"...\")",
            )),
        };
    let local_or_hub = |p: String| match base.join(&p).exists() {
        true => join_clean(&base, &p).display().to_string(),
        false => p,
    };
    if let Some(n) = raw.num_gpus {
        if n > 1 {
            return Err(loc.bad("num_gpus", format!("{n} GPUs need the multi-process launcher, which this version does not have yet; use 0 or 1")));
        }
    }
    let device = match raw.model.device.as_deref().map(str::parse::<DeviceSpec>) {
        None => DeviceSpec::default(),
        Some(Ok(d)) => d,
        Some(Err(e)) => return Err(loc.bad("model.device", e)),
    };
    let dtype = raw.model.dtype.unwrap_or_else(|| "f32".into());
    if !["f32", "bf16", "f16"].contains(&dtype.as_str()) {
        return Err(loc.bad(
            "model.dtype",
            format!("expected \"f32\", \"bf16\" or \"f16\", got \"{dtype}\""),
        ));
    }

    let d = raw.data;
    let overlong = d.overlong_prompts.unwrap_or_else(|| "filter".into());
    let data = DataConfig {
        train_files: resolve_paths(&base, d.train_files),
        val_files: resolve_paths(&base, d.val_files),
        prompt_key: d.prompt_key.unwrap_or_else(|| "prompt".into()),
        answer_key: d.answer_key.unwrap_or_else(|| "answer".into()),
        image_key: d.image_key.unwrap_or_else(|| "images".into()),
        max_prompt_length: d.max_prompt_length.unwrap_or(1024),
        filter_overlong: match overlong.as_str() {
            "filter" => true,
            "error" => false,
            other => {
                return Err(loc.bad(
                    "data.overlong_prompts",
                    format!("expected \"filter\" or \"error\", got \"{other}\""),
                ))
            }
        },
        enable_thinking: d.enable_thinking,
        shuffle: d.shuffle.unwrap_or(true),
    };

    let r = raw.rollout;
    let rollout = RolloutConfig {
        n_samples_per_prompt: r.n_samples_per_prompt.unwrap_or(8),
        max_new_tokens: r.max_new_tokens.unwrap_or(256),
        temperature: r.temperature.unwrap_or(1.0),
        top_p: r.top_p.unwrap_or(1.0),
        top_k: r.top_k.unwrap_or(0),
        min_p: r.min_p.unwrap_or(0.0),
        stop: r.stop.unwrap_or_default(),
    };
    if rollout.n_samples_per_prompt == 0 {
        return Err(loc.bad("rollout.n_samples_per_prompt", "expected at least 1"));
    }
    if rollout.max_new_tokens == 0 {
        return Err(loc.bad("rollout.max_new_tokens", "expected at least 1"));
    }
    if !(rollout.temperature > 0.0 && rollout.temperature.is_finite()) {
        return Err(loc.bad(
            "rollout.temperature",
            "expected a positive number (the trainer's log-probs divide by it)",
        ));
    }
    if !(rollout.top_p > 0.0 && rollout.top_p <= 1.0) {
        return Err(loc.bad("rollout.top_p", "expected a number in (0, 1]"));
    }
    if !(0.0..=1.0).contains(&rollout.min_p) {
        return Err(loc.bad("rollout.min_p", "expected a number in [0, 1]"));
    }

    let timeout_s = raw.reward.timeout_s.unwrap_or(10.0);
    if timeout_s.is_nan() || timeout_s <= 0.0 {
        return Err(loc.bad("reward.timeout_s", "expected a positive number of seconds"));
    }
    let mut functions = raw
        .reward
        .functions
        .iter()
        .enumerate()
        .map(|(i, f)| {
            resolve_function(f, &data.answer_key, timeout_s)
                .map_err(|b| loc.function_err(i, b.key, &b.message))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = raw.reward_model {
        let flat = RewardFunctionConfig {
            kind: "reward_model".into(),
            path: Some(path),
            ..Default::default()
        };
        functions.push(
            resolve_function(&flat, &data.answer_key, timeout_s)
                .map_err(|b| loc.bad("reward_model", b.message))?,
        );
    }
    for f in &mut functions {
        if let RewardKind::Model(spec) = &mut f.kind {
            spec.path = local_or_hub(std::mem::take(&mut spec.path));
        }
    }
    let reward = RewardConfig {
        functions,
        failure_score: raw.reward.failure_score.unwrap_or(0.0),
        timeout_s,
    };

    let a = match raw.algorithm {
        None => RawAlgorithm::default(),
        Some(toml::Value::String(name)) => preset(&name).ok_or_else(|| {
            loc.bad("algorithm", format!("unknown algorithm \"{name}\"; expected GRPO, DR_GRPO, RLOO, REINFORCE_BASELINE, GSPO or DAPO"))
        })?,
        Some(section) => section.try_into().map_err(|e: toml::de::Error| loc.bad("algorithm", e.message().trim()))?,
    };
    let name_err = |key: &str, e: oxrl_algo::UnknownName| loc.bad(key, e);
    let adv_name = a.advantage.unwrap_or_else(|| "grpo".into());
    let estimator =
        AdvantageEstimator::from_name(&adv_name).map_err(|e| name_err("algorithm.advantage", e))?;
    let loss_agg = LossAgg::from_name(a.loss_agg.as_deref().unwrap_or("token_mean"))
        .map_err(|e| name_err("algorithm.loss_agg", e))?;
    let kl_loss_agg = match a.kl_loss_agg {
        Some(n) => LossAgg::from_name(&n).map_err(|e| name_err("algorithm.kl_loss_agg", e))?,
        None => loss_agg,
    };
    let kind = PolicyLoss::from_name(a.policy_loss.as_deref().unwrap_or("ppo_clip"))
        .map_err(|e| name_err("algorithm.policy_loss", e))?;
    let kl_estimator = KlEstimator::from_name(a.kl_estimator.as_deref().unwrap_or("k3"))
        .map_err(|e| name_err("algorithm.kl_estimator", e))?;
    let old_logprobs = match a.old_logprobs.as_deref().unwrap_or("recompute") {
        "recompute" => OldLogprobs::Recompute,
        "rollout" => OldLogprobs::Rollout,
        other => {
            return Err(loc.bad(
                "algorithm.old_logprobs",
                format!("expected \"recompute\" or \"rollout\", got \"{other}\""),
            ))
        }
    };
    let non_negative = |key: &str, v: f64| -> Result<f64, ConfigError> {
        match v >= 0.0 && v.is_finite() {
            true => Ok(v),
            false => Err(loc.bad(key, format!("expected a non-negative number, got {v}"))),
        }
    };
    let algorithm = AlgorithmConfig {
        advantage: AdvantageConfig {
            estimator,
            norm_adv_by_std: a.norm_adv_by_std.unwrap_or(adv_name != "dr_grpo"),
            eps: non_negative("algorithm.adv_eps", a.adv_eps.unwrap_or(1e-6))?,
        },
        policy_loss: PolicyLossConfig {
            kind,
            clip_low: non_negative("algorithm.clip_low", a.clip_low.unwrap_or(0.2))?,
            clip_high: non_negative("algorithm.clip_high", a.clip_high.unwrap_or(0.2))?,
            dual_clip_c: match a.dual_clip_c {
                Some(c) if c <= 1.0 => {
                    return Err(loc.bad(
                        "algorithm.dual_clip_c",
                        format!("expected a number above 1 (about 3), got {c}"),
                    ))
                }
                c => c,
            },
        },
        kl_coef: non_negative("algorithm.kl_coef", a.kl_coef.unwrap_or(0.0))?,
        kl_estimator,
        loss_agg,
        kl_loss_agg,
        loss_scale_factor: match a.loss_scale_factor {
            Some(f) if f > 0.0 => f,
            Some(f) => {
                return Err(loc.bad(
                    "algorithm.loss_scale_factor",
                    format!("expected a positive number, got {f}"),
                ))
            }
            None => rollout.max_new_tokens as f64,
        },
        old_logprobs,
        entropy_coef: a.entropy_coef.unwrap_or(0.0),
    };

    let t = raw.trainer;
    let pick = |flat: Option<usize>,
                sectioned: Option<usize>,
                key: &str|
     -> Result<Option<usize>, ConfigError> {
        match (flat, sectioned) {
            (Some(_), Some(_)) => {
                Err(loc.bad(key, format!("given twice: as `{key}` and in [trainer]")))
            }
            (a, b) => Ok(a.or(b)),
        }
    };
    let batch_size = pick(raw.batch_size, t.batch_size, "batch_size")?.unwrap_or(8);
    let gas = pick(
        raw.gradient_accumulation_steps,
        t.gradient_accumulation_steps,
        "gradient_accumulation_steps",
    )?;
    let micro_batch_size = t.micro_batch_size.unwrap_or(8);
    for (key, v) in [
        ("trainer.batch_size", batch_size),
        ("trainer.micro_batch_size", micro_batch_size),
        ("trainer.gradient_accumulation_steps", gas.unwrap_or(1)),
    ] {
        if v == 0 {
            return Err(loc.bad(key, "expected at least 1"));
        }
    }
    let lr = t.lr.unwrap_or(1e-6);
    if !(lr > 0.0 && lr.is_finite()) {
        return Err(loc.bad(
            "trainer.lr",
            format!("expected a positive number, got {lr}"),
        ));
    }
    let betas = t.adam_betas.unwrap_or((0.9, 0.999));
    if !(0.0..1.0).contains(&betas.0) || !(0.0..1.0).contains(&betas.1) {
        return Err(loc.bad("trainer.adam_betas", "expected two numbers in [0, 1)"));
    }
    let schedule_name = t.lr_schedule.unwrap_or_else(|| "constant".into());
    let lr_schedule = match schedule_name.as_str() {
        "constant" => LrSchedule::Constant,
        "linear" => LrSchedule::Linear,
        "cosine" => LrSchedule::Cosine,
        other => {
            return Err(loc.bad(
                "trainer.lr_schedule",
                format!("expected one of {:?}, got \"{other}\"", LrSchedule::NAMES),
            ))
        }
    };
    let max_steps = t.max_steps.unwrap_or(100);
    let trajectories_per_step = batch_size * rollout.n_samples_per_prompt;
    let mini_batch_size = gas.map(|g| g * micro_batch_size);
    let optimizer_steps_per_step =
        mini_batch_size.map_or(1, |m| trajectories_per_step.div_ceil(m)) as u64;
    let ppo_epochs = t.ppo_epochs.unwrap_or(1);
    if ppo_epochs == 0 {
        return Err(loc.bad("trainer.ppo_epochs", "expected at least 1"));
    }
    let update = UpdateConfig {
        temperature: rollout.temperature,
        mini_batch_size,
        micro_batch_size,
        ppo_epochs,
        max_grad_norm: non_negative("trainer.max_grad_norm", t.max_grad_norm.unwrap_or(1.0))?,
        optimizer: AdamWConfig {
            lr,
            betas,
            eps: non_negative("trainer.adam_eps", t.adam_eps.unwrap_or(1e-8))?,
            weight_decay: non_negative("trainer.weight_decay", t.weight_decay.unwrap_or(0.01))?,
        },
        lr_schedule,
        warmup_steps: t.warmup_steps.unwrap_or(0),
        total_steps: max_steps * optimizer_steps_per_step * ppo_epochs as u64,
    };
    let stem = loc
        .path
        .file_stem()
        .map_or("run".into(), |s| s.to_string_lossy().to_string());
    Ok(RunConfig {
        source: loc.path.to_path_buf(),
        model_path: local_or_hub(model_path),
        dtype,
        device,
        max_staleness: t.max_staleness.unwrap_or(0),
        freeze_vision: raw.model.freeze_vision.unwrap_or(false),
        reference_path: raw.reference.path.map(local_or_hub),
        data,
        rollout,
        reward,
        algorithm,
        update,
        batch_size,
        max_steps,
        save_every: t.save_every.unwrap_or(0),
        eval_every: t.eval_every.unwrap_or(0),
        seed: t.seed.unwrap_or(42),
        output_dir: match t.output_dir {
            Some(d) => join_clean(&base, &d),
            None => PathBuf::from("runs").join(stem),
        },
        prometheus_port: raw.logging.prometheus_port,
    })
}

/// `oxrl config --explain`: every key with its default and meaning.
pub fn explain() -> String {
    let mut out = String::new();
    let mut section = "-";
    for d in KEYS {
        if d.section != section {
            section = d.section;
            out.push_str(&match section {
                "" => "\n# flat quick-start keys (top level)\n".to_string(),
                "reward.functions" => {
                    "\n[[reward.functions]]  (each type takes the keys its meaning names)\n"
                        .to_string()
                }
                s => format!("\n[{s}]\n"),
            });
        }
        out.push_str(&format!(
            "{:<28} default {:<28} {}\n",
            d.key, d.default, d.meaning
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RunConfig, ConfigError> {
        RunConfig::from_str(text, Path::new("dir/run.toml"))
    }

    #[test]
    fn sections_resolve_with_defaults() {
        let c = parse("[model]\npath = \"m\"\n[algorithm]\nclip_high = 0.28\nkl_coef = 0.01\n[trainer]\nlr = 2e-6\n").unwrap();
        assert_eq!(c.model_path, "m");
        assert_eq!(c.algorithm.policy_loss.clip_high, 0.28);
        assert_eq!(c.algorithm.kl_loss_agg, LossAgg::TokenMean);
        assert_eq!(c.algorithm.loss_scale_factor, 256.0);
        assert_eq!(c.update.optimizer.lr, 2e-6);
        assert_eq!(c.batch_size, 8);
        assert_eq!(c.output_dir, PathBuf::from("runs/run"));
    }

    #[test]
    fn flat_quick_start_keys_mean_what_they_say() {
        let c = parse("policy_model = \"m\"\nalgorithm = \"GRPO\"\nnum_gpus = 1\nbatch_size = 4\ngradient_accumulation_steps = 2\n[trainer]\nmicro_batch_size = 3\n").unwrap();
        assert_eq!(c.model_path, "m");
        assert_eq!(c.batch_size, 4);
        assert_eq!(
            c.update.mini_batch_size,
            Some(6),
            "2 micro-batches of 3 per optimizer step"
        );
        let dr = parse("policy_model = \"m\"\nalgorithm = \"DR_GRPO\"\n").unwrap();
        assert!(!dr.algorithm.advantage.norm_adv_by_std);
        assert_eq!(dr.algorithm.loss_agg, LossAgg::SeqMeanTokenSumNorm);
        let c = parse("policy_model = \"m\"\nreward_model = \"org/rm\"\n[[reward.functions]]\ntype = \"format\"\npattern = \"x\"\n").unwrap();
        let f = &c.reward.functions;
        assert_eq!(
            (f.len(), f[1].name.as_str(), f[1].weight),
            (2, "reward_model", 1.0)
        );
        let RewardKind::Model(spec) = &f[1].kind else {
            panic!("{:?}", f[1])
        };
        assert_eq!(spec.path, "org/rm");
        assert_eq!(spec.normalize, oxrl_reward::Normalize::None);
    }

    #[test]
    fn unknown_keys_name_file_line_and_the_closest_key() {
        let e = parse("[model]\npath = \"m\"\n\n[trainer]\nlearning_rate = 1\nlr = 1e-5\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("dir/run.toml:5:") && e.contains("trainer.learning_rate"),
            "{e}"
        );
        let e = parse("[model]\npath = \"m\"\n[algorithm]\nclip_hihg = 0.3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `clip_high`"), "{e}");
        let e = parse("[modle]\npath = \"m\"\n").unwrap_err().to_string();
        assert!(
            e.starts_with("dir/run.toml:1:") && e.contains("did you mean `model`"),
            "{e}"
        );
        let e = parse("lr = 1\n[model]\npath = \"m\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`lr` in [trainer]"), "{e}");
        let e = parse(
            "[model]\npath = \"m\"\n[[reward.functions]]\ntype = \"format\"\npatern = \"x\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("dir/run.toml:5:") && e.contains("pattern"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_name_the_key_and_what_was_expected() {
        let cases = [
            ("[trainer]\nlr = \"fast\"\n", "dir/run.toml:3:"),
            ("[algorithm]\nadvantage = \"gae\"\n", "algorithm.advantage"),
            ("[algorithm]\nloss_agg = \"mean\"\n", "token_mean"),
            ("[rollout]\ntemperature = 0\n", "rollout.temperature"),
            ("[trainer]\nlr_schedule = \"step\"\n", "cosine"),
            ("[algorithm]\ndual_clip_c = 0.5\n", "dual_clip_c"),
            ("[model]\ndtype = \"f64\"\n", "model.dtype"),
            ("algorithm = \"PPO2\"\n", "GRPO"),
        ];
        for (text, want) in cases {
            let e = parse(&format!("policy_model = \"m\"\n{text}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let e = parse("[trainer]\nlr = 1e-6\n").unwrap_err().to_string();
        assert!(e.contains("model.path"), "{e}");
    }

    #[test]
    fn relative_paths_are_relative_to_the_config_file() {
        let c = RunConfig::from_str(
            "policy_model = \"m\"\n[data]\ntrain_files = [\"d/a.jsonl\", \"../b.jsonl\"]\n[trainer]\noutput_dir = \"../../runs/x\"\n",
            Path::new("examples/demo/run.toml"),
        )
        .unwrap();
        assert_eq!(
            c.data.train_files,
            vec![
                PathBuf::from("examples/demo/d/a.jsonl"),
                PathBuf::from("examples/b.jsonl")
            ]
        );
        assert_eq!(c.output_dir, PathBuf::from("runs/x"));
    }

    #[test]
    fn code_and_http_functions_resolve_with_defaults_and_weights() {
        let c = parse(
            "policy_model = \"m\"\n[reward]\ntimeout_s = 30\n[[reward.functions]]\ntype = \"math_answer\"\nweight = 0.5\n[[reward.functions]]\ntype = \"code\"\nname = \"tests\"\nweight = 2.0\nscoring = \"all\"\nworkers = 3\nmemory_mb = 256\n[[reward.functions]]\ntype = \"http\"\nurl = \"http://127.0.0.1:8000/score\"\nbatch_size = 4\n",
        )
        .unwrap();
        let f = &c.reward.functions;
        assert_eq!(
            (
                f[0].name.as_str(),
                f[0].weight,
                f[1].name.as_str(),
                f[1].weight
            ),
            ("math_answer", 0.5, "tests", 2.0)
        );
        let RewardKind::Code(code) = &f[1].kind else {
            panic!("{:?}", f[1])
        };
        assert_eq!(code.scoring, oxrl_reward::Scoring::All);
        assert_eq!(
            (code.workers, code.limits.memory_mb, code.limits.cpu_s),
            (3, 256, 5)
        );
        assert_eq!(code.command, ["python3", "-I", "-B", "{file}"]);
        let RewardKind::Http(http) = &f[2].kind else {
            panic!("{:?}", f[2])
        };
        assert_eq!(
            (http.batch_size, http.max_retries, http.max_concurrency),
            (4, 2, 4)
        );
    }

    #[test]
    fn function_tables_are_checked_per_type_with_lines() {
        let cases = [
            // A key of another type, at its own line.
            (
                "[[reward.functions]]\ntype = \"code\"\nurl = \"http://x\"\n",
                "dir/run.toml:4:",
                "does not apply to type \"code\"",
            ),
            (
                "[[reward.functions]]\ntype = \"cod\"\n",
                "dir/run.toml:3:",
                "did you mean \"code\"",
            ),
            (
                "[[reward.functions]]\nname = \"x\"\n",
                "dir/run.toml:3:",
                "needs a `type`",
            ),
            (
                "[[reward.functions]]\ntype = \"http\"\n",
                "dir/run.toml:3:",
                "needs a `url`",
            ),
            (
                "[[reward.functions]]\ntype = \"http\"\nurl = \"ftp://x\"\n",
                "dir/run.toml:4:",
                "http://",
            ),
            (
                "[[reward.functions]]\ntype = \"code\"\nscoring = \"most\"\n",
                "dir/run.toml:4:",
                "\"fraction\" or \"all\"",
            ),
            (
                "[[reward.functions]]\ntype = \"code\"\nlanguage = \"bash\"\n",
                "dir/run.toml:3:",
                "needs a command",
            ),
            (
                "[[reward.functions]]\ntype = \"code\"\ncommand = [\"python3\"]\n",
                "dir/run.toml:4:",
                "{file}",
            ),
            (
                "[[reward.functions]]\ntype = \"code\"\ntimeout_s = 20\n",
                "dir/run.toml:4:",
                "reward.timeout_s",
            ),
            (
                "[[reward.functions]]\ntype = \"http\"\nurl = \"http://x\"\ntimeout_s = 4\n",
                "dir/run.toml:5:",
                "12.75 s",
            ),
            (
                "[[reward.functions]]\ntype = \"regex_match\"\npattern = \"(\"\n",
                "dir/run.toml:4:",
                "regex",
            ),
            (
                "[[reward.functions]]\ntype = \"code\"\nworkers = 0\n",
                "dir/run.toml:4:",
                "at least 1",
            ),
        ];
        for (table, at, want) in cases {
            let e = parse(&format!("policy_model = \"m\"\n{table}"))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(at) && e.contains(want), "{table}: {e}");
        }
    }

    #[test]
    fn every_function_key_is_documented() {
        for k in REWARD_FUNCTION_KEYS {
            assert!(
                KEYS.iter()
                    .any(|d| d.section == "reward.functions" && d.key == *k),
                "{k}"
            );
        }
        for d in KEYS.iter().filter(|d| d.section == "reward.functions") {
            assert!(REWARD_FUNCTION_KEYS.contains(&d.key), "{}", d.key);
        }
    }

    #[test]
    fn explain_lists_every_key() {
        let text = explain();
        for d in KEYS {
            assert!(text.contains(d.key), "{}", d.key);
        }
    }
}
