//! `oxrl bench`: the W1 workload of `shared/bench` on a random-weight Qwen3 (hidden 256,
//! intermediate 768, 4 layers, 4 heads / 2 kv heads, head_dim 64, vocab 151,936, tied, f32), so
//! figures compare side by side with transformers on the same machine.

use anyhow::Result;
use candle_core::{DType, Device};
use oxrl_models::Qwen3;
use oxrl_rollout::{Engine, LocalEngine, SamplerConfig, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

/// transformers 5.23 `generate` on W1 on these machines (shared/bench/README.md).
const TRANSFORMERS_TOKENS_PER_S: f64 = 85.0;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Tokens per second of the generation engine: prompts × samples × exactly `new_tokens`.
    Generate(GenerateBench),
}

#[derive(clap::Args)]
pub struct GenerateBench {
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// Samples per prompt.
    #[arg(long, default_value_t = 8)]
    n: usize,
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The W1 model with freshly initialised weights (N(0, 0.02²), unit norms).
pub fn w1_model(seed: u64) -> Result<Qwen3> {
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": true, "torch_dtype": "float32",
    });
    Ok(Qwen3::random(config, seed, DType::F32, &Device::Cpu)?)
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Generate(b) => generate(b),
    }
}

fn generate(b: GenerateBench) -> Result<()> {
    let model = Arc::new(w1_model(0)?);
    let vocab = model.config.vocab_size as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // ~20-token prompts of slightly different lengths, as in hf_generate_w1.py's batch.
    let prompts: Vec<Vec<u32>> = (0..b.prompts)
        .map(|p| {
            (0..18 + p % 5)
                .map(|_| rng.random_range(0..vocab))
                .collect()
        })
        .collect();
    let params = SamplingParams {
        n: b.n,
        max_new_tokens: b.new_tokens,
        sampler: SamplerConfig::default(),
        seed: 0,
        ignore_eos: true,
        ..Default::default()
    };
    let mut engine = LocalEngine::new(model, None, Vec::new());
    // One small warm-up so thread pools and allocations are in place.
    engine.generate(
        &prompts[..1],
        &SamplingParams {
            n: 1,
            max_new_tokens: 2,
            ..params.clone()
        },
    )?;
    let start = Instant::now();
    let out = engine.generate(&prompts, &params)?;
    let secs = start.elapsed().as_secs_f64();
    let tokens: usize = out.iter().flatten().map(|c| c.response_ids.len()).sum();
    let tps = tokens as f64 / secs;
    let ratio = tps / TRANSFORMERS_TOKENS_PER_S;
    if b.json {
        println!(
            "{}",
            json!({"bench": "generate", "sequences": b.prompts * b.n, "new_tokens": b.new_tokens,
                   "tokens": tokens, "seconds": secs, "tokens_per_s": tps,
                   "transformers_tokens_per_s": TRANSFORMERS_TOKENS_PER_S, "ratio_to_transformers": ratio})
        );
    } else {
        println!(
            "generate W1: {} sequences × {} new tokens = {tokens} tokens in {secs:.2} s → {tps:.0} tokens/s \
             ({ratio:.1}× transformers' {TRANSFORMERS_TOKENS_PER_S} tokens/s)",
            b.prompts * b.n,
            b.new_tokens
        );
    }
    Ok(())
}
