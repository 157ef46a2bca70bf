//! `oxrl eval`: one or more checkpoints on a dataset, scored as a run configuration scores its
//! training (its `[[reward.functions]]` or `[environment]`), or with reward functions named on
//! the command line, with a summary table — mean reward, pass@k, per-function means,
//! throughput — and every response as JSONL.

use crate::output::{print_text, table, write_jsonl};
use anyhow::{anyhow, bail, Result};
use oxrl_train::eval::{evaluate, EvalReport, EvalSettings};
use oxrl_train::overrides::{self, Override};
use oxrl_train::RunConfig;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::str::FromStr;

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint to evaluate (a directory or hub id); repeat it to compare several.
    #[arg(long = "model", required = true)]
    models: Vec<String>,
    /// The run configuration whose `[data]` columns, `[rollout]` limits and rewards (or
    /// environment) apply; its `[model]` dtype and device too. Without it, `--data` and
    /// `--reward` say what to evaluate, with every other key at its default.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Without --config: a reward function scoring the answers, as a `[[reward.functions]]`
    /// table would: `TYPE` or `TYPE:key=value,key=value` (e.g. `math_answer`, `code`,
    /// `format:pattern=^<think>`, `http:url=http://host:9000/score`); repeatable.
    #[arg(
        long = "reward",
        value_name = "TYPE[:KEY=VALUE,...]",
        conflicts_with = "config"
    )]
    rewards: Vec<RewardFlag>,
    /// A configuration key changed for this evaluation, `section.key=value` (e.g.
    /// `rollout.max_new_tokens=1024`, `data.prompt_key=question`); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<Override>,
    /// Dataset(s) to evaluate on (JSONL or Parquet); the config's `[data] val_files` when
    /// absent.
    #[arg(long)]
    data: Vec<PathBuf>,
    /// Samples per prompt (pass@k for k = 1, 2, 4, … and n).
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Sampling temperature; 0 is greedy (with n = 1).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// A sample counts as solved for pass@k when its reward is at least this.
    #[arg(long, default_value_t = 1.0)]
    pass_threshold: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to write every response with its scores (JSONL, written whole).
    #[arg(long)]
    output: Option<PathBuf>,
    /// A vLLM or `oxrl serve` server already serving the (one) `--model`, `http://host:port`
    /// (repeatable: the prompts are spread over them); the answers come from it instead of the
    /// local engine.
    #[arg(long = "server", value_name = "URL")]
    servers: Vec<String>,
}

fn response_lines(r: &EvalReport) -> Vec<Value> {
    r.samples
        .iter()
        .map(|s| {
            let scores: Map<String, Value> = s
                .scores
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            json!({
                "model": r.model, "uid": s.uid, "sample": s.sample, "prompt": s.prompt,
                "response": s.response, "reward": s.reward, "scores": scores,
            })
        })
        .collect()
}

/// `--reward TYPE[:key=value,...]`: one `[[reward.functions]]` table.
#[derive(Debug, Clone)]
pub struct RewardFlag {
    kind: String,
    /// `key = value` lines, the values as TOML.
    keys: Vec<Override>,
}

impl FromStr for RewardFlag {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
        let kind = kind.trim();
        if kind.is_empty() || !kind.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!(
                "`{s}`: expected a reward type, then optionally :key=value,... \
                 (e.g. math_answer, or format:pattern=^<think>)"
            ));
        }
        let keys = rest
            .split(',')
            .filter(|kv| !kv.trim().is_empty())
            .map(|kv| match Override::from_str(kv) {
                Ok(o) if o.section.is_none() => Ok(o),
                _ => Err(format!("`{s}`: `{kv}` is not key=value")),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            kind: kind.to_string(),
            keys,
        })
    }
}

/// The run configuration the flags describe: the model, `data` as the validation files and one
/// `[[reward.functions]]` table per `--reward`, every other key at its default.
fn flags_config(model: &str, data: &[PathBuf], rewards: &[RewardFlag]) -> String {
    let quote = |s: &str| toml::Value::String(s.to_string()).to_string();
    let files: Vec<String> = data.iter().map(|f| quote(&f.to_string_lossy())).collect();
    let mut text = format!(
        "[model]\npath = {}\n\n[data]\nval_files = [{}]\n",
        quote(model),
        files.join(", ")
    );
    for reward in rewards {
        text += &format!("\n[[reward.functions]]\ntype = {}\n", quote(&reward.kind));
        for o in &reward.keys {
            text += &format!("{} = {}\n", o.key, o.value);
        }
    }
    text
}

/// The configuration the evaluation runs with: `--config`'s file, or the one the flags
/// describe (its relative paths from the working directory), with `--set` applied.
fn eval_config(args: &EvalArgs) -> Result<RunConfig> {
    if let Some(path) = &args.config {
        return crate::train::load_with(path, &args.overrides);
    }
    if args.rewards.is_empty() || args.data.is_empty() {
        bail!(
            "say how to score the answers: --config RUN.toml (its data, limits and rewards), or \
             --data FILE with --reward TYPE (e.g. --data val.jsonl --reward math_answer)"
        );
    }
    let text = flags_config(&args.models[0], &args.data, &args.rewards);
    let text = overrides::apply(&text, &args.overrides).map_err(|e| anyhow!("--set {e}"))?;
    let flags = std::env::current_dir()?.join("[oxrl eval flags]");
    RunConfig::from_str(&text, &flags)
        .map_err(|e| anyhow!("{e}\n(the configuration --data, --reward and --set make:)\n{text}"))
}

pub fn run(args: EvalArgs) -> Result<()> {
    let cfg = eval_config(&args)?;
    let data = match args.data.is_empty() {
        true => cfg.data.val_files.clone(),
        false => args.data.clone(),
    };
    if data.is_empty() {
        let config = args
            .config
            .as_deref()
            .unwrap_or(Path::new("the configuration"));
        bail!(
            "{}: no dataset: pass --data, or set [data] val_files",
            config.display()
        );
    }
    if !args.servers.is_empty() && args.models.len() > 1 {
        bail!(
            "--server answers with the model the server serves: give one --model (that \
             checkpoint, for its tokenizer and chat template)"
        );
    }
    let settings = EvalSettings {
        n: args.n,
        temperature: args.temperature,
        pass_threshold: args.pass_threshold,
        seed: args.seed,
    };
    let mut reports = Vec::new();
    for model in &args.models {
        oxrl_train::note!("evaluating {model} on {} ...", data[0].display());
        reports.push(evaluate(&cfg, model, &data, settings, &args.servers)?);
    }
    if let Some(path) = &args.output {
        let lines: Vec<Value> = reports.iter().flat_map(response_lines).collect();
        write_jsonl(Some(path), &lines)?;
    }
    let first = &reports[0];
    let mut header: Vec<String> = vec![
        "model".into(),
        "prompts".into(),
        "n".into(),
        "reward".into(),
    ];
    header.extend(first.pass_at.iter().map(|(k, _)| format!("pass@{k}")));
    header.extend(first.per_function.iter().map(|(name, _)| name.clone()));
    header.extend(["tokens/s".to_string(), "failures".to_string()]);
    let mut rows = vec![header];
    for r in &reports {
        let mut row = vec![
            r.model.clone(),
            r.prompts.to_string(),
            args.n.to_string(),
            format!("{:.4}", r.mean_reward),
        ];
        row.extend(r.pass_at.iter().map(|(_, p)| format!("{p:.4}")));
        row.extend(r.per_function.iter().map(|(_, m)| format!("{m:.4}")));
        row.push(format!(
            "{:.0}",
            r.generated_tokens as f64 / r.seconds.max(1e-9)
        ));
        row.push(r.failures.to_string());
        rows.push(row);
    }
    print_text(&table(&rows))
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxrl_train::reward_config::RewardKind;

    #[test]
    fn reward_flags_become_reward_function_tables() {
        let flags: Vec<RewardFlag> = ["math_answer", "format:pattern=^<think>,weight=0.5"]
            .iter()
            .map(|f| f.parse().unwrap())
            .collect();
        let text = flags_config("policy", &[PathBuf::from("val.jsonl")], &flags);
        let cfg = RunConfig::from_str(&text, Path::new("/work/[oxrl eval flags]")).unwrap();
        assert_eq!(cfg.data.val_files, [PathBuf::from("/work/val.jsonl")]);
        let f = &cfg.reward.functions;
        assert_eq!(f.len(), 2);
        assert_eq!((f[0].name.as_str(), f[1].weight), ("math_answer", 0.5));
        let RewardKind::Rule(format) = &f[1].kind else {
            panic!("{:?}", f[1])
        };
        assert_eq!(format.pattern.as_deref(), Some("^<think>"));
    }

    #[test]
    fn a_malformed_reward_flag_says_what_was_expected() {
        let err = RewardFlag::from_str("format:pattern").unwrap_err();
        assert!(err.contains("`pattern` is not key=value"), "{err}");
        let err = RewardFlag::from_str(":x=1").unwrap_err();
        assert!(err.contains("expected a reward type"), "{err}");
        let text = flags_config("m", &[PathBuf::from("v.jsonl")], &["nope".parse().unwrap()]);
        let err = RunConfig::from_str(&text, Path::new("/w/[oxrl eval flags]")).unwrap_err();
        assert!(err.to_string().contains("math_answer"), "{err}");
    }
}
