//! `[[reward.functions]]` tables: which keys each reward type takes, and their resolution into
//! the specs `oxrl-reward` builds functions from. Everything here is checked before any model
//! loads; the key docs live in [`crate::config::KEYS`] (section `reward.functions`).

use oxrl_reward::code::{CodeSpec, Scoring};
use oxrl_reward::rules::RULE_TYPES;
use oxrl_reward::sandbox::Limits;
use oxrl_reward::{HttpSpec, Normalize, RewardModelSpec, RuleSpec};
use serde::Deserialize;
use std::time::Duration;

/// Keys of one `[[reward.functions]]` table (every type's).
pub const REWARD_FUNCTION_KEYS: &[&str] = &[
    "type",
    "name",
    "weight",
    "pattern",
    "tolerance",
    "target_length",
    "answer_key",
    "language",
    "command",
    "file_name",
    "tests_key",
    "scoring",
    "workers",
    "timeout_s",
    "cpu_s",
    "memory_mb",
    "file_size_mb",
    "max_processes",
    "max_open_files",
    "output_bytes",
    "scratch_mb",
    "url",
    "max_retries",
    "backoff_s",
    "max_concurrency",
    "batch_size",
    "path",
    "dtype",
    "normalize",
    "scale",
    "shift",
];

/// Keys every type takes.
const COMMON_KEYS: [&str; 3] = ["type", "name", "weight"];

const CODE_KEYS: &[&str] = &[
    "language",
    "command",
    "file_name",
    "tests_key",
    "scoring",
    "workers",
    "timeout_s",
    "cpu_s",
    "memory_mb",
    "file_size_mb",
    "max_processes",
    "max_open_files",
    "output_bytes",
    "scratch_mb",
];

const HTTP_KEYS: &[&str] = &[
    "url",
    "timeout_s",
    "max_retries",
    "backoff_s",
    "max_concurrency",
    "batch_size",
];

const MODEL_KEYS: &[&str] = &["path", "dtype", "batch_size", "normalize", "scale", "shift"];

/// Every reward type.
pub fn reward_types() -> Vec<&'static str> {
    let mut t = RULE_TYPES.to_vec();
    t.extend(["code", "http", "reward_model"]);
    t
}

/// The type-specific keys of `kind` (besides `type`, `name`, `weight`), if it is a type.
pub fn keys_of(kind: &str) -> Option<&'static [&'static str]> {
    Some(match kind {
        "math_answer" => &["answer_key", "tolerance"],
        "exact_match" => &["answer_key"],
        "regex_match" | "format" => &["pattern"],
        "length_penalty" => &["target_length"],
        "code" => CODE_KEYS,
        "http" => HTTP_KEYS,
        "reward_model" => MODEL_KEYS,
        _ => return None,
    })
}

/// Whether `key` belongs in a table of type `kind`.
pub fn applies(kind: &str, key: &str) -> bool {
    COMMON_KEYS.contains(&key) || keys_of(kind).is_some_and(|k| k.contains(&key))
}

/// One `[[reward.functions]]` table as serde reads it.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct RewardFunctionConfig {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub weight: Option<f64>,
    pub pattern: Option<String>,
    pub tolerance: Option<f64>,
    pub target_length: Option<usize>,
    pub answer_key: Option<String>,
    pub language: Option<String>,
    pub command: Option<Vec<String>>,
    pub file_name: Option<String>,
    pub tests_key: Option<String>,
    pub scoring: Option<String>,
    pub workers: Option<usize>,
    pub timeout_s: Option<f64>,
    pub cpu_s: Option<u64>,
    pub memory_mb: Option<u64>,
    pub file_size_mb: Option<u64>,
    pub max_processes: Option<u64>,
    pub max_open_files: Option<u64>,
    pub output_bytes: Option<usize>,
    pub scratch_mb: Option<u64>,
    pub url: Option<String>,
    pub max_retries: Option<u32>,
    pub backoff_s: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub batch_size: Option<usize>,
    pub path: Option<String>,
    pub dtype: Option<String>,
    pub normalize: Option<String>,
    pub scale: Option<f64>,
    pub shift: Option<f64>,
}

/// What a reward function is, resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum RewardKind {
    Rule(RuleSpec),
    Code(CodeSpec),
    Http(HttpSpec),
    Model(RewardModelSpec),
}

/// One resolved `[[reward.functions]]` table.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardFunction {
    pub name: String,
    pub weight: f64,
    pub kind: RewardKind,
}

/// A bad value: the key (within the table) and what was expected.
#[derive(Debug, Clone, PartialEq)]
pub struct BadKey {
    pub key: &'static str,
    pub message: String,
}

fn bad(key: &'static str, message: impl Into<String>) -> BadKey {
    BadKey {
        key,
        message: message.into(),
    }
}

fn positive(key: &'static str, v: Option<f64>, default: f64) -> Result<f64, BadKey> {
    match v.unwrap_or(default) {
        x if x > 0.0 && x.is_finite() => Ok(x),
        x => Err(bad(key, format!("expected a positive number, got {x}"))),
    }
}

fn at_least_one<T: Copy + PartialOrd + From<u8> + std::fmt::Display>(
    key: &'static str,
    v: Option<T>,
    default: T,
) -> Result<T, BadKey> {
    match v.unwrap_or(default) {
        x if x >= T::from(1) => Ok(x),
        x => Err(bad(key, format!("expected at least 1, got {x}"))),
    }
}

/// Resolves one table. `answer_key` is `[data] answer_key` (the rules' default column);
/// `call_limit` is `[reward] timeout_s`, which every single call must be able to finish in.
pub fn resolve_function(
    raw: &RewardFunctionConfig,
    answer_key: &str,
    call_limit: f64,
) -> Result<RewardFunction, BadKey> {
    let weight = raw.weight.unwrap_or(1.0);
    if !weight.is_finite() {
        return Err(bad("weight", format!("expected a number, got {weight}")));
    }
    let kind = match raw.kind.as_str() {
        "code" => RewardKind::Code(code_spec(raw, call_limit)?),
        "http" => RewardKind::Http(http_spec(raw, call_limit)?),
        "reward_model" => RewardKind::Model(model_spec(raw)?),
        kind if RULE_TYPES.contains(&kind) => {
            let spec = RuleSpec {
                kind: kind.to_string(),
                pattern: raw.pattern.clone(),
                tolerance: raw.tolerance,
                target_length: raw.target_length,
                answer_key: raw.answer_key.clone().unwrap_or_else(|| answer_key.into()),
            };
            // Builds the rule once here so a bad pattern is a config error with a line.
            oxrl_reward::build_rule(&spec).map_err(|e| {
                let key = match kind {
                    "length_penalty" => "target_length",
                    _ => "pattern",
                };
                bad(key, e)
            })?;
            RewardKind::Rule(spec)
        }
        other => {
            return Err(bad(
                "type",
                format!(
                    "unknown reward type \"{other}\"; expected one of {}",
                    reward_types().join(", ")
                ),
            ))
        }
    };
    Ok(RewardFunction {
        name: raw.name.clone().unwrap_or_else(|| raw.kind.clone()),
        weight,
        kind,
    })
}

fn code_spec(raw: &RewardFunctionConfig, call_limit: f64) -> Result<CodeSpec, BadKey> {
    let language = raw.language.clone().unwrap_or_else(|| "python".into());
    if language.trim().is_empty() || language.contains(char::is_whitespace) {
        return Err(bad("language", "expected a fence tag such as \"python\""));
    }
    let mut spec = CodeSpec::for_language(&language);
    if let Some(command) = &raw.command {
        spec.command = command.clone();
    }
    if spec.command.is_empty() {
        return Err(bad(
            "command",
            format!("language \"{language}\" needs a command, e.g. [\"node\", \"{{file}}\"]"),
        ));
    }
    if !spec.command.iter().any(|a| a.contains("{file}")) {
        return Err(bad(
            "command",
            "expected the program file as {file} in one of the arguments",
        ));
    }
    if let Some(f) = &raw.file_name {
        let plain = !f.is_empty() && f != "scratch" && !f.contains('/') && f != "..";
        if !plain {
            return Err(bad(
                "file_name",
                format!("expected a plain file name, got \"{f}\""),
            ));
        }
        spec.file_name = f.clone();
    }
    if let Some(k) = &raw.tests_key {
        spec.tests_key = k.clone();
    }
    if let Some(s) = &raw.scoring {
        spec.scoring = Scoring::from_name(s).ok_or_else(|| {
            bad(
                "scoring",
                format!("expected \"fraction\" or \"all\", got \"{s}\""),
            )
        })?;
    }
    spec.workers = at_least_one("workers", raw.workers, spec.workers)?;
    let d = Limits::default();
    let timeout = positive("timeout_s", raw.timeout_s, d.timeout.as_secs_f64())?;
    if timeout > call_limit {
        return Err(bad(
            "timeout_s",
            format!("a run's {timeout} s cannot fit in [reward] timeout_s = {call_limit} s, the limit of one response's call; raise reward.timeout_s"),
        ));
    }
    spec.limits = Limits {
        timeout: Duration::from_secs_f64(timeout),
        cpu_s: at_least_one("cpu_s", raw.cpu_s, d.cpu_s)?,
        memory_mb: at_least_one("memory_mb", raw.memory_mb, d.memory_mb)?,
        file_size_mb: at_least_one("file_size_mb", raw.file_size_mb, d.file_size_mb)?,
        max_processes: at_least_one("max_processes", raw.max_processes, d.max_processes)?,
        max_open_files: at_least_one("max_open_files", raw.max_open_files, d.max_open_files)?,
        output_bytes: at_least_one("output_bytes", raw.output_bytes, d.output_bytes)?,
        scratch_mb: at_least_one("scratch_mb", raw.scratch_mb, d.scratch_mb)?,
    };
    Ok(spec)
}

fn http_spec(raw: &RewardFunctionConfig, call_limit: f64) -> Result<HttpSpec, BadKey> {
    let url = raw
        .url
        .clone()
        .ok_or_else(|| bad("url", "type \"http\" needs a `url`"))?;
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(bad(
            "url",
            format!("expected an http:// or https:// URL, got \"{url}\""),
        ));
    }
    let d = HttpSpec::new(&url);
    let timeout = positive("timeout_s", raw.timeout_s, d.timeout.as_secs_f64())?;
    let backoff = match raw.backoff_s.unwrap_or(d.backoff.as_secs_f64()) {
        b if b >= 0.0 && b.is_finite() => b,
        b => {
            return Err(bad(
                "backoff_s",
                format!("expected a non-negative number, got {b}"),
            ))
        }
    };
    let retries = raw.max_retries.unwrap_or(d.max_retries);
    // Every attempt timing out, with every backoff between them.
    let worst = timeout * f64::from(retries + 1) + backoff * (2f64.powi(retries as i32) - 1.0);
    if worst > call_limit {
        return Err(bad(
            "timeout_s",
            format!("{} attempts of {timeout} s with backoff take up to {worst:.2} s, more than [reward] timeout_s = {call_limit} s; raise reward.timeout_s or lower timeout_s / max_retries", retries + 1),
        ));
    }
    Ok(HttpSpec {
        url,
        timeout: Duration::from_secs_f64(timeout),
        max_retries: retries,
        backoff: Duration::from_secs_f64(backoff),
        max_concurrency: at_least_one("max_concurrency", raw.max_concurrency, d.max_concurrency)?,
        batch_size: at_least_one("batch_size", raw.batch_size, d.batch_size)?,
    })
}

fn model_spec(raw: &RewardFunctionConfig) -> Result<RewardModelSpec, BadKey> {
    let path = raw.path.clone().ok_or_else(|| {
        bad(
            "path",
            "type \"reward_model\" needs a `path` (a directory or a hub id)",
        )
    })?;
    let d = RewardModelSpec::new(&path);
    let number = |key: &'static str, v: Option<f64>, default: f64| match v.unwrap_or(default) {
        x if x.is_finite() => Ok(x),
        x => Err(bad(key, format!("expected a number, got {x}"))),
    };
    Ok(RewardModelSpec {
        dtype: match raw.dtype.as_deref().unwrap_or("f32") {
            "f32" => candle_core::DType::F32,
            "bf16" => candle_core::DType::BF16,
            "f16" => candle_core::DType::F16,
            other => {
                return Err(bad(
                    "dtype",
                    format!("expected \"f32\", \"bf16\" or \"f16\", got \"{other}\""),
                ))
            }
        },
        batch_size: at_least_one("batch_size", raw.batch_size, d.batch_size)?,
        normalize: match &raw.normalize {
            None => d.normalize,
            Some(n) => Normalize::from_name(n).ok_or_else(|| {
                bad(
                    "normalize",
                    format!("expected \"none\" or \"running\", got \"{n}\""),
                )
            })?,
        },
        scale: number("scale", raw.scale, d.scale)?,
        shift: number("shift", raw.shift, d.shift)?,
        path,
    })
}
