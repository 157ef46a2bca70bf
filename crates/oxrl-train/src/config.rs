//! The run configuration: one TOML file whose sections follow the loop (`[model]`,
//! `[reference]`, `[data]`, `[rollout]`, `[reward]`, `[algorithm]`, `[trainer]`, `[logging]`),
//! plus the flat quick-start keys of SkyRL-style deployments (`policy_model`, `reward_model`,
//! `algorithm = "GRPO"`, `num_gpus`, `batch_size`, `gradient_accumulation_steps`).
//!
//! Every key is checked before any model loads: an unknown key or a bad value is an error that
//! names the file, the line, the key and what was expected (and the closest valid key). Each
//! key's kind, default and meaning are declared once, in [`crate::config_keys::KEYS`]; this
//! module reads the checked values into the types the trainer runs on and checks what relates
//! keys to each other.

pub use crate::config_file::ConfigError;
use crate::config_file::Given;
pub use crate::config_keys::{explain, markdown, KeySpec, KEYS};
use crate::config_keys::{LR_SCHEDULES, OLD_LOGPROBS};
use crate::critic::CriticConfig;
use crate::optim::AdamWConfig;
use crate::reward_config::{resolve_function, FunctionTable};
pub use crate::reward_config::{RewardFunction, RewardKind};
use crate::update::{AlgorithmConfig, UpdateConfig};
use oxrl_algo::kl_reward::{KlControl, KlInReward};
use oxrl_algo::rollout_corr::{IsConfig, RejectRule, RolloutCorrectionConfig};
use oxrl_algo::{
    AdvantageConfig, AdvantageEstimator, KlEstimator, LossAgg, PolicyLoss, PolicyLossConfig,
};
use oxrl_models::{DeviceSpec, LoraConfig, LoraInit, LORA_TARGETS};
use oxrl_rollout::{VllmSpec, WeightSync};
use std::path::{Path, PathBuf};

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
    /// `None`: the local engine; `Some`: vLLM servers.
    pub vllm: Option<oxrl_rollout::VllmSpec>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RewardConfig {
    pub functions: Vec<RewardFunction>,
    pub failure_score: f64,
    pub timeout_s: f64,
}

/// The environment of multi-turn episodes (`[environment]`).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvironmentConfig {
    pub kind: EnvironmentKind,
    pub max_turns: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum EnvironmentKind {
    /// Tools by name, and the column the final answer is checked against.
    Tools {
        tools: Vec<String>,
        answer_key: String,
    },
    Http(oxrl_env::HttpEnvSpec),
}

/// DAPO's sampling-side settings (`[algorithm]`): the soft overlong punishment and dynamic
/// sampling.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicSampling {
    /// Tokens before `max_new_tokens` where the punishment starts (0: none).
    pub overlong_buffer_len: usize,
    pub overlong_penalty_factor: f64,
    pub filter_groups: bool,
    pub max_sample_batches: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The file the config came from; relative paths in it are relative to its directory.
    pub source: PathBuf,
    /// The TOML text the config was read from (with an `oxrl sweep` point's overrides), which
    /// the run directory keeps.
    pub source_text: String,
    pub model_path: String,
    pub dtype: String,
    /// Where the policy and reference run and train.
    pub device: DeviceSpec,
    /// Weight versions a sampled trajectory may lag the trainer's.
    pub max_staleness: u64,
    /// `[trainer] async = "one_step"`: sample the next batch while the trainer learns.
    pub one_step_async: bool,
    /// Qwen3-VL: the vision tower's weights stay fixed.
    pub freeze_vision: bool,
    /// Recompute each decoder layer in the backward instead of keeping its activations.
    pub gradient_checkpointing: bool,
    /// Data-parallel runs: 2 shards the optimizer state and gradients (ZeRO-2), 0 does not.
    pub zero_stage: u8,
    /// `[model.lora]`: train LoRA adapters instead of every weight (when `rank` is set).
    pub lora: Option<LoraConfig>,
    pub reference_path: Option<String>,
    /// PPO's critic (`advantage = "gae"`); its path as given, resolved like `[model] path`.
    pub critic: Option<CriticConfig>,
    /// `[environment]`: multi-turn episodes instead of one generation per trajectory.
    pub environment: Option<EnvironmentConfig>,
    pub data: DataConfig,
    pub rollout: RolloutConfig,
    pub reward: RewardConfig,
    pub algorithm: AlgorithmConfig,
    /// DAPO's reward shaping and group filtering while sampling.
    pub dynamic_sampling: DynamicSampling,
    pub update: UpdateConfig,
    pub batch_size: usize,
    /// The quick-start `num_gpus`: the processes (one per GPU) a launcher must start; checked
    /// against the launcher's world size.
    pub num_gpus: Option<usize>,
    pub max_steps: u64,
    pub save_every: u64,
    pub eval_every: u64,
    pub seed: u64,
    pub output_dir: PathBuf,
    pub prometheus_port: Option<u16>,
    /// The address `/metrics` listens on: loopback unless the run says otherwise.
    pub prometheus_host: String,
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

fn resolve_paths(base: &Path, files: Option<Vec<String>>) -> Vec<PathBuf> {
    files
        .unwrap_or_default()
        .into_iter()
        .map(|f| join_clean(base, &f))
        .collect()
}

impl RunConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_str(&text, path)
    }

    /// Parses and validates `text`, the contents of `path`.
    pub fn from_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        resolve(&Given::read(text, path)?)
    }
}

/// The `oxrl-algo` registry entry a checked key names (`from_name` cannot fail once the
/// catalogue's check has passed, but a failure is still an error with a line, never a panic).
fn entry<T>(
    given: &Given,
    dotted: &str,
    from_name: fn(&str) -> Result<T, oxrl_algo::UnknownName>,
) -> Result<T, ConfigError> {
    from_name(&given.value::<String>(dotted)).map_err(|e| given.bad(dotted, e))
}

/// The vLLM servers of `[rollout] backend = "vllm"`: at least one URL; `sync = "none"` only
/// with a staleness allowance (its samples never leave the start weights).
fn vllm_spec(given: &Given, base: &Path) -> Result<VllmSpec, ConfigError> {
    let server_urls: Vec<String> = given.value("rollout.server_urls");
    if server_urls.is_empty() {
        return Err(given.bad(
            "rollout.server_urls",
            "backend = \"vllm\" needs at least one server URL (http://host:port)",
        ));
    }
    if let Some(bad) = server_urls
        .iter()
        .find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
    {
        return Err(given.bad(
            "rollout.server_urls",
            format!("expected http://host:port, got \"{bad}\""),
        ));
    }
    let sync_name: String = given.value("rollout.sync");
    let sync = WeightSync::from_name(&sync_name)
        .ok_or_else(|| given.bad("rollout.sync", format!("unknown value \"{sync_name}\"")))?;
    if sync == WeightSync::Nccl && !cfg!(feature = "cuda") {
        return Err(given.bad(
            "rollout.sync",
            "sync = \"nccl\" broadcasts the weights from the trainer's GPU, and this oxrl was \
             built without CUDA (cargo build --release --features cuda): use sync = \"disk\"",
        ));
    }
    if sync == WeightSync::None && given.value::<u64>("trainer.max_staleness") == 0 {
        return Err(given.bad(
            "rollout.sync",
            "sync = \"none\" keeps sampling from the start weights, so every later sample is \
             stale: set [trainer] max_staleness to the lag you accept",
        ));
    }
    Ok(VllmSpec {
        server_urls,
        sync,
        sync_dir: given
            .get::<String>("rollout.sync_dir")
            .map(|d| join_clean(base, &d)),
        timeout: std::time::Duration::from_secs_f64(given.value("rollout.request_timeout_s")),
        max_retries: given.value("rollout.max_retries"),
        backoff: std::time::Duration::from_millis(500),
    })
}

/// The value a checked key names in a `(name, meaning, value)` table of the catalogue.
fn choice<T: Copy>(
    given: &Given,
    dotted: &str,
    table: &[(&str, &str, T)],
) -> Result<T, ConfigError> {
    let name: String = given.value(dotted);
    table
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, v)| *v)
        .ok_or_else(|| given.bad(dotted, format!("unknown value \"{name}\"")))
}

/// `[model.lora]`, when `rank` is set: the adapters' configuration, checked.
fn lora(given: &Given) -> Result<Option<LoraConfig>, ConfigError> {
    let Some(rank) = given.get::<usize>("model.lora.rank") else {
        for key in ["alpha", "dropout", "target_modules", "init", "use_rslora"] {
            let dotted = format!("model.lora.{key}");
            if given.is_set(&dotted) {
                return Err(given.bad(&dotted, "has no effect without [model.lora] rank"));
            }
        }
        return Ok(None);
    };
    let spec: Vec<String> = given.value("model.lora.target_modules");
    let targets = match spec.as_slice() {
        [all] if all == "all-linear" => LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
        _ => spec,
    };
    let config = LoraConfig {
        rank,
        alpha: given.value("model.lora.alpha"),
        dropout: given.value("model.lora.dropout"),
        targets,
        init: choice(
            given,
            "model.lora.init",
            &[
                ("kaiming", "", LoraInit::Kaiming),
                ("gaussian", "", LoraInit::Gaussian),
            ],
        )?,
        rslora: given.value("model.lora.use_rslora"),
    };
    if config.dropout >= 1.0 {
        return Err(given.bad(
            "model.lora.dropout",
            "must be below 1 (1 would drop every input)",
        ));
    }
    if let Err(e) = config.validate() {
        return Err(given.bad("model.lora.target_modules", e));
    }
    Ok(Some(config))
}

fn resolve(given: &Given) -> Result<RunConfig, ConfigError> {
    let base = given.path.parent().unwrap_or(Path::new(".")).to_path_buf();
    let model_path =
        match (
            given.get::<String>("model.path"),
            given.get::<String>("policy_model"),
        ) {
            (Some(_), Some(_)) => {
                return Err(given.bad(
                    "policy_model",
                    "give either [model] path or policy_model, not both",
                ))
            }
            (Some(p), None) | (None, Some(p)) => p,
            (None, None) => return Err(given.bad(
                "model.path",
                "the policy model is required ([model] path = \"...\" or policy_model = \"...\")",
            )),
        };
    let local_or_hub = |p: String| match base.join(&p).exists() {
        true => join_clean(&base, &p).display().to_string(),
        false => p,
    };

    let data = DataConfig {
        train_files: resolve_paths(&base, given.get("data.train_files")),
        val_files: resolve_paths(&base, given.get("data.val_files")),
        prompt_key: given.value("data.prompt_key"),
        answer_key: given.value("data.answer_key"),
        image_key: given.value("data.image_key"),
        max_prompt_length: given.value("data.max_prompt_length"),
        filter_overlong: given.value::<String>("data.overlong_prompts") == "filter",
        enable_thinking: given.get("data.enable_thinking"),
        shuffle: given.value("data.shuffle"),
    };

    let zero_stage = given.value::<u32>("trainer.zero_stage") as u8;
    if zero_stage == 1 {
        return Err(given.bad(
            "trainer.zero_stage",
            "1 is not offered: 2 splits the optimizer state as 1 would, and the gradients too; use 0 or 2",
        ));
    }

    let stem = given
        .path
        .file_stem()
        .map_or("run".into(), |s| s.to_string_lossy().to_string());
    let output_dir = match given.get::<String>("trainer.output_dir") {
        Some(d) => join_clean(&base, &d),
        None => PathBuf::from("runs").join(&stem),
    };
    let vllm = match given.value::<String>("rollout.backend").as_str() {
        "vllm" => Some(vllm_spec(given, &base)?),
        _ => None,
    };
    let rollout = RolloutConfig {
        n_samples_per_prompt: given.value("rollout.n_samples_per_prompt"),
        max_new_tokens: given.value("rollout.max_new_tokens"),
        temperature: given.value("rollout.temperature"),
        top_p: given.value("rollout.top_p"),
        top_k: given.value("rollout.top_k"),
        min_p: given.value("rollout.min_p"),
        stop: given.value("rollout.stop"),
        vllm,
    };

    let timeout_s: f64 = given.value("reward.timeout_s");
    let mut functions = given
        .functions
        .iter()
        .enumerate()
        .map(|(i, f)| {
            resolve_function(f, &data.answer_key, timeout_s)
                .map_err(|b| given.function_err(i, b.key, &b.message))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = given.get::<String>("reward_model") {
        let flat = FunctionTable::new(
            "reward_model".into(),
            toml::Table::from_iter([("path".to_string(), toml::Value::String(path))]),
        );
        functions.push(
            resolve_function(&flat, &data.answer_key, timeout_s)
                .map_err(|b| given.bad("reward_model", b.message))?,
        );
    }
    // Each function's metrics (`reward/<name>`, its failures and latency) are keyed by name.
    for (i, f) in functions.iter().enumerate() {
        if functions[..i].iter().any(|g| g.name == f.name) {
            let message = format!(
                "a second reward function named \"{}\"; give each its own `name`",
                f.name
            );
            return Err(given.function_err(i, "name", &message));
        }
    }
    for f in &mut functions {
        if let RewardKind::Model(spec) = &mut f.kind {
            spec.path = local_or_hub(std::mem::take(&mut spec.path));
        }
    }
    let reward = RewardConfig {
        functions,
        failure_score: given.value("reward.failure_score"),
        timeout_s,
    };

    let estimator = entry(given, "algorithm.advantage", AdvantageEstimator::from_name)?;
    let loss_agg = entry(given, "algorithm.loss_agg", LossAgg::from_name)?;
    let rollout_correction = rollout_correction(given)?;
    let kl_estimator = match given.is_set("algorithm.kl_estimator") {
        true => entry(given, "algorithm.kl_estimator", KlEstimator::from_name)?,
        // verl's defaults: k1 in the reward (`kl_penalty = "kl"`), k3 as a loss term.
        false if given.value::<bool>("algorithm.use_kl_in_reward") => KlEstimator::K1,
        false => KlEstimator::K3,
    };
    let algorithm = AlgorithmConfig {
        advantage: AdvantageConfig {
            estimator,
            norm_adv_by_std: given
                .get("algorithm.norm_adv_by_std")
                .unwrap_or(estimator.norm_adv_by_std_default()),
            eps: given.value("algorithm.adv_eps"),
            gamma: given.value("algorithm.gamma"),
            lam: given.value("algorithm.lam"),
        },
        policy_loss: PolicyLossConfig {
            kind: entry(given, "algorithm.policy_loss", PolicyLoss::from_name)?,
            clip_low: given.value("algorithm.clip_low"),
            clip_high: given.value("algorithm.clip_high"),
            dual_clip_c: given.get("algorithm.dual_clip_c"),
            tau_pos: given.value("algorithm.tau_pos"),
            tau_neg: given.value("algorithm.tau_neg"),
        },
        kl_coef: given.value("algorithm.kl_coef"),
        kl_estimator,
        loss_agg,
        kl_loss_agg: match given.is_set("algorithm.kl_loss_agg") {
            true => entry(given, "algorithm.kl_loss_agg", LossAgg::from_name)?,
            false => loss_agg,
        },
        loss_scale_factor: given
            .get("algorithm.loss_scale_factor")
            .unwrap_or(rollout.max_new_tokens as f64),
        old_logprobs: choice(given, "algorithm.old_logprobs", OLD_LOGPROBS)?,
        entropy_coef: given.value("algorithm.entropy_coef"),
        overlong_filter: given.value("algorithm.overlong_filter"),
        rollout_correction,
        kl_in_reward: kl_in_reward(given, kl_estimator)?,
    };
    let dynamic_sampling = DynamicSampling {
        overlong_buffer_len: given.value("algorithm.overlong_buffer_len"),
        overlong_penalty_factor: given.value("algorithm.overlong_penalty_factor"),
        filter_groups: given.value("algorithm.filter_groups"),
        max_sample_batches: given.value("algorithm.max_sample_batches"),
    };

    // The flat quick-start keys are the [trainer] ones under another name: one or the other.
    let pick = |flat: &str| -> Result<Option<usize>, ConfigError> {
        let sectioned = format!("trainer.{flat}");
        match (given.is_set(flat), given.is_set(&sectioned)) {
            (true, true) => {
                Err(given.bad(flat, format!("given twice: as `{flat}` and in [trainer]")))
            }
            (true, false) => Ok(given.get(flat)),
            (false, _) => Ok(given.get(&sectioned)),
        }
    };
    let batch_size = pick("batch_size")?.unwrap_or_else(|| given.value("trainer.batch_size"));
    let gas = pick("gradient_accumulation_steps")?;
    let micro_batch_size: usize = given.value("trainer.micro_batch_size");
    let lr_schedule = choice(given, "trainer.lr_schedule", LR_SCHEDULES)?;
    let max_steps: u64 = given.value("trainer.max_steps");
    let trajectories_per_step = batch_size * rollout.n_samples_per_prompt;
    let mini_batch_size = gas.map(|g| g * micro_batch_size);
    let optimizer_steps_per_step =
        mini_batch_size.map_or(1, |m| trajectories_per_step.div_ceil(m)) as u64;
    let ppo_epochs: usize = given.value("trainer.ppo_epochs");
    let update = UpdateConfig {
        temperature: rollout.temperature,
        mini_batch_size,
        micro_batch_size,
        ppo_epochs,
        max_grad_norm: given.value("trainer.max_grad_norm"),
        optimizer: AdamWConfig {
            lr: given.value("trainer.lr"),
            betas: given.value("trainer.adam_betas"),
            eps: given.value("trainer.adam_eps"),
            weight_decay: given.value("trainer.weight_decay"),
        },
        lr_schedule,
        warmup_steps: given.value("trainer.warmup_steps"),
        total_steps: max_steps * optimizer_steps_per_step * ppo_epochs as u64,
    };
    let critic = critic(given, estimator, &update, &model_path)?.map(|c| CriticConfig {
        path: local_or_hub(c.path.clone()),
        ..c
    });
    let device = given
        .value::<String>("model.device")
        .parse::<DeviceSpec>()
        .map_err(|e| given.bad("model.device", e))?;
    Ok(RunConfig {
        source: given.path.to_path_buf(),
        source_text: given.text.to_string(),
        model_path: local_or_hub(model_path),
        dtype: given.value("model.dtype"),
        device,
        max_staleness: given.value("trainer.max_staleness"),
        one_step_async: given.value::<String>("trainer.async") == "one_step",
        freeze_vision: given.value("model.freeze_vision"),
        gradient_checkpointing: given.value("trainer.gradient_checkpointing"),
        zero_stage,
        lora: lora(given)?,
        reference_path: given.get("reference.path").map(local_or_hub),
        critic,
        environment: environment(given, &data.answer_key)?,
        data,
        rollout,
        reward,
        algorithm,
        dynamic_sampling,
        update,
        batch_size,
        num_gpus: given.get::<u32>("num_gpus").map(|n| n as usize),
        max_steps,
        save_every: given.value("trainer.save_every"),
        eval_every: given.value("trainer.eval_every"),
        seed: given.value("trainer.seed"),
        output_dir,
        prometheus_port: given.get("logging.prometheus_port"),
        prometheus_host: given.value("logging.prometheus_host"),
    })
}

/// `[environment]`, or `None` without a `type`. Its keys are checked against the type, and an
/// environment scores the episodes, so `[[reward.functions]]` are refused beside it.
fn environment(given: &Given, answer_key: &str) -> Result<Option<EnvironmentConfig>, ConfigError> {
    const KEYS: [&str; 5] = ["max_turns", "tools", "answer_key", "url", "timeout_s"];
    let Some(kind) = given.get::<String>("environment.type") else {
        if let Some(key) = KEYS
            .iter()
            .find(|k| given.is_set(&format!("environment.{k}")))
        {
            return Err(given.bad(
                &format!("environment.{key}"),
                "has no effect without [environment] type",
            ));
        }
        return Ok(None);
    };
    if !given.functions.is_empty() {
        return Err(given.bad(
            "environment.type",
            "the environment scores the episodes; remove the [[reward.functions]] tables",
        ));
    }
    let only = |keys: &[&str], of: &str| -> Result<(), ConfigError> {
        match keys
            .iter()
            .find(|k| given.is_set(&format!("environment.{k}")))
        {
            Some(k) => Err(given.bad(
                &format!("environment.{k}"),
                format!("has no effect with type = \"{of}\""),
            )),
            None => Ok(()),
        }
    };
    let kind = match kind.as_str() {
        "tools" => {
            only(&["url", "timeout_s"], "tools")?;
            let tools: Vec<String> = given.value("environment.tools");
            if let Some(bad) = tools
                .iter()
                .find(|t| oxrl_env::Tool::from_name(t).is_none())
            {
                return Err(given.bad(
                    "environment.tools",
                    format!(
                        "unknown tool `{bad}`; expected some of {}",
                        oxrl_env::Tool::NAMES.join(", ")
                    ),
                ));
            }
            EnvironmentKind::Tools {
                tools,
                answer_key: given
                    .get("environment.answer_key")
                    .unwrap_or_else(|| answer_key.to_string()),
            }
        }
        _ => {
            only(&["tools", "answer_key"], "http")?;
            let url: String = given
                .get("environment.url")
                .ok_or_else(|| given.bad("environment.type", "type = \"http\" needs url"))?;
            EnvironmentKind::Http(oxrl_env::HttpEnvSpec {
                url,
                timeout: std::time::Duration::from_secs_f64(given.value("environment.timeout_s")),
            })
        }
    };
    Ok(Some(EnvironmentConfig {
        kind,
        max_turns: given.value("environment.max_turns"),
    }))
}

/// `[algorithm] use_kl_in_reward` and its controller, or `None` (a KL loss term, if any).
fn kl_in_reward(given: &Given, estimator: KlEstimator) -> Result<Option<KlInReward>, ConfigError> {
    if !given.value::<bool>("algorithm.use_kl_in_reward") {
        for key in ["kl_ctrl", "kl_target", "kl_horizon"] {
            let dotted = format!("algorithm.{key}");
            if given.is_set(&dotted) {
                return Err(given.bad(&dotted, "has no effect without use_kl_in_reward = true"));
            }
        }
        return Ok(None);
    }
    let coef: f64 = given.value("algorithm.kl_coef");
    if coef <= 0.0 {
        return Err(given.bad(
            "algorithm.use_kl_in_reward",
            "needs kl_coef > 0 (the penalty's starting beta, and what loads the reference model)",
        ));
    }
    let adaptive = choice(
        given,
        "algorithm.kl_ctrl",
        &[("fixed", "", false), ("adaptive", "", true)],
    )?;
    let control = match adaptive {
        false => {
            for key in ["kl_target", "kl_horizon"] {
                let dotted = format!("algorithm.{key}");
                if given.is_set(&dotted) {
                    return Err(given.bad(&dotted, "has no effect unless kl_ctrl = \"adaptive\""));
                }
            }
            KlControl::Fixed
        }
        true => KlControl::Adaptive {
            target: given.value("algorithm.kl_target"),
            horizon: given.value::<u64>("algorithm.kl_horizon") as f64,
        },
    };
    Ok(Some(KlInReward {
        coef,
        control,
        estimator,
    }))
}

/// `[critic]`: PPO's value model, there exactly when the estimator bootstraps from values
/// (`gae`). Unset keys follow the policy's (`[trainer]`) settings.
fn critic(
    given: &Given,
    estimator: AdvantageEstimator,
    update: &UpdateConfig,
    model_path: &str,
) -> Result<Option<CriticConfig>, ConfigError> {
    const KEYS: [&str; 9] = [
        "path",
        "lr",
        "value_clip",
        "ppo_epochs",
        "mini_batch_size",
        "micro_batch_size",
        "max_grad_norm",
        "loss_agg",
        "warmup_steps",
    ];
    if !estimator.needs_values() {
        if let Some(key) = KEYS.iter().find(|k| given.is_set(&format!("critic.{k}"))) {
            return Err(given.bad(
                &format!("critic.{key}"),
                format!(
                    "has no effect: advantage = \"{}\" has no critic (set advantage = \"gae\" for PPO with a critic)",
                    oxrl_algo::Registered::name(estimator)
                ),
            ));
        }
        return Ok(None);
    }
    let clip: f64 = given.value("critic.value_clip");
    Ok(Some(CriticConfig {
        path: given
            .get::<String>("critic.path")
            .unwrap_or_else(|| model_path.to_string()),
        optimizer: AdamWConfig {
            lr: given.value("critic.lr"),
            ..update.optimizer
        },
        value_clip: (clip > 0.0).then_some(clip),
        ppo_epochs: given.get("critic.ppo_epochs").unwrap_or(update.ppo_epochs),
        mini_batch_size: given
            .get("critic.mini_batch_size")
            .or(update.mini_batch_size),
        micro_batch_size: given
            .get("critic.micro_batch_size")
            .unwrap_or(update.micro_batch_size),
        max_grad_norm: given.value("critic.max_grad_norm"),
        loss_agg: entry(given, "critic.loss_agg", LossAgg::from_name)?,
        warmup_steps: given.value("critic.warmup_steps"),
    }))
}

/// `[algorithm] rollout_is*` and `rollout_rs*`: rollout correction, or `None` when neither is set.
fn rollout_correction(given: &Given) -> Result<Option<RolloutCorrectionConfig>, ConfigError> {
    let fmt = |x: f64| format!("{x}");
    let is = match given.get::<String>("algorithm.rollout_is") {
        None => None,
        Some(level) => {
            let upper: f64 = given.value("algorithm.rollout_is_threshold");
            let threshold = match given.get::<f64>("algorithm.rollout_is_threshold_lower") {
                Some(lower) => format!("{}_{}", fmt(lower), fmt(upper)),
                None => fmt(upper),
            };
            Some(
                IsConfig::parse(&level, &threshold)
                    .map_err(|e| given.bad("algorithm.rollout_is", e))?,
            )
        }
    };
    let names: Vec<String> = given.get("algorithm.rollout_rs").unwrap_or_default();
    let mut rules = Vec::new();
    if !names.is_empty() {
        let upper = given
            .get::<f64>("algorithm.rollout_rs_threshold")
            .ok_or_else(|| {
                given.bad(
                    "algorithm.rollout_rs",
                    "needs rollout_rs_threshold (its bound)",
                )
            })?;
        let lower = given.get::<f64>("algorithm.rollout_rs_threshold_lower");
        for name in &names {
            let threshold = match (lower, name.ends_with("k1")) {
                (Some(lower), true) => format!("{}_{}", fmt(lower), fmt(upper)),
                _ => fmt(upper),
            };
            rules.push(
                RejectRule::parse(name, &threshold)
                    .map_err(|e| given.bad("algorithm.rollout_rs", e))?,
            );
        }
    }
    Ok((is.is_some() || !rules.is_empty()).then_some(RolloutCorrectionConfig { is, rules }))
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
    fn vllm_sync_modes_this_build_cannot_honour_are_refused_at_load() {
        let vllm = "[model]\npath = \"m\"\n[rollout]\nbackend = \"vllm\"\nserver_urls = [\"http://h:1\"]\n";
        let disk = parse(vllm).unwrap().rollout.vllm.unwrap();
        assert_eq!(disk.sync, WeightSync::Disk);
        let nccl = parse(&format!("{vllm}sync = \"nccl\"\n"));
        if cfg!(feature = "cuda") {
            assert_eq!(nccl.unwrap().rollout.vllm.unwrap().sync, WeightSync::Nccl);
        } else {
            let e = nccl.unwrap_err().to_string();
            assert!(
                e.contains("rollout.sync") && e.contains("--features cuda"),
                "{e}"
            );
        }
        let none = parse(&format!("{vllm}sync = \"none\"\n"))
            .unwrap_err()
            .to_string();
        assert!(none.contains("max_staleness"), "{none}");
    }

    #[test]
    fn gae_brings_a_critic_whose_unset_keys_follow_the_trainer() {
        let c = parse(
            "algorithm = \"PPO\"\n[model]\npath = \"m\"\n[trainer]\nppo_epochs = 2\nmicro_batch_size = 3\n[critic]\nlr = 2e-5\nvalue_clip = 0\n",
        )
        .unwrap();
        let critic = c.critic.unwrap();
        assert_eq!(critic.path, "m");
        assert_eq!(critic.optimizer.lr, 2e-5);
        assert_eq!(
            critic.optimizer.weight_decay,
            c.update.optimizer.weight_decay
        );
        assert_eq!((critic.ppo_epochs, critic.micro_batch_size), (2, 3));
        assert_eq!(critic.value_clip, None, "0 turns the clip off");
        assert_eq!(c.algorithm.advantage.estimator, AdvantageEstimator::Gae);
        let plain = parse("[model]\npath = \"m\"\n[algorithm]\nadvantage = \"gae\"\n").unwrap();
        assert_eq!(plain.critic.unwrap().value_clip, Some(0.5));
        let e = parse("[model]\npath = \"m\"\n[critic]\nlr = 1e-5\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("dir/run.toml:4:") && e.contains("critic.lr") && e.contains("\"gae\""),
            "{e}"
        );
    }

    #[test]
    fn an_environment_replaces_the_reward_functions_and_checks_its_keys() {
        let c = parse(
            "[model]\npath = \"m\"\n[data]\nanswer_key = \"solution\"\n[environment]\ntype = \"tools\"\ntools = [\"calculator\", \"python\"]\nmax_turns = 2\n",
        )
        .unwrap();
        let env = c.environment.unwrap();
        assert_eq!(env.max_turns, 2);
        assert_eq!(
            env.kind,
            EnvironmentKind::Tools {
                tools: vec!["calculator".into(), "python".into()],
                answer_key: "solution".into()
            }
        );
        let http =
            parse("[model]\npath = \"m\"\n[environment]\ntype = \"http\"\nurl = \"http://h:1\"\n")
                .unwrap();
        assert!(
            matches!(http.environment.unwrap().kind, EnvironmentKind::Http(s) if s.url == "http://h:1")
        );
        for (text, want) in [
            (
                "[environment]\nmax_turns = 2\n",
                "without [environment] type",
            ),
            ("[environment]\ntype = \"http\"\n", "needs url"),
            (
                "[environment]\ntype = \"tools\"\nurl = \"x\"\n",
                "has no effect with type = \"tools\"",
            ),
            (
                "[environment]\ntype = \"tools\"\ntools = [\"shell\"]\n",
                "unknown tool `shell`",
            ),
            ("[environment]\ntype = \"gym\"\n", "tools"),
            (
                "[environment]\ntype = \"tools\"\n[[reward.functions]]\ntype = \"math_answer\"\n",
                "remove the [[reward.functions]]",
            ),
        ] {
            let e = parse(&format!("[model]\npath = \"m\"\n{text}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn kl_in_reward_needs_a_beta_and_its_controller_keys_need_it() {
        let c = parse(
            "[model]\npath = \"m\"\n[algorithm]\nkl_coef = 0.05\nuse_kl_in_reward = true\nkl_ctrl = \"adaptive\"\nkl_target = 0.2\n",
        )
        .unwrap();
        let k = c.algorithm.kl_in_reward.unwrap();
        assert_eq!(k.coef, 0.05);
        assert_eq!(
            k.control,
            KlControl::Adaptive {
                target: 0.2,
                horizon: 10000.0
            }
        );
        assert_eq!(k.estimator, KlEstimator::K1, "verl's in-reward default");
        assert_eq!(c.algorithm.kl_estimator, KlEstimator::K1);
        let plain = parse("[model]\npath = \"m\"\n").unwrap();
        assert_eq!(plain.algorithm.kl_estimator, KlEstimator::K3);
        assert!(plain.algorithm.kl_in_reward.is_none());
        for (text, want) in [
            ("use_kl_in_reward = true\n", "needs kl_coef > 0"),
            ("kl_ctrl = \"adaptive\"\n", "without use_kl_in_reward"),
            (
                "kl_coef = 0.1\nuse_kl_in_reward = true\nkl_target = 0.2\n",
                "unless kl_ctrl = \"adaptive\"",
            ),
        ] {
            let e = parse(&format!("[model]\npath = \"m\"\n[algorithm]\n{text}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn dapo_settings_parse_and_the_preset_turns_dynamic_sampling_on() {
        let base = "policy_model = \"m\"\n";
        let plain = parse(base).unwrap();
        assert!(!plain.dynamic_sampling.filter_groups && !plain.algorithm.overlong_filter);
        assert_eq!(plain.dynamic_sampling.overlong_buffer_len, 0);
        let dapo = parse(&format!("{base}algorithm = \"DAPO\"\n")).unwrap();
        assert!(dapo.dynamic_sampling.filter_groups);
        assert_eq!(dapo.dynamic_sampling.max_sample_batches, 10);
        let set = parse(&format!(
            "{base}[algorithm]\noverlong_buffer_len = 64\noverlong_penalty_factor = 0.5\n\
             overlong_filter = true\nmax_sample_batches = 2\n"
        ))
        .unwrap();
        assert_eq!(set.dynamic_sampling.overlong_buffer_len, 64);
        assert_eq!(set.dynamic_sampling.overlong_penalty_factor, 0.5);
        assert_eq!(set.dynamic_sampling.max_sample_batches, 2);
        assert!(set.algorithm.overlong_filter);
        let e = parse(&format!("{base}[algorithm]\nmax_sample_batches = 0\n")).unwrap_err();
        assert!(
            e.to_string().contains("algorithm.max_sample_batches"),
            "{e}"
        );
    }

    #[test]
    fn gradient_checkpointing_is_off_unless_asked() {
        let base = "policy_model = \"m\"\n";
        assert!(!parse(base).unwrap().gradient_checkpointing);
        let on = parse(&format!("{base}[trainer]\ngradient_checkpointing = true\n")).unwrap();
        assert!(on.gradient_checkpointing);
    }

    #[test]
    fn rollout_correction_keys() {
        let c = parse("policy_model = \"m\"\n[algorithm]\nrollout_is = \"sequence\"\nrollout_is_threshold = 3\nrollout_rs = [\"seq_mean_k1\", \"token_k3\"]\nrollout_rs_threshold = 1.5\nrollout_rs_threshold_lower = 0.5\n").unwrap();
        let rc = c.algorithm.rollout_correction.unwrap();
        let is = rc.is.unwrap();
        assert_eq!((is.upper, is.lower), (3.0, None));
        assert_eq!(rc.rules.len(), 2);
        assert_eq!(rc.rules[0].lower, Some(0.5f64.ln()));
        assert_eq!((rc.rules[1].lower, rc.rules[1].upper), (None, 1.5));
        assert!(parse("policy_model = \"m\"\n")
            .unwrap()
            .algorithm
            .rollout_correction
            .is_none());
        let e = parse("policy_model = \"m\"\n[algorithm]\nrollout_rs = \"token_k1\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rollout_rs") && e.contains("rollout_rs_threshold"),
            "{e}"
        );
        let e = parse("policy_model = \"m\"\n[algorithm]\nrollout_is = \"tokens\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rollout_is") && e.contains("\"token\" or \"sequence\""),
            "{e}"
        );
    }

    #[test]
    fn data_parallel_keys() {
        let c = parse("policy_model = \"m\"\nnum_gpus = 8\n").unwrap();
        assert_eq!((c.num_gpus, c.zero_stage), (Some(8), 2));
        let c = parse("policy_model = \"m\"\n[trainer]\nzero_stage = 0\n").unwrap();
        assert_eq!(c.zero_stage, 0);
        let e = parse("policy_model = \"m\"\n[trainer]\nzero_stage = 1\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("zero_stage") && e.contains("use 0 or 2") && e.contains(":3"),
            "{e}"
        );
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
            ("[algorithm]\nadvantage = \"ppo\"\n", "algorithm.advantage"),
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
    fn device_and_staleness_resolve_and_bad_devices_name_the_line() {
        let c = parse("[model]\npath = \"m\"\n").unwrap();
        assert_eq!((c.device, c.max_staleness), (DeviceSpec::Cpu, 0));
        let c = parse("[model]\npath = \"m\"\ndevice = \"cuda:1\"\n[trainer]\nmax_staleness = 2\n")
            .unwrap();
        assert_eq!((c.device, c.max_staleness), (DeviceSpec::Cuda(1), 2));
        let e = parse("[model]\npath = \"m\"\ndevice = \"gpu\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("dir/run.toml:3:") && e.contains("model.device") && e.contains("cuda:N"),
            "{e}"
        );
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
    fn two_reward_functions_may_not_share_a_name() {
        let e = parse(
            "[model]\npath = \"m\"\n[[reward.functions]]\ntype = \"math_answer\"\n\
             [[reward.functions]]\ntype = \"math_answer\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("run.toml:6") && e.contains("second reward function named \"math_answer\""),
            "{e}"
        );
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
    fn every_function_key_belongs_to_a_reward_type() {
        let types = crate::config_keys::reward_types();
        for d in KEYS.iter().filter(|d| d.section == "reward.functions") {
            assert!(d.types.iter().all(|t| types.contains(t)), "{}", d.key);
            assert!(
                types
                    .iter()
                    .any(|t| crate::config_keys::function_keys_of(t).contains(&d.key)),
                "{}",
                d.key
            );
        }
    }

    #[test]
    fn the_bundled_examples_resolve() {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        for dir in std::fs::read_dir(examples).unwrap() {
            for file in std::fs::read_dir(dir.unwrap().path()).unwrap() {
                let path = file.unwrap().path();
                if path.extension().is_some_and(|e| e == "toml") {
                    RunConfig::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }

    #[test]
    fn presets_and_registry_names_resolve() {
        let dr = parse("policy_model = \"m\"\nalgorithm = \"dr-grpo\"\n").unwrap();
        assert_eq!(dr.algorithm.advantage.estimator, AdvantageEstimator::DrGrpo);
        let gspo = parse("policy_model = \"m\"\nalgorithm = \"GSPO\"\n").unwrap();
        assert_eq!(gspo.algorithm.policy_loss.kind, PolicyLoss::Gspo);
        assert_eq!(gspo.algorithm.policy_loss.clip_high, 4e-4);
        let c =
            parse("policy_model = \"m\"\n[algorithm]\nkl_estimator = \"low_var_kl\"\n").unwrap();
        assert_eq!(c.algorithm.kl_estimator, KlEstimator::K3);
        let e = parse("policy_model = \"m\"\n[algorithm]\npolicy_loss = \"ppo\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("dir/run.toml:3:") && e.contains("\"ppo_clip\""),
            "{e}"
        );
    }

    #[test]
    fn explain_lists_every_key() {
        let text = explain();
        for d in KEYS {
            assert!(text.contains(d.key), "{}", d.key);
        }
    }
}
