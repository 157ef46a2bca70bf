//! What a run needs per GPU, before it is launched: memory by category, whether it fits, the
//! largest micro-batch that fits, and an estimated step time and cost. The estimates follow
//! oxrl's own training path (composed attention, f32 softmax, f32 master weights and AdamW
//! moments) and, for more than one GPU, the ZeRO-2 layout of `shared/docs/scale-out.md` §1.3:
//! bf16 parameters replicated, f32 gradients and optimizer state sharded.

use crate::config::RunConfig;
use crate::error::Result;
use oxrl_models::config::Qwen3Config;
use oxrl_models::qwen3::{parameter_shapes, LOGIT_CHUNK_ELEMENTS};

/// A GPU model: memory, dense bf16 throughput and memory bandwidth (vendor figures).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accelerator {
    pub name: &'static str,
    pub memory_bytes: f64,
    pub bf16_flops: f64,
    pub bandwidth_bytes_per_s: f64,
}

const GB: f64 = 1e9;
const TERA: f64 = 1e12;

/// The GPUs `oxrl plan --gpu` knows.
pub const ACCELERATORS: [Accelerator; 5] = [
    Accelerator {
        name: "h100",
        memory_bytes: 80.0 * GB,
        bf16_flops: 989.0 * TERA,
        bandwidth_bytes_per_s: 3350.0 * GB,
    },
    Accelerator {
        name: "h200",
        memory_bytes: 141.0 * GB,
        bf16_flops: 989.0 * TERA,
        bandwidth_bytes_per_s: 4800.0 * GB,
    },
    Accelerator {
        name: "a100-80",
        memory_bytes: 80.0 * GB,
        bf16_flops: 312.0 * TERA,
        bandwidth_bytes_per_s: 2039.0 * GB,
    },
    Accelerator {
        name: "a100-40",
        memory_bytes: 40.0 * GB,
        bf16_flops: 312.0 * TERA,
        bandwidth_bytes_per_s: 1555.0 * GB,
    },
    Accelerator {
        name: "l40s",
        memory_bytes: 48.0 * GB,
        bf16_flops: 362.0 * TERA,
        bandwidth_bytes_per_s: 864.0 * GB,
    },
];

/// The accelerator called `name`, or an error listing the known ones.
pub fn accelerator(name: &str) -> std::result::Result<Accelerator, String> {
    ACCELERATORS
        .iter()
        .find(|a| a.name == name)
        .copied()
        .ok_or_else(|| {
            let known: Vec<&str> = ACCELERATORS.iter().map(|a| a.name).collect();
            format!("unknown GPU `{name}`; one of {}", known.join(", "))
        })
}

/// Fraction of peak FLOPs the training phases are assumed to reach (a typical MFU for dense
/// transformer training without fused attention).
pub const ASSUMED_MFU: f64 = 0.35;

/// Memory not given to the run: the CUDA context, allocator fragmentation, NCCL buffers.
pub const RESERVED_FRACTION: f64 = 0.1;

/// One run as the planner sees it.
#[derive(Debug, Clone)]
pub struct Workload {
    pub model: Qwen3Config,
    /// Every weight, vision tower included.
    pub parameters: u64,
    /// The weights that train: all of them, or a LoRA run's adapters.
    pub trainable: u64,
    /// LoRA: the base weights are frozen (no gradients, no optimizer state, no weight-gradient
    /// products in the backward) and the reference is the base with the adapters off.
    pub lora: Option<LoraShape>,
    /// Bytes per element of the compute dtype (bf16: 2, f32: 4).
    pub dtype_bytes: f64,
    /// A reference model is held beside the policy (`kl_coef > 0`).
    pub reference: bool,
    pub gpus: usize,
    /// Prompts per step and samples per prompt.
    pub prompts: usize,
    pub samples: usize,
    pub prompt_tokens: usize,
    pub response_tokens: usize,
    /// Trajectories per forward/backward.
    pub micro_batch: usize,
    pub gradient_checkpointing: bool,
    /// Response rows whose logits are held at once (the chunked head's chunk).
    pub logit_chunk_rows: usize,
}

/// Bytes per GPU by category.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Memory {
    /// Policy (and reference) weights in the compute dtype, replicated (a LoRA run's reference
    /// shares the policy's).
    pub weights: f64,
    /// f32 gradient accumulators (a shard of them under ZeRO-2, plus one layer's bucket).
    pub gradients: f64,
    /// The gradients one backward hands back in the compute dtype before they are added to the
    /// accumulators (every weight's on one GPU; a layer's at a time under ZeRO-2).
    pub backward_gradients: f64,
    /// f32 master weights and AdamW moments (sharded under ZeRO-2).
    pub optimizer: f64,
    /// A micro-batch's activations kept for the backward, as configured.
    pub activations: f64,
    /// The same without checkpointing and with it, for the table.
    pub activations_full: f64,
    pub activations_checkpointed: f64,
    /// Logits and their gradient for the rows held at once (f32).
    pub logits: f64,
    /// The local engine's KV cache for this GPU's share of the rollout, all at once.
    pub kv_cache: f64,
    /// The KV cache of one sequence.
    pub kv_cache_per_sequence: f64,
}

impl Memory {
    /// What stays resident through the step: weights, gradients, optimizer state.
    pub fn state(&self) -> f64 {
        self.weights + self.gradients + self.optimizer
    }

    /// What one micro-batch's forward and backward add to the state at their peak.
    pub fn micro_batch(&self) -> f64 {
        self.activations + self.logits + self.backward_gradients
    }

    /// The update's peak.
    pub fn training(&self) -> f64 {
        self.state() + self.micro_batch()
    }

    /// The rollout's peak, every sequence of this GPU decoded at once.
    pub fn rollout(&self) -> f64 {
        self.state() + self.kv_cache
    }

    /// Sequences the local engine can decode at once within `budget` bytes.
    pub fn concurrent_sequences(&self, budget: f64) -> usize {
        ((budget - self.state()) / self.kv_cache_per_sequence).max(0.0) as usize
    }
}

/// Bytes one token keeps per layer outside attention on the training path, in the compute
/// dtype `w` (bytes per element): RMSNorms in f32 (≈ 12 + 2w bytes per element, twice), the
/// projections, q/k norms and rotary terms, the attention output and its copy, the SwiGLU
/// MLP's five intermediate tensors, the residual adds.
fn token_layer_bytes(c: &Qwen3Config, w: f64) -> f64 {
    let (d, i) = (c.hidden_size as f64, c.intermediate_size as f64);
    let (h, kv, hd) = (
        c.num_attention_heads as f64,
        c.num_key_value_heads as f64,
        c.head_dim as f64,
    );
    d * (2.0 * (12.0 + 2.0 * w) + 4.0 * w)
        + i * 5.0 * w
        + (h + 2.0 * kv) * hd * 2.0 * w
        + (h + kv) * hd * (12.0 + 7.0 * w)
        + h * hd * 2.0 * w
}

/// Bytes the composed attention keeps per sequence per layer: for every head and every
/// (query, key) pair the scores and their scaled copy in `w`, the f32 copy (none when `w` is f32),
/// the mask add, the softmax's shifted, exponentiated and divided tensors, and the probabilities
/// back in `w` (none in f32): 26 B in bf16, 24 B in f32.
fn attention_layer_bytes(c: &Qwen3Config, w: f64, sequence: f64) -> f64 {
    let casts = if w == 4.0 { 0.0 } else { 4.0 + w };
    (2.0 * w + 16.0 + casts) * c.num_attention_heads as f64 * sequence * sequence
}

/// Gradient buffers alive beside a layer's activations while its backward runs: the f32
/// gradients of three of the attention's (query, key) tensors per head, and four of the MLP's
/// intermediate-sized ones per token.
fn backward_working_bytes(c: &Qwen3Config, w: f64, sequences: f64, sequence: f64) -> f64 {
    sequences * 3.0 * 4.0 * c.num_attention_heads as f64 * sequence * sequence
        + sequences * sequence * 4.0 * w * c.intermediate_size as f64
}

impl Workload {
    /// The run `cfg` describes on `gpus` GPUs, counted from its model's `config.json` (no
    /// weights are read), and a name for the model.
    pub fn from_run(cfg: &RunConfig, gpus: usize) -> Result<(Workload, String)> {
        let model_dir = oxrl_models::hub::resolve_model(&cfg.model_path)?;
        let config_path = model_dir.join("config.json");
        let config_json = oxrl_models::config::read_json(&config_path)?;
        let (model, shapes) = parameter_shapes(&config_json, &config_path)?;
        let parameters: u64 = shapes
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum();
        let architecture = config_json
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .unwrap_or("Qwen3ForCausalLM");
        let name = format!("{} ({architecture})", cfg.model_path);
        let trainable = match &cfg.lora {
            Some(lora) => lora_parameters(&shapes, lora),
            None => parameters,
        };
        let logit_chunk_rows = LOGIT_CHUNK_ELEMENTS / model.vocab_size.max(1);
        // Sequences are as long as the limits allow, never past the model's positions; a
        // micro-batch never holds more than the step's trajectories.
        let positions = model.max_position_embeddings;
        let response_tokens = cfg.rollout.max_new_tokens.min(positions);
        let prompt_tokens = cfg.data.max_prompt_length.min(positions - response_tokens);
        let trajectories = cfg.batch_size * cfg.rollout.n_samples_per_prompt;
        let lora = cfg.lora.as_ref().map(|l| LoraShape::of(&model, l));
        let workload = Workload {
            model,
            parameters,
            trainable,
            lora,
            dtype_bytes: if cfg.dtype == "f32" { 4.0 } else { 2.0 },
            reference: cfg.algorithm.kl_coef > 0.0,
            gpus: gpus.max(1),
            prompts: cfg.batch_size,
            samples: cfg.rollout.n_samples_per_prompt,
            prompt_tokens,
            response_tokens,
            micro_batch: cfg.update.micro_batch_size.min(trajectories).max(1),
            gradient_checkpointing: cfg.gradient_checkpointing,
            logit_chunk_rows,
        };
        Ok((workload, name))
    }

    fn sequence(&self) -> f64 {
        (self.prompt_tokens + self.response_tokens) as f64
    }

    fn shard(&self) -> f64 {
        self.gpus.max(1) as f64
    }

    /// Activation bytes of a micro-batch of `micro` trajectories at the backward's peak,
    /// without and with layer checkpointing: every layer's activations, or the boundaries and
    /// one layer's; either way plus the gradient buffers of the layer being differentiated.
    fn activations(&self, micro: usize) -> (f64, f64) {
        let (c, w) = (&self.model, self.dtype_bytes);
        let s = self.sequence();
        let tokens = micro as f64 * s;
        let adapters = self.lora.map_or(0.0, |l| l.token_layer_bytes(w));
        let layer = tokens * (token_layer_bytes(c, w) + adapters)
            + micro as f64 * attention_layer_bytes(c, w, s);
        let working = backward_working_bytes(c, w, micro as f64, s);
        let layers = c.num_hidden_layers as f64;
        let boundaries = layers * tokens * c.hidden_size as f64 * w;
        (layers * layer + working, boundaries + layer + working)
    }

    /// Memory per GPU with micro-batches of `micro` trajectories.
    pub fn memory(&self, micro: usize) -> Memory {
        let p = self.parameters as f64;
        // What trains: gradients and optimizer state are counted over these.
        let t = self.trainable as f64;
        let c = &self.model;
        let w = self.dtype_bytes;
        let copies = if self.reference && self.lora.is_none() {
            2.0
        } else {
            1.0
        };
        let largest_bucket = 4.0 * self.layer_parameters() * t / p;
        let gradients = match self.gpus {
            0 | 1 => 4.0 * t,
            _ => 4.0 * t / self.shard() + largest_bucket,
        };
        let (full, checkpointed) = self.activations(micro);
        let rows = (micro * self.response_tokens).min(self.logit_chunk_rows.max(1)) as f64;
        let sequences = (self.prompts * self.samples) as f64 / self.shard();
        let kv_per_token =
            2.0 * c.num_hidden_layers as f64 * (c.num_key_value_heads * c.head_dim) as f64 * w;
        let kv_per_sequence = self.sequence() * kv_per_token;
        let backward_gradients = match self.gpus {
            0 | 1 => t * w,
            _ => self.layer_parameters() * w * t / p,
        };
        let adapters = if self.lora.is_some() { t * w } else { 0.0 };
        Memory {
            weights: copies * p * w + adapters,
            gradients,
            backward_gradients,
            optimizer: 3.0 * 4.0 * t / self.shard(),
            activations: if self.gradient_checkpointing {
                checkpointed
            } else {
                full
            },
            activations_full: full,
            activations_checkpointed: checkpointed,
            // Logits, their gradient and the softmax's working copy, all f32.
            logits: 3.0 * 4.0 * rows * c.vocab_size as f64,
            kv_cache: sequences * kv_per_sequence,
            kv_cache_per_sequence: kv_per_sequence,
        }
    }

    /// Weights of one decoder layer (the ZeRO-2 bucket).
    fn layer_parameters(&self) -> f64 {
        let c = &self.model;
        let (d, i) = (c.hidden_size as f64, c.intermediate_size as f64);
        let (h, kv, hd) = (
            c.num_attention_heads as f64,
            c.num_key_value_heads as f64,
            c.head_dim as f64,
        );
        2.0 * d * h * hd + 2.0 * d * kv * hd + 3.0 * d * i
    }

    /// The largest micro-batch (at most the step's trajectories) whose memory fits `budget`
    /// bytes; `None` when not even one fits.
    pub fn largest_micro_batch(&self, budget: f64) -> Option<usize> {
        let most = (self.prompts * self.samples / self.gpus.max(1)).max(1);
        (1..=most)
            .take_while(|&m| self.memory(m).training() <= budget)
            .last()
    }

    /// Estimated seconds per step on `gpus` × `accelerator`: the training phases (old and
    /// reference log-probs, update; plus one more forward with checkpointing) at
    /// [`ASSUMED_MFU`] of peak, and decoding bound by reading the weights once per token.
    pub fn step_seconds(&self, accelerator: &Accelerator) -> StepTime {
        let responses = self.prompts * self.samples;
        let flops = grpo_step_flops(
            &self.model,
            responses * self.prompt_tokens,
            responses,
            self.response_tokens,
            self.prompt_tokens,
        );
        let forward = flops.update / 3.0;
        // LoRA's backward computes input gradients only (the frozen weights get none): 2×
        // the forward instead of 3× (the adapters' own products are a rounding error).
        let update = if self.lora.is_some() {
            2.0 * forward
        } else {
            flops.update
        };
        let training = flops.old_logprobs
            + if self.reference { flops.reference } else { 0.0 }
            + update
            + if self.gradient_checkpointing {
                forward
            } else {
                0.0
            };
        let rate = accelerator.bf16_flops * ASSUMED_MFU * self.shard();
        let decode_step =
            self.parameters as f64 * self.dtype_bytes / accelerator.bandwidth_bytes_per_s;
        let rollout = (decode_step * self.response_tokens as f64).max(flops.rollout / rate);
        StepTime {
            rollout,
            training: training / rate,
        }
    }
}

/// A LoRA run's adapters per decoder layer, as the planner counts them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraShape {
    pub rank: usize,
    /// Adapted projections per layer.
    pub projections: usize,
    /// The sum of their output widths.
    pub outputs: usize,
}

impl LoraShape {
    pub fn of(c: &Qwen3Config, lora: &oxrl_models::LoraConfig) -> Self {
        let width = |target: &str| match target {
            "q_proj" => c.num_attention_heads * c.head_dim,
            "k_proj" | "v_proj" => c.num_key_value_heads * c.head_dim,
            "gate_proj" | "up_proj" => c.intermediate_size,
            _ => c.hidden_size,
        };
        Self {
            rank: lora.rank,
            projections: lora.targets.len(),
            outputs: lora.targets.iter().map(|t| width(t)).sum(),
        }
    }

    /// Bytes a token keeps per layer for the adapters' backward, in the compute dtype `w`: per
    /// adapted projection `x·Aᵀ` and its scaled copy (rank wide), the adapter's output and
    /// its sum with the frozen product (output wide).
    fn token_layer_bytes(&self, w: f64) -> f64 {
        w * (2.0 * self.outputs as f64 + 2.0 * (self.rank * self.projections) as f64)
    }
}

/// LoRA adapter elements on the language model's projections that `lora` targets, from a
/// model's parameter shapes: `r·(in + out)` per adapted `[out, in]` weight.
pub fn lora_parameters(shapes: &[(String, Vec<usize>)], lora: &oxrl_models::LoraConfig) -> u64 {
    shapes
        .iter()
        .filter(|(name, _)| !name.starts_with(oxrl_models::vision::VISION_PREFIX))
        .filter(|(name, _)| {
            lora.targets
                .iter()
                .any(|t| name.ends_with(&format!(".{t}.weight")))
        })
        .map(|(_, s)| (lora.rank * s.iter().sum::<usize>()) as u64)
        .sum()
}

/// Bus bandwidth a ring collective reaches among the 8 GPUs of one NVLink node, and per GPU
/// between nodes over 400 Gb/s-class networks (EFA, InfiniBand): planning figures
/// (`shared/docs/scale-out.md` §2), not measurements.
pub const NVLINK_BUS_BYTES_PER_S: f64 = 400.0 * GB;
pub const INTERNODE_BUS_BYTES_PER_S: f64 = 50.0 * GB;

/// What ZeRO-2 sends per GPU in one training step (one optimizer step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Zero2Traffic {
    /// The f32 gradients' reduce-scatters, one per micro-batch of the GPU's share.
    pub reduce_scatter_bytes: f64,
    /// The updated weights' all-gather, in the compute dtype.
    pub all_gather_bytes: f64,
    pub micro_batches: usize,
}

impl Zero2Traffic {
    pub fn bytes(&self) -> f64 {
        self.reduce_scatter_bytes + self.all_gather_bytes
    }

    /// Seconds at bus bandwidth `bus_bytes_per_s` (a ring moves (W − 1)/W of each buffer per
    /// GPU; the bytes already count that).
    pub fn seconds(&self, bus_bytes_per_s: f64) -> f64 {
        self.bytes() / bus_bytes_per_s
    }
}

impl Workload {
    /// ZeRO-2's traffic per GPU in one step on `gpus` GPUs (`None` on one).
    pub fn zero2_traffic(&self) -> Option<Zero2Traffic> {
        if self.gpus <= 1 {
            return None;
        }
        let w = self.gpus as f64;
        let ring = (w - 1.0) / w;
        let t = self.trainable as f64;
        let share = (self.prompts * self.samples).div_ceil(self.gpus);
        let micro_batches = share.div_ceil(self.micro_batch.max(1));
        Some(Zero2Traffic {
            reduce_scatter_bytes: 4.0 * t * ring * micro_batches as f64,
            all_gather_bytes: self.dtype_bytes * t * ring,
            micro_batches,
        })
    }
}

/// Estimated seconds of a step's phases.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTime {
    pub rollout: f64,
    pub training: f64,
}

impl StepTime {
    pub fn total(&self) -> f64 {
        self.rollout + self.training
    }
}

/// Matrix FLOPs of one GRPO step's phases on a model of config `c`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepFlops {
    /// Prefill and every generated token's decode forward.
    pub rollout: f64,
    /// One forward over prompt + response (lm_head on response positions only).
    pub old_logprobs: f64,
    pub reference: f64,
    /// Forward + backward (2× the forward).
    pub update: f64,
}

impl StepFlops {
    pub fn total(&self) -> f64 {
        self.rollout + self.old_logprobs + self.reference + self.update
    }
}

/// Matrix FLOPs of one GRPO step: a forward costs 2·(layer weights) per token plus
/// 2·vocab·hidden per scored or generated token.
pub fn grpo_step_flops(
    c: &Qwen3Config,
    prompt_tokens: usize,
    responses: usize,
    new_tokens: usize,
    prompt_len: usize,
) -> StepFlops {
    let (d, i, l) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.num_hidden_layers as f64,
    );
    let (h, kv, hd) = (
        c.num_attention_heads as f64,
        c.num_key_value_heads as f64,
        c.head_dim as f64,
    );
    let layer = l * (d * h * hd * 2.0 + d * kv * hd * 2.0 + 3.0 * d * i);
    let head = c.vocab_size as f64 * d;
    let decoded = (responses * new_tokens) as f64;
    let rollout = 2.0 * (layer * (prompt_tokens as f64 + decoded) + head * decoded);
    let sequence_tokens = (responses * (prompt_len + new_tokens)) as f64;
    let forward = 2.0 * (layer * sequence_tokens + head * decoded);
    StepFlops {
        rollout,
        old_logprobs: forward,
        reference: forward,
        update: 3.0 * forward,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-VL-8B's text decoder (shared/docs/scale-out.md §1.3).
    fn qwen3_vl_8b_text() -> Qwen3Config {
        let v = serde_json::json!({
            "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 5e6,
            "max_position_embeddings": 262144, "tie_word_embeddings": false,
        });
        Qwen3Config::from_value(&v, std::path::Path::new("test")).unwrap()
    }

    fn workload(gpus: usize) -> Workload {
        Workload {
            model: qwen3_vl_8b_text(),
            parameters: 8_770_000_000,
            trainable: 8_770_000_000,
            lora: None,
            dtype_bytes: 2.0,
            reference: false,
            gpus,
            prompts: 64,
            samples: 8,
            prompt_tokens: 2048,
            response_tokens: 2048,
            micro_batch: 1,
            gradient_checkpointing: true,
            logit_chunk_rows: 1766,
        }
    }

    #[test]
    fn zero2_traffic_of_the_8b_on_8_gpus() {
        assert!(workload(1).zero2_traffic().is_none());
        let mut w = workload(8);
        // 512 trajectories over 8 GPUs: 64 each, in micro-batches of 64 → one reduce-scatter.
        w.micro_batch = 64;
        let t = w.zero2_traffic().unwrap();
        assert_eq!(t.micro_batches, 1);
        // f32 gradients 35.08 GB and bf16 weights 17.54 GB, each × 7/8 on a ring.
        assert!((t.reduce_scatter_bytes / 1e9 - 35.08 * 7.0 / 8.0).abs() < 0.01);
        assert!((t.all_gather_bytes / 1e9 - 17.54 * 7.0 / 8.0).abs() < 0.01);
        assert!((t.seconds(NVLINK_BUS_BYTES_PER_S) - 46.04 / 400.0).abs() < 1e-3);
        // Micro-batches of 16: four reduce-scatters.
        w.micro_batch = 16;
        let t = w.zero2_traffic().unwrap();
        assert_eq!(t.micro_batches, 4);
        assert!((t.reduce_scatter_bytes / 1e9 - 4.0 * 35.08 * 7.0 / 8.0).abs() < 0.02);
    }

    #[test]
    fn state_matches_the_scale_out_table() {
        // scale-out.md §1.3: bf16 params 17.5 GB; f32 grads 35.1 GB whole, 4.4 GB a shard of
        // 8; master + m + v 105.2 GB whole, 13.2 GB a shard.
        let one = workload(1).memory(1);
        assert!((one.weights / 1e9 - 17.54).abs() < 0.01);
        assert!((one.gradients / 1e9 - 35.08).abs() < 0.01);
        assert!((one.optimizer / 1e9 - 105.24).abs() < 0.01);
        let eight = workload(8).memory(1);
        assert_eq!(eight.weights, one.weights);
        assert!((eight.optimizer / 1e9 - 13.155).abs() < 0.01);
        // A shard of the gradients plus one layer's f32 bucket (192.9 M weights: 0.77 GB).
        let layer = 2.0 * 4096.0 * 4096.0 + 2.0 * 4096.0 * 1024.0 + 3.0 * 4096.0 * 12288.0;
        assert_eq!(layer, 192_937_984.0);
        assert!((eight.gradients - (4.0 * 8.77e9 / 8.0 + 4.0 * layer)).abs() < 1.0);
    }

    #[test]
    fn activations_follow_the_op_list() {
        let c = qwen3_vl_8b_text();
        // ≈ 0.4 MB per token per layer outside attention (scale-out.md §1.3): hidden 4096 × 40
        // B, MLP 12288 × 10, q+k+v 6144 × 4, q+k 5120 × 26, attention output 4096 × 4.
        let per_token = token_layer_bytes(&c, 2.0);
        let by_hand = 4096.0 * 40.0 + 12288.0 * 10.0 + 6144.0 * 4.0 + 5120.0 * 26.0 + 4096.0 * 4.0;
        assert_eq!(by_hand, 460_800.0);
        assert_eq!(per_token, by_hand);
        // 26 B × 32 heads × S² for one sequence: 14 GB per layer at S = 4096.
        let attention = attention_layer_bytes(&c, 2.0, 4096.0);
        assert_eq!(attention, 26.0 * 32.0 * 4096.0 * 4096.0);
        assert_eq!(attention_layer_bytes(&c, 4.0, 1.0), 24.0 * 32.0);
        // Backward's gradient buffers: 12 B × 32 heads × S², and 16 B × 12288 per token.
        let working = backward_working_bytes(&c, 2.0, 1.0, 4096.0);
        assert_eq!(
            working,
            12.0 * 32.0 * 4096.0 * 4096.0 + 4096.0 * 8.0 * 12288.0
        );
        let w = workload(8);
        let (full, checkpointed) = w.activations(1);
        let layer = 4096.0 * per_token + attention;
        assert!((full - (36.0 * layer + working)).abs() < 1.0);
        let boundaries = 36.0 * 4096.0 * 4096.0 * 2.0;
        assert!((checkpointed - (boundaries + layer + working)).abs() < 1.0);
        assert!(checkpointed < full / 10.0);
    }

    /// LoRA rank 16 on all seven projections of Qwen3-VL-8B's 36 layers: per layer
    /// 16·(2·(4096 + 4096) + 2·(4096 + 1024) + 3·(4096 + 12288)) = 1,212,416 elements.
    #[test]
    fn lora_trains_and_keeps_only_the_adapters() {
        let shapes: Vec<(String, Vec<usize>)> = ["q_proj", "k_proj", "v_proj", "o_proj"]
            .iter()
            .zip([[4096, 4096], [1024, 4096], [1024, 4096], [4096, 4096]])
            .chain(["gate_proj", "up_proj", "down_proj"].iter().zip([
                [12288, 4096],
                [12288, 4096],
                [4096, 12288],
            ]))
            .flat_map(|(name, shape)| {
                (0..36).map(move |l| {
                    let part = if name.ends_with("_proj") && name.len() == 6 {
                        "self_attn"
                    } else {
                        "mlp"
                    };
                    (
                        format!("model.language_model.layers.{l}.{part}.{name}.weight"),
                        shape.to_vec(),
                    )
                })
            })
            .chain([(
                "model.visual.blocks.0.attn.qkv.weight".to_string(),
                vec![3456, 1152],
            )])
            .collect();
        let lora = oxrl_models::LoraConfig::all_linear(16, 32.0);
        let per_layer = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288));
        assert_eq!(per_layer, 1_212_416);
        let trainable = lora_parameters(&shapes, &lora);
        assert_eq!(trainable, 36 * per_layer as u64);

        let mut w = workload(1);
        w.reference = true;
        let full_w = w.clone();
        let full = w.memory(1);
        w.lora = Some(LoraShape::of(&w.model, &lora));
        w.trainable = trainable;
        let m = w.memory(1);
        // One copy of the weights (the reference is the base with adapters off) plus adapters.
        assert_eq!(m.weights, 8.77e9 * 2.0 + trainable as f64 * 2.0);
        assert_eq!(full.weights, 2.0 * 8.77e9 * 2.0);
        assert_eq!(m.gradients, 4.0 * trainable as f64);
        assert_eq!(m.optimizer, 12.0 * trainable as f64);
        assert_eq!(m.backward_gradients, 2.0 * trainable as f64);
        // Activations: the full run's, plus per token and layer each projection's x·Aᵀ and its
        // scaled copy (16 wide) and the adapter's output and sum (output wide; the outputs sum
        // to 4096 + 1024 + 1024 + 4096 + 12288 + 12288 + 4096 = 38,912), in bf16.
        let shape = w.lora.unwrap();
        assert_eq!((shape.projections, shape.outputs), (7, 38_912));
        let per_layer = 4096.0 * 2.0 * (2.0 * 38_912.0 + 2.0 * 16.0 * 7.0);
        let full_extra = m.activations_full - full.activations_full;
        assert!((full_extra - 36.0 * per_layer).abs() < 1.0);
        // Checkpointed, one layer's activations are alive at a time.
        let checkpointed_extra = m.activations_checkpointed - full.activations_checkpointed;
        assert!((checkpointed_extra - per_layer).abs() < 1.0);
        // The update: forward + input gradients only.
        let gpu = accelerator("h100").unwrap();
        let (a, b) = (full_w.step_seconds(&gpu), w.step_seconds(&gpu));
        assert!(b.training < a.training && b.rollout == a.rollout);
    }

    #[test]
    fn the_largest_micro_batch_is_the_last_that_fits() {
        let mut w = workload(8);
        w.prompt_tokens = 512;
        w.response_tokens = 512;
        let budget = 72e9;
        let m = w.largest_micro_batch(budget).unwrap();
        assert!(w.memory(m).training() <= budget);
        assert!(w.memory(m + 1).training() > budget);
        assert_eq!(w.largest_micro_batch(1e9), None);
    }

    #[test]
    fn step_flops_by_hand() {
        // One layer, hidden 1, MLP 1, one head of size 1, one kv head, vocab 10: a layer is
        // 2 + 2 + 3 = 7 weights, the head 10.
        let v = serde_json::json!({
            "vocab_size": 10, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1,
            "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1,
        });
        let c = Qwen3Config::from_value(&v, std::path::Path::new("test")).unwrap();
        // 2 responses of 3 tokens after 4-token prompts (8 prompt tokens in all).
        let f = grpo_step_flops(&c, 8, 2, 3, 4);
        assert_eq!(f.rollout, 2.0 * (7.0 * (8.0 + 6.0) + 10.0 * 6.0));
        let forward = 2.0 * (7.0 * 14.0 + 10.0 * 6.0);
        assert_eq!(f.old_logprobs, forward);
        assert_eq!(f.update, 3.0 * forward);
        assert_eq!(f.total(), f.rollout + 5.0 * forward);
    }

    #[test]
    fn unknown_gpus_are_named_with_the_known_ones() {
        assert_eq!(accelerator("h200").unwrap().memory_bytes, 141e9);
        let err = accelerator("tpu").unwrap_err();
        assert!(err.contains("h100") && err.contains("tpu"), "{err}");
    }
}
