//! `oxrl compare RUN_DIR...`: a leaderboard of training runs from their output directories —
//! final and best reward, validation scores, throughput and wall time, and the configuration
//! keys that differ between them — plus one SVG chart overlaying their reward curves.

use crate::output::table;
use anyhow::{bail, Context, Result};
use oxrl_train::observe::write_svg_lines;
use oxrl_train::run_dir::CONFIG_COPY;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// Output directories of `oxrl train` runs (each with its metrics.jsonl).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// The metric the runs are ranked and charted by.
    #[arg(long, default_value = "reward_mean")]
    metric: String,
    /// Where to write the chart of every run's metric per step (SVG).
    #[arg(long)]
    chart: Option<PathBuf>,
}

/// What one run's metrics say.
struct Run {
    name: String,
    /// `(step, metric)` of every training step.
    curve: Vec<(u64, f64)>,
    steps: u64,
    /// `val/reward_mean` at each validation.
    validation: Vec<f64>,
    tokens_per_s: Option<f64>,
    wall_s: f64,
    /// The run's configuration, flattened to `section.key = value`.
    config: BTreeMap<String, String>,
}

impl Run {
    /// The metric's mean over the last 10 steps (fewer in a shorter run).
    fn last(&self) -> Option<f64> {
        let k = self.curve.len().min(10);
        (k > 0).then(|| {
            self.curve[self.curve.len() - k..]
                .iter()
                .map(|(_, v)| v)
                .sum::<f64>()
                / k as f64
        })
    }

    fn best(&self) -> Option<f64> {
        self.curve.iter().map(|(_, v)| *v).reduce(f64::max)
    }
}

fn read_run(dir: &Path, metric: &str) -> Result<Run> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: not a run directory (no metrics.jsonl)", dir.display()))?;
    let mut run = Run {
        name: dir.display().to_string(),
        curve: Vec::new(),
        steps: 0,
        validation: Vec::new(),
        tokens_per_s: None,
        wall_s: 0.0,
        config: read_config(&dir.join(CONFIG_COPY))?,
    };
    let mut throughput = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let m: Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON line", path.display(), i + 1))?;
        let step = m.get("step").and_then(Value::as_u64).unwrap_or(0);
        run.steps = run.steps.max(step);
        let number = |key: &str| m.get(key).and_then(Value::as_f64);
        if let Some(v) = number(metric) {
            run.curve.push((step, v));
        }
        if let Some(v) = number("val/reward_mean") {
            run.validation.push(v);
        }
        if let Some(v) = number("tokens_per_s") {
            throughput.push(v);
        }
        run.wall_s += number("time/step").unwrap_or(0.0);
    }
    if !throughput.is_empty() {
        run.tokens_per_s = Some(throughput.iter().sum::<f64>() / throughput.len() as f64);
    }
    Ok(run)
}

/// A run's `config.toml` as `section.key` → value text; empty when the run kept none.
fn read_config(path: &Path) -> Result<BTreeMap<String, String>> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(BTreeMap::new());
    };
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("{}: not valid TOML", path.display()))?;
    let mut out = BTreeMap::new();
    flatten("", &toml::Value::Table(table), &mut out);
    Ok(out)
}

fn flatten(prefix: &str, value: &toml::Value, out: &mut BTreeMap<String, String>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = match prefix {
                    "" => k.clone(),
                    p => format!("{p}.{k}"),
                };
                flatten(&key, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

fn cell(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.digits$}"))
}

pub fn run(args: CompareArgs) -> Result<()> {
    leaderboard(&args.runs, &args.metric, args.chart.as_deref())
}

/// Prints the leaderboard of the runs in `dirs`, ranked by `metric`, and writes `chart` (SVG)
/// when given.
pub fn leaderboard(dirs: &[PathBuf], metric: &str, chart: Option<&Path>) -> Result<()> {
    let mut runs = dirs
        .iter()
        .map(|d| read_run(d, metric))
        .collect::<Result<Vec<_>>>()?;
    if runs.iter().all(|r| r.curve.is_empty()) {
        bail!("no run logged `{metric}`");
    }
    // Best first, by the metric's final value.
    runs.sort_by(|a, b| {
        let key = |r: &Run| r.last().unwrap_or(f64::NEG_INFINITY);
        key(b).total_cmp(&key(a))
    });
    let mut rows = vec![[
        "rank",
        "run",
        "steps",
        &format!("{metric} (last 10)"),
        "best",
        "val last",
        "val best",
        "tokens/s",
        "wall s",
    ]
    .map(String::from)
    .to_vec()];
    for (i, r) in runs.iter().enumerate() {
        rows.push(vec![
            (i + 1).to_string(),
            r.name.clone(),
            r.steps.to_string(),
            cell(r.last(), 4),
            cell(r.best(), 4),
            cell(r.validation.last().copied(), 4),
            cell(r.validation.iter().copied().reduce(f64::max), 4),
            cell(r.tokens_per_s, 0),
            format!("{:.1}", r.wall_s),
        ]);
    }
    let mut out = table(&rows);
    let keys: BTreeSet<&String> = runs.iter().flat_map(|r| r.config.keys()).collect();
    let differing: Vec<&String> = keys
        .into_iter()
        .filter(|k| {
            let values: BTreeSet<Option<&String>> = runs.iter().map(|r| r.config.get(*k)).collect();
            values.len() > 1
        })
        .collect();
    if !differing.is_empty() {
        out.push_str("\nconfiguration differences:\n");
        let mut rows = vec![std::iter::once("key".to_string())
            .chain((1..=runs.len()).map(|i| format!("#{i}")))
            .collect::<Vec<_>>()];
        for k in differing {
            rows.push(
                std::iter::once(k.clone())
                    .chain(
                        runs.iter()
                            .map(|r| r.config.get(k).cloned().unwrap_or("-".into())),
                    )
                    .collect(),
            );
        }
        out.push_str(&table(&rows));
    }
    crate::output::print_text(&out)?;
    if let Some(chart) = chart {
        let lines: Vec<(String, Vec<(u64, f64)>)> = runs
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("#{} {}", i + 1, r.name), r.curve.clone()))
            .collect();
        write_svg_lines(chart, &format!("{metric} per step"), &lines)
            .with_context(|| chart.display().to_string())?;
    }
    Ok(())
}
