//! `oxrl`: the command line of the oxrl post-training framework.

mod bench;
mod generate;
mod input;
mod load;
mod output;
mod score;
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
    /// Explain or check run configurations.
    Config(train::ConfigArgs),
    /// Speed benchmarks on random-weight models.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Score(args) => score::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Train(args) => train::train(args),
        Command::Sft(args) => train::sft(args),
        Command::Config(args) => train::config(args),
        Command::Bench(cmd) => bench::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", chain.join(": "));
            ExitCode::FAILURE
        }
    }
}
