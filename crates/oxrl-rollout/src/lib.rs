//! oxrl-rollout: the generation engine. Many prompts of different lengths decode together with
//! per-sequence KV caches, `n` samples per prompt share the prompt's prefill, and every sampled
//! token comes back with its log-probability and the weight version that sampled it, behind the
//! [`Engine`] trait.

pub mod batch;
pub mod engine;
pub mod local;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod sampler;
pub mod vllm;
pub mod weight_transfer;

pub use batch::{Batcher, Group, GroupSink, StepReport, VersionSpan};
pub use engine::{
    Completion, Engine, EngineError, EpisodeTokens, FinishReason, PromptImage, PromptImages,
    SamplingParams, WeightVersion, MAX_SAMPLES_PER_PROMPT, MAX_SEQUENCES_PER_REQUEST,
};
pub use local::LocalEngine;
pub use sampler::{SamplerConfig, SamplerScratch};
pub use vllm::{VllmEngine, VllmSpec, WeightSync};
pub use weight_transfer::Broadcaster;
