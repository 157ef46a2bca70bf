//! `oxrl bench`: the W1 workload of `shared/bench` on a random-weight Qwen3 (hidden 256,
//! intermediate 768, 4 layers, 4 heads / 2 kv heads, head_dim 64, vocab 151,936, tied, f32), so
//! figures compare side by side with transformers on the same machine.

use crate::output::say;
use anyhow::Result;
use candle_core::DType;
use candle_core::Device;
use oxrl_models::{CacheKind, DeviceSpec, PolicyModel, Qwen3, HOST};
use oxrl_rollout::{Engine, LocalEngine, PromptImage, SamplerConfig, SamplingParams};
use oxrl_train::{learn, DataParallel, PhaseTimes};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

/// TRL 1.16's GRPO step on W1 on these machines: 61–72 s (shared/bench/README.md); the midpoint.
const TRL_SECONDS_PER_STEP: f64 = 66.5;

/// transformers 5.23 `generate` on W1 on these machines (shared/bench/README.md).
const TRANSFORMERS_TOKENS_PER_S: f64 = 85.0;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Tokens per second of the generation engine: prompts × samples × exactly `new_tokens`.
    Generate(GenerateBench),
    /// Seconds per GRPO step (rollout, old and reference log-probs, update) on W1.
    GrpoStep(GrpoStepBench),
    /// Qwen3-VL: images per second through the vision tower, and a GRPO step on image prompts.
    Vision(VisionBench),
    /// A load test of `oxrl serve` from many concurrent clients, next to the offline engine.
    Serve(crate::bench_serve::ServeBench),
    /// All-reduce bandwidth of the process group's transport over message sizes (run it
    /// under a launcher: `torchrun --nproc_per_node 2 --no-python oxrl bench allreduce`).
    Allreduce(crate::dist_check::AllReduceBench),
}

#[derive(clap::Args)]
pub struct VisionBench {
    /// Images in the tower's batch, and image prompts in the GRPO step (one image each).
    #[arg(long, default_value_t = 8)]
    images: usize,
    /// Side of the square images in pixels (a multiple of 32).
    #[arg(long, default_value_t = 256)]
    size: usize,
    #[arg(long, default_value_t = 8)]
    n: usize,
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    #[arg(long)]
    json: bool,
}

/// The model a GRPO-step benchmark trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchShape {
    /// W1 (shared/bench): hidden 256, 4 layers, vocab 151,936, tied.
    W1,
    /// Qwen3-0.6B's shape: hidden 1024, 28 layers, 16 heads / 8 kv heads, vocab 151,936, tied.
    #[value(name = "qwen3-0.6b")]
    Qwen3_0_6b,
}

#[derive(clap::Args)]
pub struct GrpoStepBench {
    /// The model's shape (random weights).
    #[arg(long, value_enum, default_value_t = BenchShape::W1)]
    shape: BenchShape,
    /// Where the step runs: cpu, cuda or cuda:N.
    #[arg(long, default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
    /// The policy's compute dtype (bf16: mixed precision, f32 master weights).
    #[arg(long, value_enum, default_value_t = BenchDtype::F32)]
    dtype: BenchDtype,
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    #[arg(long, default_value_t = 8)]
    n: usize,
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Trajectories per forward/backward in the update.
    #[arg(long, default_value_t = 8)]
    micro_batch_size: usize,
    /// Recompute each decoder layer in the update's backward instead of keeping its activations.
    #[arg(long)]
    gradient_checkpointing: bool,
    /// Train LoRA adapters of this rank on every projection (alpha = 2 × rank) instead of every
    /// weight; the reference is then the base with the adapters off.
    #[arg(long)]
    lora_rank: Option<usize>,
    /// Steps to time (the first is a warm-up and not counted when there are more).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct GenerateBench {
    /// The model's shape (random weights).
    #[arg(long, value_enum, default_value_t = BenchShape::W1)]
    shape: BenchShape,
    /// Where the engine runs: cpu, cuda or cuda:N.
    #[arg(long, default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
    #[arg(long, value_enum, default_value_t = BenchDtype::F32)]
    dtype: BenchDtype,
    /// Where the KV caches live (default: host on a CPU, pooled on a GPU).
    #[arg(long, value_enum)]
    kv_cache: Option<BenchCache>,
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

/// [`CacheKind`] on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchCache {
    Host,
    Pooled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDtype {
    F32,
    Bf16,
}

impl BenchDtype {
    fn dtype(self) -> DType {
        match self {
            BenchDtype::F32 => DType::F32,
            BenchDtype::Bf16 => DType::BF16,
        }
    }
}

/// The W1 model with freshly initialised weights (N(0, 0.02²), unit norms).
pub fn w1_model(seed: u64) -> Result<Qwen3> {
    shaped_model(BenchShape::W1, seed, DType::F32, &HOST)
}

/// A Qwen3 of `shape` with freshly initialised weights, in `dtype` on `device`.
fn shaped_model(shape: BenchShape, seed: u64, dtype: DType, device: &Device) -> Result<Qwen3> {
    let (hidden, intermediate, layers, heads, kv_heads, head_dim) = match shape {
        BenchShape::W1 => (256, 768, 4, 4, 2, 64),
        BenchShape::Qwen3_0_6b => (1024, 3072, 28, 16, 8, 128),
    };
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": true,
        "torch_dtype": "float32",
    });
    Ok(Qwen3::random(config, seed, dtype, device)?)
}

/// W1's text model under a Qwen3-VL vision tower (depth 4, hidden 256, 4 heads, MLP 1024, a
/// 48×48 position table, DeepStack after blocks 1 and 3), all freshly initialised.
pub fn vl_w1_model(seed: u64) -> Result<Qwen3> {
    let config = json!({
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "tie_word_embeddings": true, "dtype": "float32",
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 256,
            "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": [12, 10, 10]},
        },
        "vision_config": {
            "depth": 4, "hidden_size": 256, "intermediate_size": 1024, "num_heads": 4,
            "out_hidden_size": 256, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [1, 3],
        },
    });
    Ok(Qwen3::random(config, seed, DType::F32, &HOST)?)
}

/// A random RGB picture of `side × side`, processed for `model`.
fn random_image(
    model: &Qwen3,
    side: usize,
    rng: &mut ChaCha8Rng,
) -> Result<Arc<oxrl_models::ProcessedImage>> {
    let img = oxrl_models::image::Image8 {
        width: side,
        height: side,
        channels: 3,
        data: (0..side * side * 3).map(|_| rng.random::<u8>()).collect(),
    };
    let cfg = oxrl_models::ImageProcessorConfig {
        min_pixels: side * side,
        max_pixels: side * side,
        ..model
            .vision
            .as_ref()
            .map(|v| v.processor.clone())
            .unwrap_or_default()
    };
    Ok(Arc::new(oxrl_models::image::process(&img, &cfg)?))
}

fn vision(b: VisionBench) -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let model = vl_w1_model(0)?;
    let vision = model
        .vision
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("the VL benchmark model has no vision tower"))?;
    let images: Vec<_> = (0..b.images)
        .map(|_| random_image(&model, b.size, &mut rng))
        .collect::<Result<_>>()?;
    let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
    let pixels: Vec<f32> = images.iter().flat_map(|i| i.pixel_values.clone()).collect();
    let rows = pixels.len() / vision.tower.config.patch_dim();
    let pixels =
        candle_core::Tensor::from_vec(pixels, (rows, vision.tower.config.patch_dim()), &HOST)?;
    vision.tower.forward(&pixels, &grids)?; // warm-up
    let reps = 3;
    let start = Instant::now();
    for _ in 0..reps {
        vision.tower.forward(&pixels, &grids)?;
    }
    let tower_s = start.elapsed().as_secs_f64() / reps as f64;
    let images_per_s = b.images as f64 / tower_s;

    // One GRPO step on image prompts: ~20 text tokens around each picture's tokens.
    let tokens = vision.tokens;
    let prompts: Vec<Vec<u32>> = images
        .iter()
        .map(|img| {
            let mut p: Vec<u32> = (0..10).map(|_| rng.random_range(0..151_000)).collect();
            p.push(tokens.vision_start_token_id);
            p.extend(std::iter::repeat_n(
                tokens.image_token_id,
                img.num_tokens(tokens.merge_size),
            ));
            p.push(tokens.vision_end_token_id);
            p.extend((0..10).map(|_| rng.random_range(0..151_000u32)));
            p
        })
        .collect();
    let prompt_images: Vec<Vec<_>> = images
        .iter()
        .map(|i| {
            vec![PromptImage {
                pixels: i.clone(),
                source: None,
            }]
        })
        .collect();
    let (secs, m) = vl_grpo_step(
        Box::new(model),
        Box::new(vl_w1_model(1)?),
        &prompts,
        &prompt_images,
        &b,
        &mut rng,
    )?;
    let phases = [
        "time/rollout",
        "time/old_logprobs",
        "time/ref",
        "time/update",
    ];
    if b.json {
        let mut obj = serde_json::Map::new();
        obj.insert("bench".into(), "vision".into());
        obj.insert("images".into(), b.images.into());
        obj.insert("image_size".into(), b.size.into());
        obj.insert("vision_tower_seconds".into(), tower_s.into());
        obj.insert("images_per_s".into(), images_per_s.into());
        obj.insert("seconds_per_step".into(), secs.into());
        for p in phases {
            obj.insert(p.into(), m.get(p).copied().unwrap_or(0.0).into());
        }
        say!("{}", serde_json::Value::Object(obj))?;
    } else {
        say!(
            "vision: {} images of {}×{} through the tower in {tower_s:.3} s = {images_per_s:.1} images/s; \
             VL GRPO step ({} prompts × {} samples × {} tokens): {secs:.2} s \
             (rollout {:.2}, old logprobs {:.2}, ref {:.2}, update {:.2})",
            b.images, b.size, b.size, b.images, b.n, b.new_tokens,
            m.get("time/rollout").copied().unwrap_or(0.0),
            m.get("time/old_logprobs").copied().unwrap_or(0.0),
            m.get("time/ref").copied().unwrap_or(0.0),
            m.get("time/update").copied().unwrap_or(0.0),
        )?;
    }
    Ok(())
}

/// One GRPO step (rollout, recomputed old log-probs, reference with β = 0.04, update) on image
/// prompts; its seconds and phase metrics.
fn vl_grpo_step(
    policy: Box<dyn PolicyModel>,
    reference: Box<dyn PolicyModel>,
    prompts: &[Vec<u32>],
    images: &[Vec<PromptImage>],
    b: &VisionBench,
    rng: &mut ChaCha8Rng,
) -> Result<(f64, std::collections::BTreeMap<String, f64>)> {
    let mut trainer = bench_trainer(policy, reference, b.new_tokens, 8, 1)?;
    let mut engine = LocalEngine::new(Arc::from(trainer.policy.detached()), None, Vec::new());
    let params = SamplingParams {
        n: b.n,
        max_new_tokens: b.new_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let start = Instant::now();
    let out = engine.generate_with_images(prompts, images, &params)?;
    let rollout = start.elapsed().as_secs_f64();
    let trajs = random_reward_trajectories(prompts, images, &out, rng);
    let mut time = PhaseTimes::default();
    let mut m = learn(&mut trainer, &trajs, &mut time)?.report.metrics;
    m.extend(time.into_metrics());
    m.insert("time/rollout".into(), rollout);
    let secs = start.elapsed().as_secs_f64();
    Ok((secs, m))
}

/// The benchmark's trainer: GRPO advantages, PPO-clip, a reference with β = 0.04 (k3),
/// token-mean aggregation scaled by the response length, recomputed old log-probs, AdamW.
fn bench_trainer(
    policy: Box<dyn PolicyModel>,
    reference: Box<dyn PolicyModel>,
    new_tokens: usize,
    micro_batch_size: usize,
    total_steps: u64,
) -> Result<oxrl_train::PolicyTrainer> {
    use oxrl_algo::{AdvantageConfig, KlEstimator, LossAgg, PolicyLossConfig};
    use oxrl_train::{AdamWConfig, AlgorithmConfig, LrSchedule, OldLogprobs, UpdateConfig};
    let algorithm = AlgorithmConfig {
        advantage: AdvantageConfig::default(),
        policy_loss: PolicyLossConfig::default(),
        kl_coef: 0.04,
        kl_estimator: KlEstimator::K3,
        loss_agg: LossAgg::TokenMean,
        kl_loss_agg: LossAgg::TokenMean,
        loss_scale_factor: new_tokens as f64,
        old_logprobs: OldLogprobs::Recompute,
        entropy_coef: 0.0,
        overlong_filter: false,
        rollout_correction: None,
        kl_in_reward: None,
    };
    let update = UpdateConfig {
        temperature: 1.0,
        mini_batch_size: None,
        micro_batch_size,
        ppo_epochs: 1,
        max_grad_norm: 1.0,
        optimizer: AdamWConfig {
            lr: 1e-6,
            ..Default::default()
        },
        lr_schedule: LrSchedule::Constant,
        warmup_steps: 0,
        total_steps,
    };
    Ok(oxrl_train::PolicyTrainer::new(
        policy,
        Some(reference),
        algorithm,
        update,
    )?)
}

/// The benchmark's trajectories: every completion of prompt `p` (with `images[p]`, when
/// given) in group `p`, with a random 0/1 reward.
fn random_reward_trajectories(
    prompts: &[Vec<u32>],
    images: &[Vec<PromptImage>],
    completions: &[Vec<oxrl_rollout::Completion>],
    rng: &mut ChaCha8Rng,
) -> Vec<oxrl_train::Trajectory> {
    let mut trajs = Vec::new();
    for (p, (prompt, samples)) in prompts.iter().zip(completions).enumerate() {
        for c in samples {
            trajs.push(oxrl_train::Trajectory {
                uid: p.to_string(),
                prompt_ids: prompt.clone(),
                response_ids: c.response_ids.clone(),
                reward: rng.random_range(0..2) as f64,
                rollout_logprobs: c.logprobs.clone(),
                finish_reason: None,
                weight_version: Some(c.weight_version),
                images: Vec::new(),
                pixels: images
                    .get(p)
                    .map(|im| im.iter().map(|i| i.pixels.clone()).collect())
                    .unwrap_or_default(),
                loss_mask: Vec::new(),
            });
        }
    }
    trajs
}

/// W1's prompts: ~20 random tokens each, of slightly different lengths (as the peer scripts').
pub fn w1_prompts(count: usize, vocab: usize, rng: &mut ChaCha8Rng) -> Vec<Vec<u32>> {
    (0..count)
        .map(|p| {
            (0..18 + p % 5)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect()
        })
        .collect()
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Generate(b) => generate(b),
        BenchCommand::GrpoStep(b) => grpo_step(b),
        BenchCommand::Vision(b) => vision(b),
        BenchCommand::Serve(b) => crate::bench_serve::run(b),
        BenchCommand::Allreduce(b) => crate::dist_check::bench(b),
    }
}

fn generate(b: GenerateBench) -> Result<()> {
    let device = b.device.open()?;
    let mut model = shaped_model(b.shape, 0, b.dtype.dtype(), &device)?;
    if let Some(kind) = b.kv_cache {
        model.kv_cache = match kind {
            BenchCache::Host => CacheKind::Host,
            BenchCache::Pooled => CacheKind::Pooled,
        };
    }
    let kv_cache = model.kv_cache;
    let model = Arc::new(model);
    let prompts = w1_prompts(
        b.prompts,
        model.config.vocab_size,
        &mut ChaCha8Rng::seed_from_u64(1),
    );
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
    let memory = crate::device_memory::PeakWatch::start(&device)?;
    let start = Instant::now();
    let out = engine.generate(&prompts, &params)?;
    let secs = start.elapsed().as_secs_f64();
    let peak_memory_gib = memory.map(|m| m.stop() as f64 / (1u64 << 30) as f64);
    let tokens: usize = out.iter().flatten().map(|c| c.response_ids.len()).sum();
    let tps = tokens as f64 / secs;
    // transformers' figure is W1 on these CPUs; another shape or device has no reference.
    let reference =
        (b.shape == BenchShape::W1 && device.is_cpu()).then_some(TRANSFORMERS_TOKENS_PER_S);
    let shape = format!("{:?}", b.shape).to_lowercase();
    if b.json {
        say!(
            "{}",
            json!({"bench": "generate", "shape": shape, "device": b.device.to_string(),
                   "dtype": format!("{:?}", b.dtype).to_lowercase(),
                   "kv_cache": format!("{kv_cache:?}").to_lowercase(),
                   "sequences": b.prompts * b.n, "new_tokens": b.new_tokens,
                   "tokens": tokens, "seconds": secs, "tokens_per_s": tps,
                   "peak_device_memory_gib": peak_memory_gib,
                   "transformers_tokens_per_s": reference,
                   "ratio_to_transformers": reference.map(|r| tps / r)})
        )?;
    } else {
        let versus = reference.map_or(String::new(), |r| {
            format!(" ({:.1}× transformers' {r} tokens/s)", tps / r)
        });
        let memory = peak_memory_gib.map_or(String::new(), |g| {
            format!("; peak device memory {g:.2} GiB")
        });
        say!(
            "generate {shape} on {} ({kv_cache:?} KV cache): {} sequences × {} new tokens = {tokens} \
             tokens in {secs:.2} s → {tps:.0} tokens/s{versus}{memory}",
            b.device,
            b.prompts * b.n,
            b.new_tokens
        )?;
    }
    Ok(())
}

/// Achieved f32 GFLOP/s of one large square matmul, the peak the step is compared with.
/// GFLOP/s of a large square matmul in `dtype` on `device` (1024² f32 on a CPU; 8192² on a GPU,
/// its dtype's practical peak), waiting for the device before the clock stops.
fn matmul_peak_gflops(device: &Device, dtype: DType) -> Result<f64> {
    let n = if device.is_cpu() { 1024 } else { 8192 };
    let a = candle_core::Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let _ = a.matmul(&a)?;
    device.synchronize()?;
    let start = Instant::now();
    let reps = 8;
    for _ in 0..reps {
        let _ = a.matmul(&a)?;
    }
    device.synchronize()?;
    Ok(2.0 * (n as f64).powi(3) * reps as f64 / start.elapsed().as_secs_f64() / 1e9)
}

fn grpo_step(b: GrpoStepBench) -> Result<()> {
    // Under a launcher the step is data-parallel: each rank (on its own GPU, `cuda:LOCAL_RANK`)
    // samples its share of the prompts and computes its share of the update.
    let (group, device, _) = crate::dist_check::join(None, b.device)?;
    let dtype = b.dtype.dtype();
    let peak = matmul_peak_gflops(&device, dtype)?;
    let mut policy = shaped_model(b.shape, 0, dtype, &device)?;
    policy.gradient_checkpointing = b.gradient_checkpointing;
    let config = policy.config.clone();
    let reference: Box<dyn PolicyModel> = match b.lora_rank {
        Some(rank) => {
            let lora = oxrl_models::LoraConfig::all_linear(rank, 2.0 * rank as f64);
            policy.attach_lora(&lora, 0)?;
            let base = policy.detached();
            base.set_adapters_enabled(false);
            Box::new(base)
        }
        None => Box::new(shaped_model(b.shape, 1, dtype, &device)?),
    };
    let memory = crate::device_memory::PeakWatch::start(&device)?;
    let mut trainer = bench_trainer(
        Box::new(policy),
        reference,
        b.new_tokens,
        b.micro_batch_size,
        b.steps as u64,
    )?;
    trainer.join(DataParallel::new(group.collective()));
    let mut engine = LocalEngine::new(Arc::from(trainer.policy.detached()), None, Vec::new());
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let prompts = w1_prompts(b.prompts, trainer.policy.vocab_size(), &mut rng);
    let share = trainer.parallel.share(prompts.len());
    let params = SamplingParams {
        n: b.n,
        max_new_tokens: b.new_tokens,
        ignore_eos: true,
        first_prompt: share.start as u64,
        ..Default::default()
    };
    let mut timed: Vec<std::collections::BTreeMap<String, f64>> = Vec::new();
    for step in 0..b.steps {
        let start = Instant::now();
        let mine = engine.generate(
            &prompts[share.clone()],
            &SamplingParams {
                seed: step as u64,
                ..params.clone()
            },
        )?;
        let out = trainer.parallel.gather_completions(mine)?;
        let rollout = start.elapsed().as_secs_f64();
        let trajs = random_reward_trajectories(&prompts, &[], &out, &mut rng);
        let mut time = PhaseTimes::default();
        let mut m = learn(&mut trainer, &trajs, &mut time)?.report.metrics;
        m.extend(time.into_metrics());
        engine.sync_weights(trainer.policy.as_ref(), trainer.weight_version)?;
        m.insert("time/rollout".into(), rollout);
        m.insert("time/step".into(), start.elapsed().as_secs_f64());
        if trainer.parallel.is_main() {
            oxrl_train::note!("step {}: {:.2} s", step + 1, m["time/step"]);
        }
        timed.push(m);
    }
    let counted = if timed.len() > 1 {
        &timed[1..]
    } else {
        &timed[..]
    };
    let avg = |k: &str| {
        counted
            .iter()
            .map(|m| m.get(k).copied().unwrap_or(0.0))
            .sum::<f64>()
            / counted.len() as f64
    };
    let secs = avg("time/step");
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let prompt_len = prompt_tokens / prompts.len();
    let flops = oxrl_train::plan::grpo_step_flops(
        &config,
        prompt_tokens,
        b.prompts * b.n,
        b.new_tokens,
        prompt_len,
    )
    .total();
    // The ranks measured their matmul peaks side by side, each on its share of the cores: the
    // group's peak is their sum.
    let mut group_peak = [peak];
    trainer.parallel.sum(&mut group_peak)?;
    let peak = group_peak[0];
    let achieved = flops / secs / 1e9;
    let generated = (b.prompts * b.n * b.new_tokens) as f64;
    let (rollout_tokens_per_s, tokens_per_s) = (generated / avg("time/rollout"), generated / secs);
    let peak_memory_gib = memory.map(|m| m.stop() as f64 / (1u64 << 30) as f64);
    let host_rss_gib =
        crate::device_memory::host_peak_rss().map(|b| b as f64 / (1u64 << 30) as f64);
    let checkpointing = if b.gradient_checkpointing {
        " checkpointed"
    } else {
        ""
    };
    let trainable: usize = trainer.vars().iter().map(|(_, v)| v.elem_count()).sum();
    let lora = b.lora_rank.map_or(String::new(), |r| {
        format!(" LoRA rank {r} ({trainable} trainable)")
    });
    if !trainer.parallel.is_main() {
        return Ok(());
    }
    let ranks = match trainer.parallel.world_size() {
        1 => String::new(),
        w => format!(" on {w} ranks"),
    };
    let setup = format!(
        "{:?} {} {:?}{checkpointing}{lora}{ranks}",
        b.shape, b.device, b.dtype
    )
    .to_lowercase();
    let phases = [
        "time/rollout",
        "time/old_logprobs",
        "time/ref",
        "time/update",
    ];
    if b.json {
        let mut obj = serde_json::Map::new();
        obj.insert("bench".into(), "grpo-step".into());
        obj.insert("seconds_per_step".into(), secs.into());
        for p in phases {
            obj.insert(p.into(), avg(p).into());
        }
        obj.insert("tflop_per_step".into(), (flops / 1e12).into());
        obj.insert("achieved_gflops".into(), achieved.into());
        obj.insert("matmul_peak_gflops".into(), peak.into());
        obj.insert("fraction_of_peak".into(), (achieved / peak).into());
        obj.insert("rollout_tokens_per_s".into(), rollout_tokens_per_s.into());
        obj.insert("tokens_per_s".into(), tokens_per_s.into());
        obj.insert("setup".into(), setup.into());
        obj.insert("peak_device_memory_gib".into(), peak_memory_gib.into());
        obj.insert("peak_host_rss_gib".into(), host_rss_gib.into());
        obj.insert("trainable_parameters".into(), trainable.into());
        obj.insert("trl_seconds_per_step".into(), TRL_SECONDS_PER_STEP.into());
        obj.insert(
            "speedup_vs_trl".into(),
            (TRL_SECONDS_PER_STEP / secs).into(),
        );
        say!("{}", serde_json::Value::Object(obj))?;
    } else {
        let memory = peak_memory_gib
            .map(|g| format!("; peak device memory {g:.2} GiB"))
            .unwrap_or_default();
        let memory = match host_rss_gib {
            Some(g) => format!("{memory}; peak host RSS {g:.2} GiB"),
            None => memory,
        };
        say!(
            "grpo-step {setup}: {secs:.2} s/step (rollout {:.2}, old logprobs {:.2}, ref {:.2}, update {:.2}); \
             {tokens_per_s:.0} generated tokens/s per step, {rollout_tokens_per_s:.0} in the rollout; \
             {:.2} TFLOP → {achieved:.0} GFLOP/s of a {peak:.0} GFLOP/s matmul peak ({:.0}%){memory}; \
             {:.1}× TRL's ~{TRL_SECONDS_PER_STEP} s on W1",
            avg("time/rollout"),
            avg("time/old_logprobs"),
            avg("time/ref"),
            avg("time/update"),
            flops / 1e12,
            100.0 * achieved / peak,
            TRL_SECONDS_PER_STEP / secs
        )?;
    }
    Ok(())
}
