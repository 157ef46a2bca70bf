//! `oxrl train`, `oxrl sft` and `oxrl config`: the training commands over a run configuration.

use crate::output::{print_text, say};
use anyhow::{bail, Context, Result};
use oxrl_dist::{DistEnv, ProcessGroup};
use oxrl_models::DeviceSpec;
use oxrl_train::overrides::{self, Override};
use oxrl_train::{config, replay_parallel, sft, DataParallel, GrpoRun, Interrupt, RunConfig};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

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
    /// Changes a configuration key: `section.key=value` (repeatable), e.g.
    /// `--set trainer.lr=1e-5 --set algorithm.advantage=rloo`. The run keeps the changed
    /// configuration in its output directory.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<Override>,
    /// Continue from the newest complete checkpoint in the output directory.
    #[arg(long)]
    resume: bool,
    /// Write each step's trajectories to <output_dir>/rollouts/step-<N>.jsonl (replayable).
    #[arg(long)]
    save_rollouts: bool,
    /// Overrides [model] device: cpu, cuda (the first GPU) or cuda:N.
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// Start even when `oxrl plan` estimates that the update does not fit the device.
    #[arg(long)]
    skip_memory_check: bool,
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
    /// Changes a configuration key: `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<Override>,
    #[arg(long)]
    resume: bool,
    /// Overrides [model] device: cpu, cuda (the first GPU) or cuda:N.
    #[arg(long)]
    device: Option<DeviceSpec>,
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

/// The configuration in `path` with `overrides` applied to its text.
pub fn load_with(path: &Path, overrides: &[Override]) -> Result<RunConfig> {
    if overrides.is_empty() {
        return Ok(RunConfig::from_file(path)?);
    }
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let text = overrides::apply(&text, overrides)
        .map_err(|e| anyhow::anyhow!("{}: --set {e}", path.display()))?;
    RunConfig::from_str(&text, path).with_context(|| {
        let set: Vec<String> = overrides.iter().map(|o| format!("--set {o}")).collect();
        format!("with {}", set.join(" "))
    })
}

fn load(
    path: &Path,
    overrides: &[Override],
    max_steps: Option<u64>,
    output_dir: Option<PathBuf>,
    device: Option<DeviceSpec>,
) -> Result<RunConfig> {
    let mut cfg = load_with(path, overrides)?;
    if let Some(d) = device {
        cfg.device = d;
    }
    if let Some(n) = max_steps {
        cfg.max_steps = n;
    }
    if let Some(d) = output_dir {
        cfg.output_dir = d;
    }
    Ok(cfg)
}

/// The exit status of a run a signal stopped: 128 + the signal, as if it had killed the process.
fn interrupted_status(signal: i32) -> ExitCode {
    ExitCode::from(u8::try_from(128 + signal).unwrap_or(u8::MAX))
}

/// Tells how an interrupted run ended and how to continue it.
fn report_interrupt(signal: i32, steps: u64, checkpoint: Option<&Path>) -> Result<ExitCode> {
    let name = match signal {
        2 => "SIGINT".to_string(),
        15 => "SIGTERM".to_string(),
        s => format!("signal {s}"),
    };
    match checkpoint {
        Some(dir) => say!(
            "interrupted by {name} after step {steps}; checkpoint {} is complete: continue with \
             --resume",
            dir.display()
        )?,
        None => say!("interrupted by {name} before a step finished; nothing new was saved")?,
    }
    Ok(interrupted_status(signal))
}

/// Refuses a run the planner says cannot fit its device, before anything loads.
fn check_memory(cfg: &RunConfig) -> Result<()> {
    let device = cfg.device.open()?;
    let Some(memory) = crate::device_memory::capacity(&device)? else {
        return Ok(());
    };
    crate::plan::check_fits(cfg, &cfg.device.to_string(), memory as f64)
}

pub fn train(args: TrainArgs, interrupt: &Interrupt) -> Result<ExitCode> {
    let path = match args.config {
        Some(p) => p,
        None if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
        None => bail!("no --config given and {DEFAULT_CONFIG} is not here (run from the repository root, or pass --config)"),
    };
    let mut cfg = load(
        &path,
        &args.overrides,
        args.max_steps,
        args.output_dir,
        args.device,
    )?;
    let env = DistEnv::from_env()?;
    check_world_size(&cfg, &env)?;
    cfg.device = crate::dist_check::rank_device(cfg.device, &env);
    crate::dist_check::share_cores(&env, cfg.device);
    if !args.skip_memory_check {
        check_memory(&cfg)?;
    }
    // Held for the run: rank 0's rendezvous store serves the group while it trains.
    let group = join_group(env, cfg.device)?;
    let parallel = DataParallel::new(group.collective());
    let main = parallel.is_main();
    if let Some(rollouts) = args.rollouts {
        let m = replay_parallel(&cfg, &rollouts, parallel)?;
        if !main {
            return Ok(ExitCode::SUCCESS);
        }
        let show = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
        say!(
            "replayed {}: loss {:.6} pg_loss {:.6} kl {:.6} grad_norm {:.6}; checkpoint in {}",
            rollouts.display(),
            show("loss"),
            show("pg_loss"),
            show("kl"),
            show("grad_norm"),
            cfg.output_dir.join("checkpoint-1").display()
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let max_steps = cfg.max_steps;
    let mut run = GrpoRun::new_parallel(cfg, args.resume, args.save_rollouts, parallel)?;
    let s = run.run(max_steps, interrupt)?;
    if !main {
        return Ok(ExitCode::SUCCESS);
    }
    if let Some((signal, checkpoint)) = &s.interrupted {
        return report_interrupt(*signal, s.steps, checkpoint.as_deref());
    }
    say!(
        "reward: {:.3} (first 10 steps) → {:.3} (last 10 steps) over {} steps; chart {}, metrics {}",
        s.reward_start,
        s.reward_end,
        s.steps,
        s.output_dir.join("reward.svg").display(),
        s.output_dir.join("metrics.jsonl").display()
    )?;
    Ok(ExitCode::SUCCESS)
}

/// The group this process's launcher started it in (one process without a launcher): NCCL
/// between GPU ranks in the CUDA build, the TCP ring between CPU ranks.
fn join_group(env: DistEnv, device: DeviceSpec) -> Result<ProcessGroup> {
    let (rank, world) = (env.rank, env.world_size);
    let timeout = oxrl_dist::timeout_from_env()?;
    let joined = match device {
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda(_) if world > 1 => ProcessGroup::join_gpu(env, &device.open()?, timeout),
        _ => ProcessGroup::join_cpu(env, timeout),
    };
    joined.with_context(|| format!("rank {rank} of {world} joining the process group"))
}

/// `num_gpus` is the number of processes the launcher must start: a run that asks for
/// several without a launcher, or under one that started another number, stops here.
fn check_world_size(cfg: &RunConfig, env: &DistEnv) -> Result<()> {
    let Some(n) = cfg.num_gpus.filter(|&n| n > 1) else {
        return Ok(());
    };
    if env.world_size == 1 {
        bail!(
            "{}: num_gpus = {n} trains with one process per GPU, started by a launcher:              `torchrun --nproc_per_node {n} --no-python oxrl train --config {}` on one node              (srun, mpirun or the Python package's oxrl.ray on a cluster; see docs/distributed.md)",
            cfg.source.display(),
            cfg.source.display()
        );
    }
    if env.world_size != n {
        bail!(
            "{}: num_gpus = {n}, but the launcher ({}) started {} processes",
            cfg.source.display(),
            env.launcher,
            env.world_size
        );
    }
    Ok(())
}

pub fn sft(args: SftArgs, interrupt: &Interrupt) -> Result<ExitCode> {
    let cfg = load(
        &args.config,
        &args.overrides,
        args.max_steps,
        args.output_dir,
        args.device,
    )?;
    if DistEnv::from_env()?.world_size > 1 {
        bail!(
            "oxrl sft runs as one process in this version; data-parallel training is `oxrl train`'s"
        );
    }
    let s = sft::run(&cfg, args.resume, interrupt)?;
    if let Some(signal) = s.interrupted {
        let saved = s
            .last
            .starts_with(&cfg.output_dir)
            .then_some(s.last.as_path());
        return report_interrupt(signal, s.steps, saved);
    }
    say!("sft done: final checkpoint {}", s.last.display())?;
    Ok(ExitCode::SUCCESS)
}

pub fn config(args: ConfigArgs) -> Result<()> {
    if let Some(path) = args.check {
        let cfg = RunConfig::from_file(&path)?;
        return say!("{cfg:#?}");
    }
    if !args.explain {
        bail!("give --explain (every key) or --check FILE");
    }
    match args.markdown {
        true => print_text(&config::markdown()),
        false => print_text(&config::explain()),
    }
}
