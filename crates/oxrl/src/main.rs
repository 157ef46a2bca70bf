//! `oxrl`: the command line of the oxrl post-training framework.

mod bench;
mod bench_serve;
mod compare;
mod device_memory;
mod dist_check;
mod eval;
mod export;
mod generate;
mod input;
mod load;
mod output;
mod plan;
mod score;
mod serve;
mod sweep;
mod train;

use clap::{Parser, Subcommand};

/// Keeps freed memory in the process for reuse. A training step allocates and frees
/// vocabulary-sized buffers (hundreds of MB) per micro-batch; glibc serves those with fresh
/// `mmap`s and unmaps them on free, so every one is page-faulted back in (a fifth of a W1 GRPO
/// step). From the heap, with trimming off, they are reused in place.
// `mallopt` is a C call (no safe wrapper exists); the block below says why it is sound.
#[allow(unsafe_code)]
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}
use oxrl_train::Interrupt;
use std::io::Write;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "oxrl",
    version,
    about = "Reinforcement-learning post-training for language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Per-token log-probabilities of given responses (one JSON line per input line).
    Score(score::ScoreArgs),
    /// Sample continuations of prompts with the batched KV-cache engine.
    Generate(generate::GenerateArgs),
    /// GRPO training: sample, score, update (or replay recorded trajectories with --rollouts).
    Train(train::TrainArgs),
    /// Supervised fine-tuning on chat data (loss on assistant tokens only).
    Sft(train::SftArgs),
    /// Serve the model over HTTP: OpenAI's completion and chat routes, vLLM's token route.
    Serve(serve::ServeArgs),
    /// Explain or check run configurations.
    Config(train::ConfigArgs),
    /// Before launch: a run's memory per GPU by category, whether it fits, the largest
    /// micro-batch that does, and an estimated step time and cost.
    Plan(plan::PlanArgs),
    /// A model for deployment: a Hugging Face checkpoint (a LoRA adapter merged in), one GGUF
    /// file for llama.cpp, or an ONNX model with a KV cache for onnxruntime.
    Export(export::ExportArgs),
    /// Checkpoints on a dataset, scored as a run configuration scores training: mean reward,
    /// pass@k, every response.
    Eval(eval::EvalArgs),
    /// A leaderboard of training runs (reward, validation, throughput, wall time, config
    /// differences) and a chart overlaying their reward curves.
    Compare(compare::CompareArgs),
    /// A grid of runs over one configuration (every combination of the --grid values), run one
    /// after another or printed as launch commands, ending with their leaderboard.
    Sweep(sweep::SweepArgs),
    /// Speed benchmarks on random-weight models.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// What each rank of a multi-process launch sees: rank, node, device, rendezvous, and a
    /// checked all-reduce with its bandwidth (run it under torchrun, srun, mpirun or Ray).
    DistCheck(dist_check::DistCheckArgs),
}

/// Turns SIGINT and SIGTERM into a stop request for a training run: the first one is noted
/// and the run stops after the step it is in, with a checkpoint; a second one stops the
/// process at once, as the signal would have (checkpoints are written atomically, so even
/// then the last complete one stays valid).
fn stop_on_signals() -> anyhow::Result<Interrupt> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let interrupt = Interrupt::default();
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    let seen = interrupt.clone();
    std::thread::spawn(move || {
        for signal in signals.forever() {
            if seen.signal().is_some() {
                let _ = signal_hook::low_level::emulate_default_handler(signal);
                std::process::exit(128 + signal);
            }
            seen.request(signal);
            oxrl_train::note!(
                "\nstopping after the current step and writing a checkpoint (signal {signal}; \
                 send it again to stop at once)"
            );
        }
    });
    Ok(interrupt)
}

/// An error and its causes on one line, each cause once: an error whose message already ends
/// with its source's (`path: No such file or directory`) does not repeat it.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain().map(|c| c.to_string()) {
        if line.ends_with(&cause) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&cause);
    }
    line
}

/// The exit status a closed stdout gets, as if `SIGPIPE` had ended the process.
const BROKEN_PIPE_STATUS: u8 = 128 + 13;

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    let done = |r: anyhow::Result<()>| r.map(|()| ExitCode::SUCCESS);
    let result = match cli.command {
        Command::Score(args) => done(score::run(args)),
        Command::Generate(args) => done(generate::run(args)),
        Command::Train(args) => stop_on_signals().and_then(|i| train::train(args, &i)),
        Command::Sft(args) => stop_on_signals().and_then(|i| train::sft(args, &i)),
        Command::Serve(args) => done(serve::run(args)),
        Command::Config(args) => done(train::config(args)),
        Command::Plan(args) => done(plan::run(args)),
        Command::Export(args) => done(export::run(args)),
        Command::Compare(args) => done(compare::run(args)),
        Command::Sweep(args) => done(sweep::run(args)),
        Command::Eval(args) => done(eval::run(args)),
        Command::Bench(cmd) => done(bench::run(cmd)),
        Command::DistCheck(args) => done(dist_check::run(args)),
    };
    match result {
        Ok(code) => code,
        Err(e) if output::is_broken_pipe(&e) => ExitCode::from(BROKEN_PIPE_STATUS),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}
