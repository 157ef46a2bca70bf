//! `oxrl train`, `oxrl sft` and `oxrl config`: the training commands over a run configuration.

use anyhow::{bail, Result};
use oxrl_train::{config, replay, sft, GrpoRun, RunConfig};
use std::path::{Path, PathBuf};

/// The config `oxrl train` runs when given none: the demo that ships with the repository.
const DEFAULT_CONFIG: &str = "examples/arithmetic/grpo.toml";

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Run configuration (TOML); default: the bundled demo, examples/arithmetic/grpo.toml.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Train on recorded trajectories (JSONL) instead of sampling: the whole file is one batch.
    #[arg(long)]
    rollouts: Option<PathBuf>,
    /// Overrides [trainer] max_steps.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Overrides [trainer] output_dir.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Continue from the newest complete checkpoint in the output directory.
    #[arg(long)]
    resume: bool,
    /// Write each step's trajectories to <output_dir>/rollouts/step-<N>.jsonl (replayable).
    #[arg(long)]
    save_rollouts: bool,
}

#[derive(clap::Args)]
pub struct SftArgs {
    /// Run configuration (TOML): [model], [data] (chat rows), [trainer].
    #[arg(long)]
    config: PathBuf,
    #[arg(long)]
    max_steps: Option<u64>,
    #[arg(long)]
    output_dir: Option<PathBuf>,
    #[arg(long)]
    resume: bool,
}

#[derive(clap::Args)]
pub struct ConfigArgs {
    /// Print every configuration key with its type, default and meaning.
    #[arg(long)]
    explain: bool,
    /// With --explain: print the key list as the README's Markdown tables.
    #[arg(long, requires = "explain")]
    markdown: bool,
    /// Validate a configuration file and print what it resolves to.
    #[arg(long)]
    check: Option<PathBuf>,
}

fn load(path: &Path, max_steps: Option<u64>, output_dir: Option<PathBuf>) -> Result<RunConfig> {
    let mut cfg = RunConfig::from_file(path)?;
    if let Some(n) = max_steps {
        cfg.max_steps = n;
    }
    if let Some(d) = output_dir {
        cfg.output_dir = d;
    }
    Ok(cfg)
}

pub fn train(args: TrainArgs) -> Result<()> {
    let path = match args.config {
        Some(p) => p,
        None if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
        None => bail!("no --config given and {DEFAULT_CONFIG} is not here (run from the repository root, or pass --config)"),
    };
    let cfg = load(&path, args.max_steps, args.output_dir)?;
    if let Some(rollouts) = args.rollouts {
        let m = replay(&cfg, &rollouts)?;
        let show = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
        println!(
            "replayed {}: loss {:.6} pg_loss {:.6} kl {:.6} grad_norm {:.6}; checkpoint in {}",
            rollouts.display(),
            show("loss"),
            show("pg_loss"),
            show("kl"),
            show("grad_norm"),
            cfg.output_dir.join("checkpoint-1").display()
        );
        return Ok(());
    }
    let max_steps = cfg.max_steps;
    let mut run = GrpoRun::new(cfg, args.resume, args.save_rollouts)?;
    let s = run.run(max_steps)?;
    println!(
        "reward: {:.3} (first 10 steps) → {:.3} (last 10 steps) over {} steps; chart {}, metrics {}",
        s.reward_start,
        s.reward_end,
        s.steps,
        s.output_dir.join("reward.svg").display(),
        s.output_dir.join("metrics.jsonl").display()
    );
    Ok(())
}

pub fn sft(args: SftArgs) -> Result<()> {
    let cfg = load(&args.config, args.max_steps, args.output_dir)?;
    let last = sft::run(&cfg, args.resume)?;
    println!("sft done: final checkpoint {}", last.display());
    Ok(())
}

pub fn config(args: ConfigArgs) -> Result<()> {
    if let Some(path) = args.check {
        let cfg = RunConfig::from_file(&path)?;
        println!("{cfg:#?}");
        return Ok(());
    }
    if !args.explain {
        bail!("give --explain (every key) or --check FILE");
    }
    match args.markdown {
        true => print!("{}", config::markdown()),
        false => print!("{}", config::explain()),
    }
    Ok(())
}
