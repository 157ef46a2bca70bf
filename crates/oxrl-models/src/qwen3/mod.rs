//! The Qwen3 family: `Qwen3ForCausalLM` (qwen3-vl-spec §1), `Qwen3VLForConditionalGeneration`
//! (§2: the same decoder with interleaved MRoPE, image embeddings written over the
//! `<|image_pad|>` tokens and DeepStack features added after the first text layers, fed by the
//! vision tower in [`crate::vision`]) and `Qwen3ForSequenceClassification` (a reward model).
//!
//! Laid out as candle-transformers lays out a family: a struct per module ([`Attention`],
//! [`Mlp`], [`RmsNorm`], [`DecoderLayer`], the body [`Qwen3Model`], the causal LM [`Qwen3`]),
//! each naming its weights once (see [`crate::weights::Module`]).
//!
//! Two paths over the same weights give the same numbers:
//! - the training path ([`Qwen3::forward`], [`Qwen3::score_batch`],
//!   [`Qwen3::response_logprobs`]) is built only from candle primitives that carry a backward (no
//!   candle-nn fused rms_norm / rope / softmax_last_dim, which silently drop gradients), on
//!   right-padded batches;
//! - the inference path in [`kv_cache`] decodes many sequences of different lengths at once with
//!   a per-sequence KV cache.

mod attention;
mod causal_lm;
pub mod checkpointing;
pub mod chunked_head;
mod config;
mod decoder_layer;
mod detached;
mod image_prompting;
pub mod kv_cache;
pub mod lora;
pub mod lora_dropout;
mod mlp;
mod model;
mod model_traits;
mod random;
pub mod reward_model;
mod rms_norm;
mod rotary;
mod save;
mod scoring;
pub mod value_model;
mod visual;

pub use attention::Attention;
pub use causal_lm::{Qwen3, LOGIT_CHUNK_ELEMENTS};
pub use checkpointing::LayerCheckpoints;
pub use chunked_head::ChunkedHead;
pub use decoder_layer::DecoderLayer;
pub use image_prompting::ImagePrompting;
pub use kv_cache::{CacheKind, KvCache, VocabSlices};
pub use lora::{LoraConfig, LoraInit, LORA_TARGETS};
pub use lora_dropout::DropoutPass;
pub use mlp::Mlp;
pub use model::Qwen3Model;
pub use random::parameter_shapes;
pub use reward_model::Qwen3RewardModel;
pub use rms_norm::RmsNorm;
pub use scoring::{BatchLogprobs, Entropy, LogprobsAndEntropy, ScoreRequest};
pub use value_model::Qwen3ValueModel;
pub use visual::Vision;

/// `architectures` of a text-only Qwen3 checkpoint.
pub const CAUSAL_LM: &str = "Qwen3ForCausalLM";
/// `architectures` of a Qwen3-VL checkpoint.
pub const VISION_LANGUAGE: &str = "Qwen3VLForConditionalGeneration";

/// The architecture a Qwen3 policy is, by whether it has a vision tower.
pub(crate) fn architecture(vl: bool) -> &'static str {
    if vl {
        VISION_LANGUAGE
    } else {
        CAUSAL_LM
    }
}
