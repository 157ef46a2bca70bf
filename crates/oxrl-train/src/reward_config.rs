//! `[[reward.functions]]` tables resolved into the specs `oxrl-reward` builds functions from.
//! Which keys each type takes, their kinds and defaults are in the key catalogue
//! ([`crate::config_keys::KEYS`], section `reward.functions`), checked when the file is read;
//! what is left here are the checks that relate keys (a command with `{file}`, limits that fit
//! in `[reward] timeout_s`). Everything here runs before any model loads.

use crate::config_file::{default_value, FromToml};
use crate::config_keys::{reward_types, spec};
use oxrl_reward::code::{CodeSpec, Scoring};
use oxrl_reward::rules::RULE_TYPES;
use oxrl_reward::sandbox::Limits;
use oxrl_reward::{HttpSpec, Normalize, RewardModelSpec, RuleSpec};
use std::time::Duration;

/// One `[[reward.functions]]` table whose keys have passed the catalogue's checks.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionTable {
    kind: String,
    values: toml::Table,
}

impl FunctionTable {
    pub(crate) fn new(kind: String, values: toml::Table) -> Self {
        Self { kind, values }
    }

    /// The reward type.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The table's value of `key`, else the catalogue default; `None` when neither (the
    /// default is the type's own, in `oxrl-reward`).
    fn get<T: FromToml>(&self, key: &str) -> Option<T> {
        match self.values.get(key) {
            Some(v) => T::from_toml(v),
            None => spec("reward.functions", key)
                .and_then(default_value)
                .and_then(|v| T::from_toml(&v)),
        }
    }
}

/// What a reward function is, resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum RewardKind {
    Rule(RuleSpec),
    Code(CodeSpec),
    Http(HttpSpec),
    Model(RewardModelSpec),
}

impl RewardFunction {
    /// The data column every row must have for this function to score it, with the key that
    /// names it: the answer of `math_answer` / `exact_match`, the tests of `code`.
    pub fn required_column(&self) -> Option<(&str, &'static str)> {
        match &self.kind {
            RewardKind::Rule(r) if matches!(r.kind.as_str(), "math_answer" | "exact_match") => {
                Some((&r.answer_key, "answer_key"))
            }
            RewardKind::Code(c) => Some((&c.tests_key, "tests_key")),
            _ => None,
        }
    }
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

/// Resolves one table. `answer_key` is `[data] answer_key` (the rules' default column);
/// `call_limit` is `[reward] timeout_s`, which every single call must be able to finish in.
pub fn resolve_function(
    table: &FunctionTable,
    answer_key: &str,
    call_limit: f64,
) -> Result<RewardFunction, BadKey> {
    let kind = match table.kind() {
        "code" => RewardKind::Code(code_spec(table, call_limit)?),
        "http" => RewardKind::Http(http_spec(table, call_limit)?),
        "reward_model" => RewardKind::Model(model_spec(table)?),
        kind if RULE_TYPES.contains(&kind) => {
            let spec = RuleSpec {
                kind: kind.to_string(),
                pattern: table.get("pattern"),
                tolerance: table.get("tolerance"),
                target_length: table.get("target_length"),
                answer_key: table.get("answer_key").unwrap_or_else(|| answer_key.into()),
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
        name: table
            .get("name")
            .unwrap_or_else(|| table.kind().to_string()),
        weight: table.get("weight").unwrap_or(1.0),
        kind,
    })
}

/// `from_name` of a choice the catalogue has already checked, as a `BadKey` if the two lists
/// ever disagree.
fn named<T>(key: &'static str, name: &str, from_name: fn(&str) -> Option<T>) -> Result<T, BadKey> {
    from_name(name).ok_or_else(|| bad(key, format!("unknown value \"{name}\"")))
}

fn code_spec(table: &FunctionTable, call_limit: f64) -> Result<CodeSpec, BadKey> {
    let language: String = table.get("language").unwrap_or_else(|| "python".into());
    if language.trim().is_empty() || language.contains(char::is_whitespace) {
        return Err(bad("language", "expected a fence tag such as \"python\""));
    }
    let mut spec = CodeSpec::for_language(&language);
    if let Some(command) = table.get("command") {
        spec.command = command;
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
    if let Some(f) = table.get::<String>("file_name") {
        let plain = !f.is_empty() && f != "scratch" && !f.contains('/') && f != "..";
        if !plain {
            return Err(bad(
                "file_name",
                format!("expected a plain file name, got \"{f}\""),
            ));
        }
        spec.file_name = f;
    }
    if let Some(k) = table.get("tests_key") {
        spec.tests_key = k;
    }
    if let Some(s) = table.get::<String>("scoring") {
        spec.scoring = named("scoring", &s, Scoring::from_name)?;
    }
    spec.workers = table.get("workers").unwrap_or(spec.workers);
    let d = Limits::default();
    let timeout = table.get("timeout_s").unwrap_or(d.timeout.as_secs_f64());
    if timeout > call_limit {
        return Err(bad(
            "timeout_s",
            format!("a run's {timeout} s cannot fit in [reward] timeout_s = {call_limit} s, the limit of one response's call; raise reward.timeout_s"),
        ));
    }
    spec.limits = Limits {
        timeout: Duration::from_secs_f64(timeout),
        cpu_s: table.get("cpu_s").unwrap_or(d.cpu_s),
        memory_mb: table.get("memory_mb").unwrap_or(d.memory_mb),
        file_size_mb: table.get("file_size_mb").unwrap_or(d.file_size_mb),
        max_processes: table.get("max_processes").unwrap_or(d.max_processes),
        max_open_files: table.get("max_open_files").unwrap_or(d.max_open_files),
        output_bytes: table.get("output_bytes").unwrap_or(d.output_bytes),
        scratch_mb: table.get("scratch_mb").unwrap_or(d.scratch_mb),
    };
    Ok(spec)
}

fn http_spec(table: &FunctionTable, call_limit: f64) -> Result<HttpSpec, BadKey> {
    let url: String = table
        .get("url")
        .ok_or_else(|| bad("url", "type \"http\" needs a `url`"))?;
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(bad(
            "url",
            format!("expected an http:// or https:// URL, got \"{url}\""),
        ));
    }
    let d = HttpSpec::new(&url);
    let timeout = table.get("timeout_s").unwrap_or(d.timeout.as_secs_f64());
    let backoff = table.get("backoff_s").unwrap_or(d.backoff.as_secs_f64());
    let retries: u32 = table.get("max_retries").unwrap_or(d.max_retries);
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
        max_concurrency: table.get("max_concurrency").unwrap_or(d.max_concurrency),
        batch_size: table.get("batch_size").unwrap_or(d.batch_size),
    })
}

fn model_spec(table: &FunctionTable) -> Result<RewardModelSpec, BadKey> {
    let path: String = table.get("path").ok_or_else(|| {
        bad(
            "path",
            "type \"reward_model\" needs a `path` (a directory or a hub id)",
        )
    })?;
    let d = RewardModelSpec::new(&path);
    let dtype: String = table.get("dtype").unwrap_or_else(|| "f32".into());
    Ok(RewardModelSpec {
        dtype: named("dtype", &dtype, dtype_from_name)?,
        batch_size: table.get("batch_size").unwrap_or(d.batch_size),
        normalize: match table.get::<String>("normalize") {
            None => d.normalize,
            Some(n) => named("normalize", &n, Normalize::from_name)?,
        },
        scale: table.get("scale").unwrap_or(d.scale),
        shift: table.get("shift").unwrap_or(d.shift),
        path,
    })
}

fn dtype_from_name(name: &str) -> Option<candle_core::DType> {
    match name {
        "f32" => Some(candle_core::DType::F32),
        "bf16" => Some(candle_core::DType::BF16),
        "f16" => Some(candle_core::DType::F16),
        _ => None,
    }
}
