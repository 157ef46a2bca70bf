//! The catalogue of configuration keys: for each key its section, name, kind (type and check),
//! default and meaning, in one entry of [`KEYS`]. Validation, the closest-key suggestion,
//! `oxrl config --explain` and the README's key list all read this table, and the resolver
//! reads every default from it, so a key is declared once.
//!
//! Adding a key: one [`KeySpec`] line in [`KEYS`], then reading it in `config.rs`'s `resolve`
//! (`given.value("section.key")` when the entry has a default value, `given.get(..)` for an
//! `Option`); `OXRL_UPDATE_README=1 cargo test -p oxrl-train --test readme_keys` regenerates the
//! README's list.

use crate::optim::LrSchedule;
use crate::update::OldLogprobs;
use oxrl_algo::{AdvantageEstimator, KlEstimator, LossAgg, PolicyLoss, Registered};
use oxrl_reward::code::CodeSpec;
use oxrl_reward::rules::RULE_TYPES;
use oxrl_reward::sandbox::Limits;
use oxrl_reward::{HttpSpec, RewardModelSpec};

/// One configuration key.
pub struct KeySpec {
    /// `model`, `trainer`, ...; `reward.functions` for the keys of one function table; "" for a
    /// flat quick-start key at the top level.
    pub section: &'static str,
    pub key: &'static str,
    pub kind: Kind,
    pub default: KeyDefault,
    pub meaning: &'static str,
    /// `reward.functions` only: the reward types that take this key (empty: every type).
    pub types: &'static [&'static str],
}

/// What a key's value may be. The check of each kind is in `config_file.rs`.
#[derive(Clone, Copy)]
pub enum Kind {
    Bool,
    /// A whole number in `[min, max]`.
    Int {
        min: i64,
        max: i64,
    },
    /// A number (an integer is taken as one) in a range.
    Float(Range),
    Str,
    /// A string that is one of these names.
    OneOf(fn() -> Vec<Choice>),
    /// A list of strings.
    Strings,
    /// A name or a list of names.
    Names,
    /// A path or a list of paths.
    Paths,
    /// Two numbers in a range (`[0.9, 0.999]`).
    Pair(Range),
    /// `[[reward.functions]]`: tables whose keys are the `reward.functions` entries.
    Tables,
    /// The flat `algorithm = "<preset>"`: a name from [`PRESETS`], any case.
    Preset,
}

/// The numbers a [`Kind::Float`] or [`Kind::Pair`] accepts.
#[derive(Clone, Copy, PartialEq)]
pub enum Range {
    /// Any number, unchecked.
    Any,
    Finite,
    NonNegative,
    /// Finite and above 0.
    Positive,
    /// Above 1 (the dual-clip constant).
    AboveOne,
    /// (0, 1]
    Probability,
    /// [0, 1]
    Fraction,
    /// [0, 1) (Adam's betas)
    Beta,
}

/// One name a [`Kind::OneOf`] key accepts.
pub struct Choice {
    pub name: &'static str,
    /// Further names for the same choice.
    pub aliases: &'static [&'static str],
    pub meaning: &'static str,
}

/// A key's default.
#[derive(Clone, Copy)]
pub enum KeyDefault {
    /// The value, as TOML: the resolver parses it like a value in a file.
    Value(&'static str),
    /// Not a value of the key: what an absent key means, in words ("(required)", "= loss_agg").
    Text(&'static str),
    /// Said in words computed from the code that owns the default (oxrl-reward's specs), so
    /// the catalogue cannot drift from it.
    Shown(fn() -> String),
}

impl KeyDefault {
    pub fn text(&self) -> String {
        match self {
            KeyDefault::Value(v) | KeyDefault::Text(v) => v.to_string(),
            KeyDefault::Shown(f) => f(),
        }
    }
}

/// `algorithm = "<name>"`: the `[algorithm]` keys a preset sets (as TOML values). The values
/// are checked against the catalogue (and so the registries) like any file's.
pub struct Preset {
    /// Upper-case names; the first is the one explain shows.
    pub names: &'static [&'static str],
    pub sets: &'static [(&'static str, &'static str)],
}

pub const PRESETS: &[Preset] = &[
    Preset {
        names: &["GRPO"],
        sets: &[("advantage", "\"grpo\"")],
    },
    Preset {
        names: &["DR_GRPO", "DR-GRPO"],
        sets: &[
            ("advantage", "\"dr_grpo\""),
            ("loss_agg", "\"seq_mean_token_sum_norm\""),
        ],
    },
    Preset {
        names: &["PPO"],
        sets: &[("advantage", "\"gae\"")],
    },
    Preset {
        names: &["RLOO"],
        sets: &[("advantage", "\"rloo\"")],
    },
    Preset {
        names: &["REINFORCE++", "REINFORCE_PLUS_PLUS"],
        sets: &[("advantage", "\"reinforce_plus_plus\"")],
    },
    Preset {
        names: &["REINFORCE_BASELINE", "REINFORCE++_BASELINE"],
        sets: &[("advantage", "\"reinforce_baseline\"")],
    },
    Preset {
        names: &["GSPO"],
        sets: &[
            ("policy_loss", "\"gspo\""),
            ("loss_agg", "\"seq_mean_token_mean\""),
            ("clip_low", "3e-4"),
            ("clip_high", "4e-4"),
        ],
    },
    Preset {
        names: &["DAPO"],
        sets: &[
            ("clip_high", "0.28"),
            ("loss_agg", "\"token_mean\""),
            ("filter_groups", "true"),
        ],
    },
];

/// The preset `name` stands for (case-insensitive).
pub fn preset(name: &str) -> Option<&'static Preset> {
    let upper = name.to_ascii_uppercase();
    PRESETS.iter().find(|p| p.names.contains(&upper.as_str()))
}

/// The names the flat `algorithm` key accepts, for messages.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.names[0]).collect()
}

/// `[algorithm] old_logprobs`: each name, what it means, what it resolves to.
pub const OLD_LOGPROBS: &[(&str, &str, OldLogprobs)] = &[
    (
        "recompute",
        "with the policy before the update",
        OldLogprobs::Recompute,
    ),
    ("rollout", "the engine's, as sampled", OldLogprobs::Rollout),
];

/// `[trainer] lr_schedule`: each name, what it means, what it resolves to.
pub const LR_SCHEDULES: &[(&str, &str, LrSchedule)] = &[
    ("constant", "", LrSchedule::Constant),
    (
        "linear",
        "linear decay to 0 at the last step",
        LrSchedule::Linear,
    ),
    (
        "cosine",
        "a half cosine to 0 at the last step",
        LrSchedule::Cosine,
    ),
];

/// A `(name, meaning, value)` table as choices.
fn table_choices<T>(table: &[(&'static str, &'static str, T)]) -> Vec<Choice> {
    table
        .iter()
        .map(|(name, meaning, _)| choice(name, meaning))
        .collect()
}

/// The entries of an `oxrl-algo` registry as choices.
fn registry<R: Registered>() -> Vec<Choice> {
    R::ALL
        .iter()
        .map(|e| Choice {
            name: e.name(),
            aliases: e.aliases(),
            meaning: e.meaning(),
        })
        .collect()
}

const fn choice(name: &'static str, meaning: &'static str) -> Choice {
    Choice {
        name,
        aliases: &[],
        meaning,
    }
}

fn lora_inits() -> Vec<Choice> {
    vec![
        choice("kaiming", "PEFT's default: uniform in ±1/sqrt(fan_in)"),
        choice("gaussian", "PEFT's \"gaussian\": normal with std 1/rank"),
    ]
}

fn dtypes() -> Vec<Choice> {
    vec![choice("f32", ""), choice("bf16", ""), choice("f16", "")]
}

fn reward_type_choices() -> Vec<Choice> {
    let mut c: Vec<Choice> = RULE_TYPES
        .iter()
        .map(|t| choice(t, rule_meaning(t)))
        .collect();
    c.extend([
        choice(
            "code",
            "runs the response's code block against the row's tests",
        ),
        choice("http", "a remote scoring service"),
        choice(
            "reward_model",
            "a Qwen3ForSequenceClassification checkpoint",
        ),
    ]);
    c
}

/// What each of `oxrl-reward`'s rule types scores.
fn rule_meaning(kind: &str) -> &'static str {
    match kind {
        "math_answer" => {
            "1 when the last \\boxed{} (else the last number) equals the answer numerically"
        }
        "exact_match" => "1 when the trimmed response equals the answer",
        "regex_match" => "1 when the pattern matches somewhere in the response",
        "format" => "1 when the whole response matches the pattern",
        "length_penalty" => "−max(0, tokens − target) / target",
        _ => "a rule",
    }
}

/// Every reward type, in catalogue order.
pub fn reward_types() -> Vec<&'static str> {
    reward_type_choices().iter().map(|c| c.name).collect()
}

/// `norm_adv_by_std`'s default: each estimator's own, from the registry.
fn norm_adv_by_std_default() -> String {
    let off: Vec<&str> = AdvantageEstimator::ALL
        .iter()
        .filter(|e| !e.norm_adv_by_std_default())
        .map(|e| e.name())
        .collect();
    format!("true (false for {})", off.join(", "))
}

const fn int(min: i64) -> Kind {
    Kind::Int { min, max: i64::MAX }
}

const fn key(
    section: &'static str,
    key: &'static str,
    kind: Kind,
    default: KeyDefault,
    meaning: &'static str,
) -> KeySpec {
    KeySpec {
        section,
        key,
        kind,
        default,
        meaning,
        types: &[],
    }
}

/// A `[[reward.functions]]` key that the reward types `types` take.
const fn function_key(
    name: &'static str,
    types: &'static [&'static str],
    kind: Kind,
    default: KeyDefault,
    meaning: &'static str,
) -> KeySpec {
    KeySpec {
        section: "reward.functions",
        key: name,
        kind,
        default,
        meaning,
        types,
    }
}

use self::KeyDefault::{Shown, Text, Value};
use self::Range::{AboveOne, Beta, Finite, Fraction, NonNegative, Positive, Probability};

const CODE: &[&str] = &["code"];
const HTTP: &[&str] = &["http"];
const MODEL: &[&str] = &["reward_model"];

/// The table as written, one line per key (rustfmt leaves a brace-delimited macro's lines alone).
macro_rules! table {
    ($($entry:expr,)*) => {
        &[$($entry),*]
    };
}

/// Every key, grouped by section in the order `--explain` and the README show them.
pub const KEYS: &[KeySpec] = table! {
    key("model", "path", Kind::Str, Text("(required)"), "policy checkpoint: a directory or a hub id"),
    key("model", "dtype", Kind::OneOf(dtypes), Value("\"f32\""), "compute dtype"),
    key("model", "device", Kind::Str, Value("\"cpu\""), "where the policy and reference run and train: cpu, cuda (the first GPU) or cuda:N (needs a build with --features cuda)"),
    key("model", "freeze_vision", Kind::Bool, Value("false"), "Qwen3-VL: keep the vision tower's weights fixed (train the language model only)"),
    key("model.lora", "rank", int(1), Text("none (no LoRA)"), "train rank-r LoRA adapters on the language model's projections instead of every weight (PEFT's r); setting it turns LoRA on"),
    key("model.lora", "alpha", Kind::Float(Positive), Value("16.0"), "the adapters' scale is alpha / rank (PEFT's lora_alpha)"),
    key("model.lora", "dropout", Kind::Float(Fraction), Value("0.0"), "dropout on the adapters' input in the training forward (PEFT's lora_dropout; below 1)"),
    key("model.lora", "target_modules", Kind::Names, Value("\"all-linear\""), "\"all-linear\" (q/k/v/o_proj and gate/up/down_proj) or a list of those names"),
    key("model.lora", "init", Kind::OneOf(lora_inits), Value("\"kaiming\""), "how A starts (B starts at zero)"),
    key("model.lora", "use_rslora", Kind::Bool, Value("false"), "scale by alpha / sqrt(rank) (rank-stabilised LoRA)"),
    key("reference", "path", Kind::Str, Text("the policy's initial weights"), "reference model for the KL term (loaded only when kl_coef > 0)"),
    key("data", "train_files", Kind::Paths, Text("(required unless --rollouts)"), "JSONL or Parquet dataset(s), paths relative to this file"),
    key("data", "val_files", Kind::Paths, Text("none"), "validation dataset(s), decoded greedily and scored before training, every eval_every steps and at the end"),
    key("data", "prompt_key", Kind::Str, Value("\"prompt\""), "column with the prompt: a string or chat messages"),
    key("data", "answer_key", Kind::Str, Value("\"answer\""), "column with the ground truth passed to rewards"),
    key("data", "image_key", Kind::Str, Value("\"images\""), "column with a row's images (Qwen3-VL): paths relative to the dataset file, data URLs, or {bytes, path} cells"),
    key("data", "max_prompt_length", int(0), Value("1024"), "prompt tokens after the chat template"),
    key("data", "overlong_prompts", Kind::OneOf(|| vec![choice("filter", "drops longer prompts"), choice("error", "stops the run")]), Value("\"filter\""), "what a prompt longer than max_prompt_length does"),
    key("data", "enable_thinking", Kind::Bool, Text("template default"), "enable_thinking passed to the chat template"),
    key("data", "shuffle", Kind::Bool, Value("true"), "shuffle the prompts each epoch with the run's seed"),
    key("rollout", "n_samples_per_prompt", Kind::Int { min: 1, max: oxrl_rollout::MAX_SAMPLES_PER_PROMPT as i64 }, Value("8"), "group size G: responses sampled per prompt"),
    key("rollout", "max_new_tokens", int(1), Value("256"), "response length limit"),
    key("rollout", "temperature", Kind::Float(Positive), Value("1.0"), "sampling temperature, also the temperature of the trainer's log-probs (which divide by it)"),
    key("rollout", "top_p", Kind::Float(Probability), Value("1.0"), "nucleus sampling"),
    key("rollout", "top_k", int(0), Value("0"), "top-k sampling (0 = off)"),
    key("rollout", "min_p", Kind::Float(Range::Fraction), Value("0.0"), "min-p sampling (0 = off)"),
    key("rollout", "stop", Kind::Strings, Value("[]"), "stop strings"),
    key("rollout", "backend", Kind::OneOf(|| vec![choice("local", "the engine in this process, sharing the trainer's weights"), choice("vllm", "vLLM servers (server_urls), token in, token out")]), Value("\"local\""), "where rollouts are sampled"),
    key("rollout", "server_urls", Kind::Strings, Value("[]"), "vllm: the servers' base URLs (http://host:port); each prompt's group goes to one, round-robin"),
    key("rollout", "sync", Kind::OneOf(|| vec![choice("disk", "save the policy to sync_dir, each server reloads it"), choice("nccl", "broadcast the weights GPU to GPU with vLLM's NCCL weight transfer (CUDA build; not yet run on GPUs)"), choice("none", "the servers keep their start weights (off-policy: needs max_staleness)")]), Value("\"disk\""), "vllm: how the servers get the trainer's weights after each update"),
    key("rollout", "sync_dir", Kind::Str, Text("<output_dir>/sync-weights"), "vllm: where sync = \"disk\" saves the policy; every server must read it at this path"),
    key("rollout", "request_timeout_s", Kind::Float(Positive), Value("600.0"), "vllm: time limit of one request (a prompt's whole group)"),
    key("rollout", "max_retries", int(0), Value("3"), "vllm: retries of a request after a transport error or a 5xx, with doubling backoff"),
    key("reward", "functions", Kind::Tables, Text("(required for sampling runs)"), "[[reward.functions]] tables: type, name, weight and the type's options"),
    key("reward", "failure_score", Kind::Float(Range::Any), Value("0.0"), "score of a reward function that fails or times out"),
    key("reward", "timeout_s", Kind::Float(Positive), Value("10.0"), "time limit of one reward call (one response; one batch for http)"),
    function_key("type", &[], Kind::OneOf(reward_type_choices), Text("(required)"), "the reward function"),
    function_key("name", &[], Kind::Str, Text("the type"), "name in metrics: reward/<name>, reward_failures/<name>, reward_latency_s/<name>"),
    function_key("weight", &[], Kind::Float(Finite), Value("1.0"), "the total reward is the weighted sum of the functions' scores"),
    function_key("answer_key", &["math_answer", "exact_match"], Kind::Str, Text("[data] answer_key"), "the ground-truth column"),
    function_key("tolerance", &["math_answer"], Kind::Float(Range::Any), Text("1e-6"), "relative tolerance"),
    function_key("pattern", &["regex_match", "format"], Kind::Str, Text("(required)"), "the regex"),
    function_key("target_length", &["length_penalty"], int(0), Text("(required)"), "tokens before the penalty starts"),
    function_key("language", CODE, Kind::Str, Value("\"python\""), "the code block's fence tag (python also takes py, python3)"),
    function_key("command", CODE, Kind::Strings, Shown(|| format!("{:?} (python)", CodeSpec::for_language("python").command)), "program and arguments, {file} = the solution file (required for other languages)"),
    function_key("file_name", CODE, Kind::Str, Shown(|| format!("{:?} (python), {:?}", CodeSpec::for_language("python").file_name, CodeSpec::for_language("other").file_name)), "name of the solution file"),
    function_key("tests_key", CODE, Kind::Str, Shown(|| format!("{:?}", CodeSpec::for_language("python").tests_key)), "the row column with the tests (asserts, or stdin/stdout pairs)"),
    function_key("scoring", CODE, Kind::OneOf(|| vec![choice("fraction", "the fraction of tests passed"), choice("all", "1 only if every test passes")]), Text("\"fraction\""), "how test results become a score"),
    function_key("workers", CODE, int(1), Text("available parallelism"), "sandboxed runs at once"),
    function_key("timeout_s", &["code", "http"], Kind::Float(Positive), Shown(|| format!("{} (code), {} (http)", Limits::default().timeout.as_secs_f64(), HttpSpec::new("").timeout.as_secs_f64())), "code: wall clock of one test run; http: one request"),
    function_key("cpu_s", CODE, int(1), Shown(|| Limits::default().cpu_s.to_string()), "CPU seconds per process"),
    function_key("memory_mb", CODE, int(1), Shown(|| Limits::default().memory_mb.to_string()), "address space per process (MiB)"),
    function_key("file_size_mb", CODE, int(1), Shown(|| Limits::default().file_size_mb.to_string()), "largest file a process may write (MiB)"),
    function_key("max_processes", CODE, int(1), Shown(|| Limits::default().max_processes.to_string()), "processes and threads of one run"),
    function_key("max_open_files", CODE, int(1), Shown(|| Limits::default().max_open_files.to_string()), "open files per process"),
    function_key("output_bytes", CODE, int(1), Shown(|| Limits::default().output_bytes.to_string()), "stdout and stderr kept each; more kills the run"),
    function_key("scratch_mb", CODE, int(1), Shown(|| Limits::default().scratch_mb.to_string()), "size of the writable scratch directory (MiB)"),
    function_key("url", HTTP, Kind::Str, Text("(required)"), "POST {items: [{prompt, response, row}]} here, read {scores: [...]}"),
    function_key("max_retries", HTTP, Kind::Int { min: 0, max: u32::MAX as i64 }, Shown(|| HttpSpec::new("").max_retries.to_string()), "retries after a transport error, timeout, 408, 429 or 5xx"),
    function_key("backoff_s", HTTP, Kind::Float(NonNegative), Shown(|| HttpSpec::new("").backoff.as_secs_f64().to_string()), "wait before the first retry, doubled for each next one"),
    function_key("max_concurrency", HTTP, int(1), Shown(|| HttpSpec::new("").max_concurrency.to_string()), "requests in flight at once"),
    function_key("batch_size", &["http", "reward_model"], int(1), Shown(|| format!("{} (http), {} (reward_model)", HttpSpec::new("").batch_size, RewardModelSpec::new("").batch_size)), "http: items per request; reward_model: sequences per forward"),
    function_key("path", MODEL, Kind::Str, Text("(required)"), "a Qwen3ForSequenceClassification checkpoint (directory or hub id)"),
    function_key("dtype", MODEL, Kind::OneOf(dtypes), Value("\"f32\""), "compute dtype"),
    function_key("normalize", MODEL, Kind::OneOf(|| vec![choice("none", "the raw score"), choice("running", "minus the running mean, over the running std")]), Value("\"none\""), "normalisation of the score"),
    function_key("scale", MODEL, Kind::Float(Finite), Shown(|| RewardModelSpec::new("").scale.to_string()), "the score is scale * (normalised score) + shift"),
    function_key("shift", MODEL, Kind::Float(Finite), Shown(|| RewardModelSpec::new("").shift.to_string()), "added after scale"),
    key("environment", "type", Kind::OneOf(|| vec![choice("tools", "the policy calls tools (calculator, python) in Qwen3's <tool_call> format or <code> blocks; a turn without a call is its final answer, scored 1 when it matches the row's answer"), choice("http", "a remote service implements POST <url>/reset and <url>/step")]), Text("none (one generation per trajectory)"), "multi-turn episodes: each trajectory alternates the policy's turns with this environment's; its tokens stay out of the loss, its rewards are the trajectory's reward (no [[reward.functions]])"),
    key("environment", "max_turns", int(1), Value("4"), "policy turns per episode at most"),
    key("environment", "tools", Kind::Names, Value("[\"calculator\"]"), "tools: the tools offered, of calculator and python (python runs in the sandbox with the code reward's default limits)"),
    key("environment", "answer_key", Kind::Str, Text("[data] answer_key"), "tools: the ground-truth column the final answer is checked against"),
    key("environment", "url", Kind::Str, Text("(required for http)"), "http: the service's base URL"),
    key("environment", "timeout_s", Kind::Float(Positive), Value("30.0"), "http: time limit of one request"),
    key("algorithm", "advantage", Kind::OneOf(registry::<AdvantageEstimator>), Value("\"grpo\""), "advantage estimator"),
    key("algorithm", "norm_adv_by_std", Kind::Bool, Shown(norm_adv_by_std_default), "divide GRPO advantages by the group std"),
    key("algorithm", "gamma", Kind::Float(Fraction), Value("1.0"), "discount of reinforce_plus_plus's and gae's per-token returns (1: every token gets the whole reward)"),
    key("algorithm", "lam", Kind::Float(Fraction), Value("1.0"), "gae: GAE's λ (1: Monte Carlo returns minus the values; 0: one-step TD errors)"),
    key("algorithm", "adv_eps", Kind::Float(NonNegative), Value("1e-6"), "epsilon of the GRPO std"),
    key("algorithm", "policy_loss", Kind::OneOf(registry::<PolicyLoss>), Value("\"ppo_clip\""), "policy loss per token"),
    key("algorithm", "clip_low", Kind::Float(NonNegative), Value("0.2"), "lower clip epsilon"),
    key("algorithm", "clip_high", Kind::Float(NonNegative), Value("0.2"), "upper clip epsilon (0.28 = DAPO clip-higher)"),
    key("algorithm", "tau_pos", Kind::Float(Positive), Value("1.0"), "sapo: the gate temperature for positive advantages"),
    key("algorithm", "tau_neg", Kind::Float(Positive), Value("1.05"), "sapo: the gate temperature for the other advantages (above tau_pos: negative updates gated harder)"),
    key("algorithm", "dual_clip_c", Kind::Float(AboveOne), Text("none"), "dual-clip constant for negative advantages (ppo_clip), about 3"),
    key("algorithm", "kl_coef", Kind::Float(NonNegative), Value("0.0"), "beta of the KL loss term (the starting beta with use_kl_in_reward); 0 loads no reference model"),
    key("algorithm", "kl_estimator", Kind::OneOf(registry::<KlEstimator>), Text("\"k3\" (\"k1\" with use_kl_in_reward)"), "KL estimator per token, δ = logp − logp_ref"),
    key("algorithm", "use_kl_in_reward", Kind::Bool, Value("false"), "put the KL in the reward instead of the loss: each token's reward gets −kl_coef·KL(logp_old ‖ logp_ref) (verl's use_kl_in_reward; no KL loss term then)"),
    key("algorithm", "kl_ctrl", Kind::OneOf(|| vec![choice("fixed", "beta stays kl_coef"), choice("adaptive", "beta ← beta·(1 + clip(KL/kl_target − 1, ±0.2)·responses/kl_horizon) after each step (Ziegler et al.)")]), Value("\"fixed\""), "use_kl_in_reward: how beta moves"),
    key("algorithm", "kl_target", Kind::Float(Positive), Value("0.1"), "adaptive kl_ctrl: the KL per token it steers towards"),
    key("algorithm", "kl_horizon", int(1), Value("10000"), "adaptive kl_ctrl: responses over which beta moves by the clipped error"),
    key("algorithm", "loss_agg", Kind::OneOf(registry::<LossAgg>), Value("\"token_mean\""), "aggregation of the policy loss over a mini-batch"),
    key("algorithm", "kl_loss_agg", Kind::OneOf(registry::<LossAgg>), Text("= loss_agg"), "aggregation of the KL term"),
    key("algorithm", "loss_scale_factor", Kind::Float(Positive), Text("= max_new_tokens"), "L_max of seq_mean_token_sum_norm"),
    key("algorithm", "old_logprobs", Kind::OneOf(|| table_choices(OLD_LOGPROBS)), Value("\"recompute\""), "where logp_old comes from"),
    key("algorithm", "entropy_coef", Kind::Float(Range::Any), Value("0.0"), "entropy bonus coefficient"),
    key("algorithm", "overlong_buffer_len", int(0), Value("0"), "DAPO soft overlong punishment: over the last this many of max_new_tokens the reward falls linearly by up to overlong_penalty_factor (0 = off)"),
    key("algorithm", "overlong_penalty_factor", Kind::Float(NonNegative), Value("1.0"), "DAPO: the punishment at max_new_tokens"),
    key("algorithm", "rollout_is", Kind::Str, Text("none"), "rollout correction (verl's): importance weights exp(logp_old − logp_rollout) per \"token\" or per \"sequence\", truncated at rollout_is_threshold, on the policy-gradient term; needs the engine's log-probs and old_logprobs = \"recompute\""),
    key("algorithm", "rollout_is_threshold", Kind::Float(Positive), Value("2.0"), "rollout_is's truncation bound C"),
    key("algorithm", "rollout_is_threshold_lower", Kind::Float(Positive), Text("none"), "IcePop: rollout_is weights outside [this, rollout_is_threshold] become 0 instead of truncated"),
    key("algorithm", "rollout_rs", Kind::Names, Text("none"), "rollout correction's rejection: token_k1..3, seq_sum_k1..3, seq_mean_k1..3 (seq_mean_k1 bounds the geometric mean ratio), seq_max_k2..3; tokens or whole sequences beyond rollout_rs_threshold leave the loss and its totals"),
    key("algorithm", "rollout_rs_threshold", Kind::Float(Positive), Text("none"), "rollout_rs's bound, shared by its rules: the ratio's upper bound for k1 rules (lower 1/it, or rollout_rs_threshold_lower), the divergence's upper bound for k2/k3; required with rollout_rs"),
    key("algorithm", "rollout_rs_threshold_lower", Kind::Float(Positive), Text("none"), "k1 rejection rules' lower ratio bound"),
    key("algorithm", "overlong_filter", Kind::Bool, Value("false"), "DAPO overlong filtering: truncated responses (finish_reason length) leave the update (their groups' advantages still count them)"),
    key("algorithm", "filter_groups", Kind::Bool, Value("false"), "DAPO dynamic sampling: drop groups whose rewards all tie and sample further batches until batch_size groups carry a signal"),
    key("algorithm", "max_sample_batches", int(1), Value("10"), "dynamic sampling: batches sampled per step at most (then the step trains on the groups it has)"),
    key("trainer", "batch_size", int(1), Value("8"), "prompts per step (x n_samples_per_prompt trajectories)"),
    key("trainer", "micro_batch_size", int(1), Value("8"), "trajectories per forward/backward"),
    key("trainer", "gradient_accumulation_steps", int(1), Text("whole batch"), "micro-batches per optimizer step"),
    key("trainer", "ppo_epochs", int(1), Value("1"), "passes over each batch"),
    key("trainer", "gradient_checkpointing", Kind::Bool, Value("false"), "keep only each decoder layer's (and vision block's) input in the forward and recompute it in the backward: activation memory of one layer instead of all, for one more forward"),
    key("trainer", "max_steps", int(0), Value("100"), "training steps (a replay run does one per --rollouts file)"),
    key("trainer", "lr", Kind::Float(Positive), Value("1e-6"), "AdamW learning rate"),
    key("trainer", "adam_betas", Kind::Pair(Beta), Value("[0.9, 0.999]"), "AdamW betas"),
    key("trainer", "adam_eps", Kind::Float(NonNegative), Value("1e-8"), "AdamW epsilon"),
    key("trainer", "weight_decay", Kind::Float(NonNegative), Value("0.01"), "decoupled weight decay, every parameter"),
    key("trainer", "max_grad_norm", Kind::Float(NonNegative), Value("1.0"), "global gradient-norm clip"),
    key("trainer", "lr_schedule", Kind::OneOf(|| table_choices(LR_SCHEDULES)), Value("\"constant\""), "learning-rate schedule, each after warmup"),
    key("trainer", "warmup_steps", int(0), Value("0"), "linear warmup optimizer steps"),
    key("trainer", "eval_every", int(0), Value("0"), "validation every N steps (0: at the start and end only), when [data] val_files is set"),
    key("trainer", "save_every", int(0), Value("0"), "checkpoint every N steps (0 = only at the end)"),
    key("trainer", "zero_stage", Kind::Int { min: 0, max: 2 }, Value("2"), "data-parallel runs: 2 splits the optimizer state (f32 masters, AdamW moments) and the summed gradients across the ranks (ZeRO-2); 0 keeps a whole copy on every rank; 1 is not offered"),
    key("trainer", "async", Kind::OneOf(|| vec![choice("off", "each step samples, then learns"), choice("one_step", "the next step's batch is sampled (with the weights before this step's update) while this step learns: one step off-policy; one process, no LoRA")]), Value("\"off\""), "overlap sampling with the update"),
    key("trainer", "max_staleness", int(0), Value("0"), "weight versions a sampled trajectory may lag the trainer's (0 = strictly on-policy: any older sample stops the run)"),
    key("trainer", "seed", int(0), Value("42"), "data order and sampling seed"),
    key("trainer", "output_dir", Kind::Str, Text("runs/<config name>"), "checkpoints, metrics.jsonl, reward.svg"),
    key("critic", "path", Kind::Str, Text("[model] path"), "advantage = \"gae\": the critic's starting checkpoint: a Qwen3ForTokenClassification value model, or a Qwen3 / Qwen3-VL checkpoint (then with a fresh value head)"),
    key("critic", "lr", Kind::Float(Positive), Value("1e-5"), "the critic's AdamW learning rate (betas, eps and weight decay are [trainer]'s)"),
    key("critic", "value_clip", Kind::Float(NonNegative), Value("0.5"), "clipped value loss: a value moves at most this far from the one GAE used per update (0: plain squared error)"),
    key("critic", "ppo_epochs", int(1), Text("[trainer] ppo_epochs"), "the critic's passes over each batch"),
    key("critic", "mini_batch_size", int(1), Text("the policy's mini-batch"), "trajectories per critic optimizer step"),
    key("critic", "micro_batch_size", int(1), Text("[trainer] micro_batch_size"), "trajectories per critic forward/backward"),
    key("critic", "max_grad_norm", Kind::Float(NonNegative), Value("1.0"), "the critic's global gradient-norm clip"),
    key("critic", "loss_agg", Kind::OneOf(registry::<LossAgg>), Value("\"token_mean\""), "aggregation of the value loss over a mini-batch"),
    key("critic", "warmup_steps", int(0), Value("0"), "training steps at the start in which only the critic learns (the policy keeps its weights)"),
    key("logging", "prometheus_port", Kind::Int { min: 0, max: u16::MAX as i64 }, Text("none"), "serve /metrics on this port"),
    key("logging", "prometheus_host", Kind::Str, Value("\"127.0.0.1\""), "the address /metrics listens on (\"0.0.0.0\": every interface, for a scraper on another machine)"),
    key("", "policy_model", Kind::Str, Text("none"), "quick-start: [model] path"),
    key("", "reward_model", Kind::Str, Text("none"), "quick-start: a [[reward.functions]] table of type reward_model with this path, weight 1"),
    key("", "algorithm", Kind::Preset, Text("none"), "quick-start: a preset of [algorithm] keys"),
    key("", "num_gpus", Kind::Int { min: 0, max: u32::MAX as i64 }, Text("none"), "quick-start: GPUs, one process each: a launcher (torchrun, srun, mpirun, oxrl.ray) starts them and this must match its world size"),
    key("", "batch_size", int(1), Text("none"), "quick-start: [trainer] batch_size"),
    key("", "gradient_accumulation_steps", int(1), Text("none"), "quick-start: [trainer] gradient_accumulation_steps"),
};

/// The sections, in catalogue order (without the flat keys' "").
pub fn sections() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for k in KEYS {
        let top = k.section.split('.').next().unwrap_or_default();
        if !top.is_empty() && !out.contains(&top) {
            out.push(top);
        }
    }
    out
}

/// The catalogue entry of `key` in `section`.
pub fn spec(section: &str, key: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|k| k.section == section && k.key == key)
}

/// The keys of `section`.
pub fn keys_in(section: &str) -> impl Iterator<Item = &'static KeySpec> + '_ {
    KEYS.iter().filter(move |k| k.section == section)
}

/// The `[[reward.functions]]` keys a table of type `kind` takes (every type's included).
pub fn function_keys_of(kind: &str) -> Vec<&'static str> {
    keys_in("reward.functions")
        .filter(|k| k.types.is_empty() || k.types.contains(&kind))
        .map(|k| k.key)
        .collect()
}

impl Kind {
    /// The names a [`Kind::OneOf`] or [`Kind::Preset`] accepts, aliases included.
    pub fn names(&self) -> Vec<&'static str> {
        match self {
            Kind::OneOf(choices) => choices()
                .iter()
                .flat_map(|c| std::iter::once(c.name).chain(c.aliases.iter().copied()))
                .collect(),
            Kind::Preset => PRESETS
                .iter()
                .flat_map(|p| p.names.iter().copied())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// What the value must be, in words.
    pub fn describe(&self) -> String {
        match self {
            Kind::Bool => "true or false".into(),
            Kind::Int { min, max } if *max == i64::MAX => format!("integer ≥ {min}"),
            Kind::Int { min, max } => format!("integer in [{min}, {max}]"),
            Kind::Float(r) => format!("number{}", r.describe()),
            Kind::Str => "string".into(),
            Kind::OneOf(_) | Kind::Preset => quoted_alternatives(&self.names()),
            Kind::Strings => "list of strings".into(),
            Kind::Paths => "path or list of paths".into(),
            Kind::Names => "name or list of names".into(),
            Kind::Pair(r) => format!("two numbers{}", r.describe()),
            Kind::Tables => "tables".into(),
        }
    }
}

impl Range {
    /// " in [0, 1)", " > 0", "" for any.
    pub fn describe(&self) -> &'static str {
        match self {
            Range::Any => "",
            Range::Finite => " (finite)",
            Range::NonNegative => " ≥ 0",
            Range::Positive => " > 0",
            Range::AboveOne => " > 1",
            Range::Probability => " in (0, 1]",
            Range::Fraction => " in [0, 1]",
            Range::Beta => " in [0, 1)",
        }
    }

    pub fn contains(&self, x: f64) -> bool {
        match self {
            Range::Any => true,
            Range::Finite => x.is_finite(),
            Range::NonNegative => x >= 0.0 && x.is_finite(),
            Range::Positive => x > 0.0 && x.is_finite(),
            Range::AboveOne => x > 1.0,
            Range::Probability => x > 0.0 && x <= 1.0,
            Range::Fraction => (0.0..=1.0).contains(&x),
            Range::Beta => (0.0..1.0).contains(&x),
        }
    }
}

/// `"a", "b" or "c"`.
pub fn quoted_alternatives(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// The heading of a section in explain's text and the README.
fn heading(section: &str) -> String {
    match section {
        "" => "flat quick-start keys (top level)".into(),
        "reward.functions" => "[[reward.functions]]".into(),
        s => format!("[{s}]"),
    }
}

/// The meaning with the reward types that take the key in front (function keys of some types).
fn full_meaning(k: &KeySpec) -> String {
    match k.types {
        [] => k.meaning.to_string(),
        _ if k.meaning.starts_with(&format!("{}:", k.types[0])) => k.meaning.to_string(),
        types => format!("{}: {}", types.join(", "), k.meaning),
    }
}

/// The named values of a key with what each means, one per line (`oxrl-algo` registry entries
/// with their formulas, presets with the keys they set).
fn described_choices(k: &KeySpec) -> Vec<(String, String)> {
    match k.kind {
        Kind::OneOf(choices) => choices()
            .into_iter()
            .filter(|c| !c.meaning.is_empty())
            .map(|c| {
                let names: Vec<&str> = std::iter::once(c.name)
                    .chain(c.aliases.iter().copied())
                    .collect();
                (names.join(" | "), c.meaning.to_string())
            })
            .collect(),
        Kind::Preset => PRESETS
            .iter()
            .map(|p| {
                let sets: Vec<String> = p.sets.iter().map(|(k, v)| format!("{k} = {v}")).collect();
                (p.names.join(" | "), sets.join(", "))
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The section boundaries of [`KEYS`]: `(section, its keys)` in order.
fn by_section() -> Vec<(&'static str, Vec<&'static KeySpec>)> {
    let mut out: Vec<(&'static str, Vec<&'static KeySpec>)> = Vec::new();
    for k in KEYS {
        match out.last_mut() {
            Some((s, keys)) if *s == k.section => keys.push(k),
            _ => out.push((k.section, vec![k])),
        }
    }
    out
}

/// `oxrl config --explain`: every key with its type, default and meaning.
pub fn explain() -> String {
    let mut out = String::new();
    for (section, keys) in by_section() {
        out.push_str(&format!("\n{}\n", heading(section)));
        for k in keys {
            out.push_str(&format!(
                "{:<28} default {:<28} {} ({})\n",
                k.key,
                k.default.text(),
                full_meaning(k),
                k.kind.describe()
            ));
            for (names, meaning) in described_choices(k) {
                out.push_str(&format!("    {names:<24} {meaning}\n"));
            }
        }
    }
    out
}

/// Escapes a table cell's text for Markdown (a `|` ends a cell, a `<` starts HTML).
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('<', "&lt;")
}

/// The README's key list (`oxrl config --explain --markdown`): one table per section.
pub fn markdown() -> String {
    let mut out = String::new();
    for (section, keys) in by_section() {
        out.push_str(&format!(
            "\n**{}**\n\n| key | value | default | meaning |\n|---|---|---|---|\n",
            cell(&heading(section))
        ));
        for k in keys {
            let mut meaning = cell(&full_meaning(k));
            for (names, m) in described_choices(k) {
                meaning.push_str(&format!("<br>`{}`: {}", cell(&names), cell(&m)));
            }
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                k.key,
                cell(&k.kind.describe()),
                cell(&k.default.text()),
                meaning
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config_file::{check, default_value, parse_value};

    #[test]
    fn every_default_value_passes_its_own_check() {
        for k in KEYS {
            if let KeyDefault::Value(text) = k.default {
                let v = default_value(k).unwrap_or_else(|| panic!("{}: {text}", k.key));
                check(&k.kind, &v).unwrap_or_else(|e| panic!("{}.{}: {e}", k.section, k.key));
            }
        }
    }

    #[test]
    fn presets_set_valid_algorithm_keys() {
        for p in PRESETS {
            for (key, text) in p.sets {
                let s = spec("algorithm", key).unwrap_or_else(|| panic!("{key}"));
                check(&s.kind, &parse_value(text).unwrap()).unwrap();
            }
        }
        assert_eq!(preset("dr-grpo").unwrap().names[0], "DR_GRPO");
    }

    #[test]
    fn registry_names_are_the_accepted_choices() {
        let advantage = spec("algorithm", "advantage").unwrap();
        assert_eq!(advantage.kind.names(), AdvantageEstimator::names());
        let kl = spec("algorithm", "kl_estimator").unwrap();
        assert!(kl.kind.names().contains(&"low_var_kl"));
        assert!(explain().contains("reinforce_baseline"));
    }
}
