//! `oxrl sweep`: a small grid of runs over one configuration — every combination of the
//! `--grid` values — run one after another as `oxrl train` processes (or printed as the
//! commands a cluster's scheduler launches), ending with `oxrl compare`'s leaderboard and
//! chart of them all.

use crate::output::say;
use anyhow::{bail, Context, Result};
use oxrl_train::overrides::Override;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(clap::Args)]
pub struct SweepArgs {
    /// The run configuration every point starts from.
    #[arg(long)]
    config: PathBuf,
    /// A key and the values it takes, `section.key=v1,v2,...` (repeatable; the grid is every
    /// combination). Values are split at commas: give array values with --set.
    #[arg(long = "grid", value_name = "KEY=V1,V2", required = true)]
    grid: Vec<String>,
    /// A change every point shares, `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<Override>,
    /// Where the points' run directories go; default: the config's output_dir + "-sweep".
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Overrides [trainer] max_steps for every point.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Print each point's `oxrl train` command (one per line) instead of running them.
    #[arg(long)]
    print_commands: bool,
    /// Continue each point from its newest checkpoint (points already finished end at once).
    #[arg(long)]
    resume: bool,
    /// The metric the leaderboard ranks by.
    #[arg(long, default_value = "reward_mean")]
    metric: String,
}

/// One point of the grid: its run directory's name and its overrides.
struct Point {
    name: String,
    overrides: Vec<Override>,
}

/// Every combination of the `--grid` axes, the first axis varying slowest.
fn points(grid: &[String]) -> Result<Vec<Point>> {
    let mut points = vec![Point {
        name: String::new(),
        overrides: Vec::new(),
    }];
    for axis in grid {
        let (key, values) = axis
            .split_once('=')
            .with_context(|| format!("--grid {axis}: expected section.key=v1,v2,..."))?;
        let values: Vec<&str> = values.split(',').map(str::trim).collect();
        if values.iter().any(|v| v.is_empty()) {
            bail!("--grid {axis}: an empty value");
        }
        let short = key.rsplit('.').next().unwrap_or(key).trim();
        let mut next = Vec::with_capacity(points.len() * values.len());
        for p in &points {
            for v in &values {
                let o: Override = format!("{key}={v}")
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!("--grid {axis}: {e}"))?;
                let label: String = format!("{short}={v}")
                    .chars()
                    .map(|c| match c {
                        '/' | ' ' | '"' | '\'' => '_',
                        c => c,
                    })
                    .collect();
                let mut overrides = p.overrides.clone();
                overrides.push(o);
                next.push(Point {
                    name: match p.name.is_empty() {
                        true => label,
                        false => format!("{}_{label}", p.name),
                    },
                    overrides,
                });
            }
        }
        points = next;
    }
    Ok(points)
}

/// The `oxrl train` arguments of one point.
fn train_args(args: &SweepArgs, point: &Point, run_dir: &Path) -> Vec<String> {
    let mut argv = vec![
        "train".to_string(),
        "--config".into(),
        args.config.display().to_string(),
    ];
    for o in args.overrides.iter().chain(&point.overrides) {
        argv.push("--set".into());
        argv.push(o.to_string());
    }
    argv.push("--output-dir".into());
    argv.push(run_dir.display().to_string());
    if let Some(n) = args.max_steps {
        argv.push("--max-steps".into());
        argv.push(n.to_string());
    }
    if args.resume {
        argv.push("--resume".into());
    }
    argv
}

/// An argument as a POSIX shell reads it back.
fn shell_quote(arg: &str) -> String {
    let plain = arg
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./=:+,@".contains(c));
    match plain {
        true => arg.to_string(),
        false => format!("'{}'", arg.replace('\'', r"'\''")),
    }
}

pub fn run(args: SweepArgs) -> Result<()> {
    let points = points(&args.grid)?;
    // Every point's configuration is checked before the first one starts.
    let base = crate::train::load_with(&args.config, &args.overrides)?;
    for p in &points {
        let all: Vec<Override> = args.overrides.iter().chain(&p.overrides).cloned().collect();
        crate::train::load_with(&args.config, &all)
            .with_context(|| format!("sweep point {}", p.name))?;
    }
    let sweep_dir = args.output_dir.clone().unwrap_or_else(|| {
        let mut name = base.output_dir.as_os_str().to_owned();
        name.push("-sweep");
        PathBuf::from(name)
    });
    let run_dirs: Vec<PathBuf> = points.iter().map(|p| sweep_dir.join(&p.name)).collect();
    if args.print_commands {
        for (p, dir) in points.iter().zip(&run_dirs) {
            let argv: Vec<String> = std::iter::once("oxrl".to_string())
                .chain(train_args(&args, p, dir))
                .map(|a| shell_quote(&a))
                .collect();
            say!("{}", argv.join(" "))?;
        }
        return Ok(());
    }
    let exe = std::env::current_exe().context("finding the oxrl executable")?;
    for (i, (p, dir)) in points.iter().zip(&run_dirs).enumerate() {
        say!(
            "sweep point {}/{}: {} → {}",
            i + 1,
            points.len(),
            p.name,
            dir.display()
        )?;
        let status = Command::new(&exe)
            .args(train_args(&args, p, dir))
            .status()
            .with_context(|| format!("starting {}", exe.display()))?;
        if !status.success() {
            bail!(
                "sweep point {} ({}) stopped ({status}); the points before it are complete: \
                 run the same command with --resume to continue",
                p.name,
                dir.display()
            );
        }
    }
    let chart = sweep_dir.join("compare.svg");
    crate::compare::leaderboard(&run_dirs, &args.metric, Some(&chart))?;
    say!("chart {}", chart.display())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_is_every_combination_first_axis_slowest() {
        let grid = vec![
            "trainer.lr=1e-4,3e-4".to_string(),
            "algorithm.advantage=grpo,rloo".to_string(),
        ];
        let names: Vec<String> = points(&grid).unwrap().into_iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "lr=1e-4_advantage=grpo",
                "lr=1e-4_advantage=rloo",
                "lr=3e-4_advantage=grpo",
                "lr=3e-4_advantage=rloo"
            ]
        );
        let p = &points(&grid).unwrap()[3];
        assert_eq!(p.overrides[1].value, "\"rloo\"");
        assert!(points(&["trainer.lr".to_string()]).is_err());
        assert!(points(&["trainer.lr=1,,2".to_string()]).is_err());
    }

    #[test]
    fn printed_arguments_survive_the_shell() {
        assert_eq!(shell_quote("trainer.lr=1e-4"), "trainer.lr=1e-4");
        assert_eq!(
            shell_quote("algorithm.advantage=\"rloo\""),
            "'algorithm.advantage=\"rloo\"'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
