//! `oxrl dist-check`: the first thing to run on a new cluster. Every rank joins the group as
//! `oxrl train` would, and rank 0 prints what each one sees (rank, node, device, launcher),
//! where they met, a checked all-reduce and its bandwidth. `oxrl bench allreduce` sweeps the
//! bandwidth over message sizes.

use crate::output::say;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use oxrl_dist::{Collective, DistEnv, ProcessGroup};
use oxrl_models::DeviceSpec;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct DistCheckArgs {
    /// Size of the timed all-reduce, in MiB of f32.
    #[arg(long, default_value_t = 64.0)]
    megabytes: f64,
    /// Timed all-reduces (after one untimed warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Seconds a rank waits for the others (default: OXRL_DIST_TIMEOUT, else 1800).
    #[arg(long)]
    timeout: Option<f64>,
    /// One JSON object on stdout (rank 0) instead of the table.
    #[arg(long)]
    json: bool,
    /// cpu (the TCP ring), or cuda (NCCL between the ranks' GPUs: cuda:LOCAL_RANK).
    #[arg(long, default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
}

#[derive(clap::Args)]
pub struct AllReduceBench {
    /// Message sizes in MiB of f32, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1.0, 16.0, 64.0, 256.0])]
    sizes: Vec<f64>,
    /// Timed all-reduces per size (after one untimed warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[arg(long)]
    json: bool,
    /// cpu (the TCP ring), or cuda (NCCL between the ranks' GPUs: cuda:LOCAL_RANK).
    #[arg(long, default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
}

/// A GPU rank trains on its own GPU: `cuda:LOCAL_RANK`, or `cuda:0` when the launcher shows
/// each process one GPU (`CUDA_VISIBLE_DEVICES` with one entry, as Ray and Slurm's
/// `--gpus-per-task=1` do).
pub(crate) fn rank_device(device: DeviceSpec, env: &DistEnv) -> DeviceSpec {
    match device {
        DeviceSpec::Cuda(_) if env.world_size > 1 => {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
            let one_visible = !visible.is_empty() && !visible.contains(',');
            DeviceSpec::Cuda(if one_visible { 0 } else { env.local_rank })
        }
        other => other,
    }
}

/// CPU ranks on one machine share its cores: unless `RAYON_NUM_THREADS` says otherwise, each
/// computes with cores / `LOCAL_WORLD_SIZE` threads (torchrun's `OMP_NUM_THREADS=1` is not a
/// variable candle reads). Called before the first tensor operation.
pub(crate) fn share_cores(env: &DistEnv, device: DeviceSpec) {
    if env.local_world_size <= 1
        || device != DeviceSpec::Cpu
        || std::env::var_os("RAYON_NUM_THREADS").is_some()
    {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / env.local_world_size).max(1);
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
}

/// Joins the group this process's launcher describes: NCCL on `device` when it is a GPU (the
/// CUDA build), the TCP ring otherwise.
pub(crate) fn join(
    timeout: Option<f64>,
    device: DeviceSpec,
) -> Result<(ProcessGroup, Device, DeviceSpec)> {
    let env = DistEnv::from_env()?;
    let spec = rank_device(device, &env);
    share_cores(&env, spec);
    let device = spec.open()?;
    let timeout = match timeout {
        Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s),
        Some(s) => bail!("--timeout {s}: expected a positive number of seconds"),
        None => oxrl_dist::timeout_from_env()?,
    };
    let (rank, world) = (env.rank, env.world_size);
    let joined = match &device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => ProcessGroup::join_gpu(env, &device, timeout),
        _ => ProcessGroup::join_cpu(env, timeout),
    };
    let group =
        joined.with_context(|| format!("rank {rank} of {world} joining the process group"))?;
    Ok((group, device, spec))
}

/// Seconds per all-reduce of `bytes` of f32 on `device`, the mean of `iters` after a warm-up.
fn time_all_reduce(
    group: &dyn Collective,
    bytes: usize,
    iters: usize,
    device: &Device,
) -> Result<f64> {
    let t = Tensor::ones(bytes / 4, DType::F32, device)?;
    group.all_reduce_sum(&t)?;
    group.barrier()?;
    let started = Instant::now();
    for _ in 0..iters.max(1) {
        group.all_reduce_sum(&t)?;
    }
    device.synchronize()?;
    Ok(started.elapsed().as_secs_f64() / iters.max(1) as f64)
}

/// nccl-tests' figures: algorithm bandwidth (bytes over time) and bus bandwidth (what each
/// link carries in a ring all-reduce: 2(W − 1)/W of it), in GB/s.
fn bandwidths(bytes: usize, seconds: f64, world: usize) -> (f64, f64) {
    let algbw = bytes as f64 / seconds / 1e9;
    (algbw, algbw * 2.0 * (world - 1) as f64 / world as f64)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".into())
}

pub fn run(args: DistCheckArgs) -> Result<()> {
    let (mut process_group, device, spec) = join(args.timeout, args.device)?;
    let env = process_group.env().clone();
    let store = process_group
        .rendezvous()
        .map(|r| format!("{} (served by {})", r.addr(), r.host()));
    let group = process_group.collective();
    let world = env.world_size;

    // Rank r contributes r + 1 everywhere: every element must come back as W(W + 1)/2.
    let probe = Tensor::full((env.rank + 1) as f32, 4096, &device)?;
    let summed = group.all_reduce_sum(&probe)?.to_vec1::<f32>()?;
    let expected = (world * (world + 1) / 2) as f32;
    let all_reduce_ok = summed.iter().all(|v| *v == expected);

    let bytes = (args.megabytes * (1 << 20) as f64) as usize / 4 * 4;
    let seconds = time_all_reduce(group.as_ref(), bytes, args.iters, &device)?;
    let (algbw, busbw) = bandwidths(bytes, seconds, world);

    let me = json!({
        "rank": env.rank,
        "local_rank": env.local_rank,
        "local_world_size": env.local_world_size,
        "host": host_name(),
        "pid": std::process::id(),
        "device": spec.to_string(),
        "all_reduce_ok": all_reduce_ok,
    });
    let ranks: Vec<Value> = group
        .all_gather_bytes(me.to_string().as_bytes())?
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<std::result::Result<_, _>>()
        .context("a rank's report")?;
    if !all_reduce_ok {
        bail!(
            "rank {}: the test all-reduce returned {:?}, expected {expected} everywhere",
            env.rank,
            &summed[..4]
        );
    }
    if !env.is_main() {
        return Ok(());
    }
    let report = json!({
        "world_size": world,
        "launcher": env.launcher.to_string(),
        "master": format!("{}:{}", env.master_addr, env.master_port),
        "store": store,
        "attempt": env.attempt,
        "transport": group.transport(),
        "ranks": ranks,
        "all_reduce": {
            "expected": expected,
            "ok": ranks.iter().all(|r| r["all_reduce_ok"] == true),
            "bytes": bytes,
            "seconds": seconds,
            "algbw_gb_s": algbw,
            "busbw_gb_s": busbw,
        },
    });
    if args.json {
        return say!("{report}");
    }
    say!(
        "oxrl dist-check: {world} rank(s), launched by {}, transport {}",
        env.launcher,
        group.transport()
    )?;
    match &report["store"] {
        Value::String(store) => say!("rendezvous store: {store}, attempt {}", env.attempt)?,
        _ => say!("rendezvous store: none (one process)")?,
    }
    say!(
        "{:>5} {:>6} {:<24} {:>8} {:<6}",
        "rank",
        "local",
        "host",
        "pid",
        "device"
    )?;
    for r in &ranks {
        say!(
            "{:>5} {:>6} {:<24} {:>8} {:<6}",
            r["rank"].to_string(),
            format!("{}/{}", r["local_rank"], r["local_world_size"]),
            r["host"].as_str().unwrap_or("?"),
            r["pid"].to_string(),
            r["device"].as_str().unwrap_or("?")
        )?;
    }
    say!(
        "all-reduce: every rank got {expected} (the sum of rank + 1 over {world} ranks); \
         {:.1} MiB in {:.2} ms: algbw {algbw:.2} GB/s, busbw {busbw:.2} GB/s",
        bytes as f64 / (1 << 20) as f64,
        seconds * 1e3
    )
}

pub fn bench(args: AllReduceBench) -> Result<()> {
    let (process_group, device, _) = join(None, args.device)?;
    let env = process_group.env().clone();
    if env.world_size == 1 {
        bail!(
            "bench allreduce measures a group of several ranks; run it under a launcher, e.g. \
             `torchrun --nproc_per_node 2 --no-python oxrl bench allreduce`"
        );
    }
    let group = process_group.collective();
    let mut rows = Vec::new();
    for &mb in &args.sizes {
        if !(mb.is_finite() && mb > 0.0) {
            bail!("--sizes {mb}: expected positive sizes in MiB");
        }
        let bytes = ((mb * (1 << 20) as f64) as usize / 4 * 4).max(4);
        let seconds = time_all_reduce(group.as_ref(), bytes, args.iters, &device)?;
        let (algbw, busbw) = bandwidths(bytes, seconds, env.world_size);
        rows.push(json!({
            "transport": group.transport(),
            "world_size": env.world_size,
            "bytes": bytes,
            "seconds": seconds,
            "algbw_gb_s": algbw,
            "busbw_gb_s": busbw,
        }));
    }
    if !env.is_main() {
        return Ok(());
    }
    if args.json {
        for row in &rows {
            say!("{row}")?;
        }
        return Ok(());
    }
    say!(
        "all-reduce of f32 over {} ranks ({}), mean of {} after a warm-up",
        env.world_size,
        group.transport(),
        args.iters.max(1)
    )?;
    say!(
        "{:>10} {:>10} {:>12} {:>12}",
        "MiB",
        "ms",
        "algbw GB/s",
        "busbw GB/s"
    )?;
    for row in &rows {
        say!(
            "{:>10.1} {:>10.2} {:>12.2} {:>12.2}",
            row["bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
            row["seconds"].as_f64().unwrap_or(0.0) * 1e3,
            row["algbw_gb_s"].as_f64().unwrap_or(0.0),
            row["busbw_gb_s"].as_f64().unwrap_or(0.0)
        )?;
    }
    Ok(())
}
