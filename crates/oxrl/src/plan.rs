//! `oxrl plan`: before launch, what a run's config needs per GPU and whether it fits.

use crate::output::say;
use anyhow::Result;
use oxrl_train::config::RunConfig;
use oxrl_train::plan::{
    accelerator, Workload, ASSUMED_MFU, INTERNODE_BUS_BYTES_PER_S, NVLINK_BUS_BYTES_PER_S,
    RESERVED_FRACTION,
};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PlanArgs {
    /// The run's TOML config.
    #[arg(long)]
    config: PathBuf,
    /// GPUs the run is spread over (data parallel with ZeRO-2 when more than one).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// The GPU model: h100, h200, a100-80, a100-40 or l40s.
    #[arg(long, default_value = "h100")]
    gpu: String,
    /// Price of one GPU-hour, for the cost per step.
    #[arg(long, default_value_t = 2.5)]
    usd_per_gpu_hour: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: PlanArgs) -> Result<()> {
    let cfg = RunConfig::from_file(&args.config)?;
    let gpu = accelerator(&args.gpu).map_err(anyhow::Error::msg)?;
    let (w, name) = Workload::from_run(&cfg, args.gpus)?;
    let budget = gpu.memory_bytes * (1.0 - RESERVED_FRACTION);
    let memory = w.memory(w.micro_batch);
    let fits = memory.training() <= budget;
    let sequences = w.prompts * w.samples / w.gpus;
    let at_once = memory.concurrent_sequences(budget).min(sequences);
    let largest = w.largest_micro_batch(budget);
    let time = w.step_seconds(&gpu);
    let cost = time.total() * w.gpus as f64 * args.usd_per_gpu_hour / 3600.0;
    if args.json {
        say!(
            "{}",
            json!({
                "model": name, "parameters": w.parameters, "trainable": w.trainable,
                "lora_rank": w.lora.map(|l| l.rank), "gpus": w.gpus, "gpu": gpu.name,
                "micro_batch": w.micro_batch, "gradient_checkpointing": w.gradient_checkpointing,
                "bytes_per_gpu": {
                    "weights": memory.weights, "gradients": memory.gradients,
                    "optimizer": memory.optimizer, "activations": memory.activations,
                    "activations_without_checkpointing": memory.activations_full,
                    "activations_with_checkpointing": memory.activations_checkpointed,
                    "logits": memory.logits, "kv_cache": memory.kv_cache,
                    "training_peak": memory.training(), "rollout_peak": memory.rollout(),
                    "available": budget,
                },
                "sequences_per_gpu": sequences, "sequences_decoded_at_once": at_once,
                "fits": fits, "largest_micro_batch": largest,
                "seconds_per_step": {"rollout": time.rollout, "training": time.training,
                                     "total": time.total()},
                "usd_per_step": cost, "usd_per_gpu_hour": args.usd_per_gpu_hour,
                "zero2_traffic": w.zero2_traffic().map(|t| json!({
                    "bytes_per_gpu_per_step": t.bytes(),
                    "reduce_scatter_bytes": t.reduce_scatter_bytes,
                    "all_gather_bytes": t.all_gather_bytes,
                    "micro_batches_per_gpu": t.micro_batches,
                    "seconds_within_one_nvlink_node": t.seconds(NVLINK_BUS_BYTES_PER_S),
                    "seconds_across_nodes": t.seconds(INTERNODE_BUS_BYTES_PER_S),
                })),
            })
        )?;
        return Ok(());
    }
    say!("{}", table(&w, &name, gpu.name, gpu.memory_bytes, budget))?;
    let verdict = match (fits, largest) {
        (true, Some(m)) => format!("fits; the largest micro-batch that fits is {m}"),
        (false, Some(m)) => format!(
            "does NOT fit at micro-batch {}; set [trainer] micro_batch_size ≤ {m}",
            w.micro_batch
        ),
        (false, None) if !w.gradient_checkpointing => {
            "does NOT fit even at micro-batch 1; set [trainer] gradient_checkpointing = true, \
             use more GPUs or shorter sequences"
                .to_string()
        }
        _ => "does NOT fit even at micro-batch 1; use more GPUs or shorter sequences".to_string(),
    };
    say!("training {verdict}")?;
    let rollout = match at_once >= sequences {
        true => format!("rollout: all {sequences} sequences of this GPU decode at once"),
        false => format!(
            "rollout: {at_once} of this GPU's {sequences} sequences fit the KV cache at once \
             (the engine's max_num_seqs; the rest wait for a slot)"
        ),
    };
    say!("{rollout}")?;
    say!(
        "step ≈ {:.0} s (rollout {:.0} s bound by reading the weights per decoded token, training \
         {:.0} s at {:.0}% of bf16 peak) → ${cost:.2} per step at ${:.2} per GPU-hour",
        time.total(),
        time.rollout,
        time.training,
        ASSUMED_MFU * 100.0,
        args.usd_per_gpu_hour
    )?;
    if let Some(t) = w.zero2_traffic() {
        say!(
            "ZeRO-2 traffic per GPU per step: {:.1} GB (f32 gradients reduce-scattered after each \
             of its {} micro-batch(es): {:.1} GB; weights all-gathered: {:.1} GB) ≈ {:.2} s within \
             one NVLink node (~{:.0} GB/s), ≈ {:.2} s across nodes (~{:.0} GB/s per GPU)",
            t.bytes() / 1e9,
            t.micro_batches,
            t.reduce_scatter_bytes / 1e9,
            t.all_gather_bytes / 1e9,
            t.seconds(NVLINK_BUS_BYTES_PER_S),
            NVLINK_BUS_BYTES_PER_S / 1e9,
            t.seconds(INTERNODE_BUS_BYTES_PER_S),
            INTERNODE_BUS_BYTES_PER_S / 1e9
        )?;
    }
    Ok(())
}

/// The per-GPU memory table.
pub fn table(w: &Workload, name: &str, device: &str, memory: f64, budget: f64) -> String {
    let m = w.memory(w.micro_batch);
    let gb = |b: f64| format!("{:>8.1}", b / 1e9);
    let layout = if w.gpus > 1 { ", ZeRO-2" } else { "" };
    let mut out = format!(
        "{name}: {:.2} B parameters, {} · {} × {}{layout} · {} prompts × {} samples, {} + {} tokens, \
         micro-batch {}, checkpointing {}",
        w.parameters as f64 / 1e9,
        if w.dtype_bytes == 4.0 { "f32" } else { "bf16" },
        w.gpus,
        device,
        w.prompts,
        w.samples,
        w.prompt_tokens,
        w.response_tokens,
        w.micro_batch,
        if w.gradient_checkpointing { "on" } else { "off" },
    );
    if let Some(lora) = &w.lora {
        out.push_str(&format!(
            "\nLoRA rank {} on {} projections per layer: {:.1} M trainable parameters (gradients \
             and optimizer state for these only; the KL reference is the base with the adapters \
             off, no second copy)",
            lora.rank,
            lora.projections,
            w.trainable as f64 / 1e6
        ));
    }
    let copies = match (w.reference, w.lora.is_some()) {
        (true, false) => "policy + reference",
        (_, true) => "base + adapters",
        (false, false) => "policy",
    };
    let rows = [
        (
            format!(
                "weights ({copies}, {})",
                if w.dtype_bytes == 4.0 { "f32" } else { "bf16" }
            ),
            m.weights,
        ),
        (
            format!(
                "gradients (f32{})",
                if w.gpus > 1 {
                    ", a shard + one layer's bucket"
                } else {
                    ""
                }
            ),
            m.gradients,
        ),
        (
            format!(
                "optimizer (f32 master, m, v{})",
                if w.gpus > 1 { ", a shard" } else { "" }
            ),
            m.optimizer,
        ),
        (
            format!("activations, micro-batch {}", w.micro_batch),
            m.activations,
        ),
        ("  without checkpointing".to_string(), m.activations_full),
        (
            "  with checkpointing".to_string(),
            m.activations_checkpointed,
        ),
        (
            "logits (f32, one chunk, with gradient)".to_string(),
            m.logits,
        ),
        (
            "gradients one backward hands back".to_string(),
            m.backward_gradients,
        ),
        ("training peak".to_string(), m.training()),
        (
            "KV cache (rollout, this GPU's sequences)".to_string(),
            m.kv_cache,
        ),
        ("rollout peak".to_string(), m.rollout()),
        (
            format!(
                "available ({:.0} GB less {:.0}%)",
                memory / 1e9,
                RESERVED_FRACTION * 100.0
            ),
            budget,
        ),
    ];
    out.push_str(&format!("\n{:<52}{:>8}", "per device", "GB"));
    for (label, bytes) in rows {
        out.push_str(&format!("\n  {label:<50}{}", gb(bytes)));
    }
    out
}

/// The planner's check before `oxrl train` starts: an error holding the table when the
/// update's peak does not fit `memory` bytes (the GPU's, or the host's available memory on a
/// CPU), less the reserve.
pub fn check_fits(cfg: &RunConfig, device: &str, memory: f64) -> Result<()> {
    let (w, name) = Workload::from_run(cfg, 1)?;
    let budget = memory * (1.0 - RESERVED_FRACTION);
    let peak = w.memory(w.micro_batch).training();
    if peak <= budget {
        return Ok(());
    }
    let advice = match w.largest_micro_batch(budget) {
        Some(m) => format!("set [trainer] micro_batch_size ≤ {m}"),
        None if !w.gradient_checkpointing => {
            "set [trainer] gradient_checkpointing = true, or use shorter sequences".to_string()
        }
        None => "use shorter sequences or a larger device".to_string(),
    };
    anyhow::bail!(
        "this run needs about {:.1} GB at its peak and {device} has {:.1} GB to give it: {advice} \
         (pass --skip-memory-check to start anyway)\n{}",
        peak / 1e9,
        budget / 1e9,
        table(&w, &name, device, memory, budget)
    )
}
