//! `oxrl eval`: one or more checkpoints on a dataset, scored as a run configuration scores its
//! training (its `[[reward.functions]]` or `[environment]`), with a summary table — mean
//! reward, pass@k, per-function means, throughput — and every response as JSONL.

use crate::output::{print_text, table, write_jsonl};
use anyhow::{bail, Result};
use oxrl_train::eval::{evaluate, EvalReport, EvalSettings};
use oxrl_train::RunConfig;
use serde_json::{json, Map, Value};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint to evaluate (a directory or hub id); repeat it to compare several.
    #[arg(long = "model", required = true)]
    models: Vec<String>,
    /// The run configuration whose `[data]` columns, `[rollout]` limits and rewards (or
    /// environment) apply; its `[model]` dtype and device too.
    #[arg(long)]
    config: PathBuf,
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

pub fn run(args: EvalArgs) -> Result<()> {
    let cfg = RunConfig::from_file(&args.config)?;
    let data = match args.data.is_empty() {
        true => cfg.data.val_files.clone(),
        false => args.data.clone(),
    };
    if data.is_empty() {
        bail!(
            "{}: no dataset: pass --data, or set [data] val_files",
            args.config.display()
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
