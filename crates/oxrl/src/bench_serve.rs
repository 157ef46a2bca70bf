//! `oxrl bench serve`: a load test of `oxrl serve` from a second process. Many clients send
//! token-route requests (W1's prompts, `new_tokens` each) for a fixed time; the figure is the
//! served tokens per second next to the offline engine's on the same model and the same number
//! of sequences, with the errors seen and the server's resident memory early and late (a leak
//! shows as growth).

use crate::bench::{w1_model, w1_prompts};
use crate::output::say;
use anyhow::{bail, Context, Result};
use oxrl_models::{load_policy, HOST};
use oxrl_rollout::{Engine, LocalEngine, SamplerConfig, SamplingParams};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct ServeBench {
    /// The model to serve; W1 with random weights when absent.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Concurrent clients, each with one request in flight at a time.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// How long the clients keep sending.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// New tokens per request (eos ignored).
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The server process, killed when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Resident memory of process `pid` in MiB (Linux), 0 where it cannot be read.
fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Offline tokens per second of the engine on `clients` sequences of `new_tokens`.
fn offline_tokens_per_s(dir: &Path, prompts: &[Vec<u32>], new_tokens: usize) -> Result<f64> {
    let model = load_policy(dir, candle_core::DType::F32, &HOST)?;
    let mut engine = LocalEngine::new(Arc::from(model), None, Vec::new());
    let params = SamplingParams {
        n: 1,
        max_new_tokens: new_tokens,
        sampler: SamplerConfig::default(),
        ignore_eos: true,
        ..Default::default()
    };
    engine.generate(&prompts[..1], &params)?;
    let start = Instant::now();
    let out = engine.generate(prompts, &params)?;
    let tokens: usize = out.iter().flatten().map(|c| c.response_ids.len()).sum();
    Ok(tokens as f64 / start.elapsed().as_secs_f64())
}

fn start_server(dir: &Path, clients: usize) -> Result<(Child, String)> {
    let exe = std::env::current_exe().context("finding the oxrl binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["serve", "--port", "0", "--model"])
        .arg(dir)
        .args(["--max-num-seqs", &clients.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting oxrl serve")?;
    let stdout = child.stdout.take().context("the server's stdout")?;
    let child = Child(child);
    let mut first = String::new();
    std::io::BufReader::new(stdout).read_line(&mut first)?;
    let Some(url) = first.split_whitespace().find(|w| w.starts_with("http://")) else {
        bail!("oxrl serve did not start: {first:?}");
    };
    Ok((child, url.to_string()))
}

pub fn run(b: ServeBench) -> Result<()> {
    let scratch = std::env::temp_dir().join(format!("oxrl-bench-serve-{}", std::process::id()));
    let dir = match &b.model {
        Some(d) => d.clone(),
        None => {
            oxrl_train::note!(
                "saving the W1 model (random weights) to {}",
                scratch.display()
            );
            w1_model(0)?.save(&scratch, None)?;
            scratch.clone()
        }
    };
    let outcome = measure(&b, &dir);
    let _ = std::fs::remove_dir_all(&scratch);
    outcome
}

fn measure(b: &ServeBench, dir: &Path) -> Result<()> {
    let vocab = load_policy(dir, candle_core::DType::F32, &HOST)?.vocab_size();
    // Prompts of the W1 shape, from the model's own vocabulary (above the few special ids).
    let prompts = w1_prompts(
        b.clients,
        vocab.min(151_000),
        &mut ChaCha8Rng::seed_from_u64(1),
    );
    oxrl_train::note!(
        "offline engine: {} sequences × {} tokens",
        b.clients,
        b.new_tokens
    );
    let offline = offline_tokens_per_s(dir, &prompts, b.new_tokens)?;
    let (server, url) = start_server(dir, b.clients)?;
    let pid = server.0.id();
    let generate = format!("{url}/inference/v1/generate");
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(300))
        .build();
    let (tokens, requests, errors) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(b.seconds);
    let mut early_rss = 0.0;
    oxrl_train::note!("{} clients for {} s against {url}", b.clients, b.seconds);
    std::thread::scope(|scope| {
        for (c, prompt) in prompts.iter().enumerate() {
            let (agent, generate) = (&agent, &generate);
            let (tokens, requests, errors) = (&tokens, &requests, &errors);
            scope.spawn(move || {
                let mut seed = c as u64;
                while Instant::now() < deadline {
                    let body = json!({"token_ids": prompt, "sampling_params": {
                        "n": 1, "max_tokens": b.new_tokens, "seed": seed, "ignore_eos": true}});
                    seed += b.clients as u64;
                    let answer = agent
                        .post(generate)
                        .send_json(body)
                        .map_err(|e| e.to_string())
                        .and_then(|r| {
                            r.into_json::<serde_json::Value>()
                                .map_err(|e| e.to_string())
                        });
                    match answer {
                        Ok(v) => {
                            let n = v["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
                            tokens.fetch_add(n as u64, Relaxed);
                            requests.fetch_add(1, Relaxed);
                        }
                        Err(e) => {
                            if errors.fetch_add(1, Relaxed) == 0 {
                                oxrl_train::note!("first error: {e}");
                            }
                        }
                    }
                }
            });
        }
        // Memory once the server has warmed up (a quarter in), and again at the end.
        std::thread::sleep(Duration::from_secs(b.seconds).div_f64(4.0));
        early_rss = rss_mib(pid);
    });
    let secs = start.elapsed().as_secs_f64();
    let late_rss = rss_mib(pid);
    let tokens = tokens.load(Relaxed);
    let served = tokens as f64 / secs;
    let ratio = served / offline;
    let (requests, errors) = (requests.load(Relaxed), errors.load(Relaxed));
    if b.json {
        say!(
            "{}",
            json!({"bench": "serve", "clients": b.clients, "seconds": secs, "requests": requests,
                "errors": errors, "tokens": tokens, "tokens_per_s": served,
                "offline_tokens_per_s": offline, "ratio_to_offline": ratio,
                "server_rss_mib_early": early_rss, "server_rss_mib_late": late_rss})
        )?;
    } else {
        say!(
            "serve: {} clients × {secs:.1} s: {requests} requests, {errors} errors, {tokens} tokens \
             → {served:.0} tokens/s ({:.0}% of the offline engine's {offline:.0} tokens/s on the \
             same {} sequences); server RSS {early_rss:.0} MiB early, {late_rss:.0} MiB late",
            b.clients,
            ratio * 100.0,
            b.clients
        )?;
    }
    Ok(())
}
