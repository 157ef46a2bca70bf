//! The engine seam: token ids in, sampled token ids with their log-probabilities out, each
//! completion stamped with the weight version that sampled it. The local engine implements it
//! over any `PolicyModel` in this process; a remote server (vLLM, `oxrl serve`) implements it
//! over HTTP without the trainer noticing.
//!
//! Weights move only through [`Engine::sync_weights`], which also advances the engine's
//! [`WeightVersion`]. The trainer checks every completion's version against its own, so an
//! engine that silently kept sampling from old weights (the stale-weight bug of the Python
//! stacks) stops the run instead of quietly training off-policy.

use crate::sampler::SamplerConfig;
use oxrl_models::{PolicyModel, ProcessedImage};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Which weights sampled a completion: 0 is the policy a run started from (or resumed at, as
/// its step), and the trainer's version after `k` updates is `k`. Versions only grow.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct WeightVersion(pub u64);

impl std::fmt::Display for WeightVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// One image of a prompt: the processed pixels the local model reads, and where the picture
/// came from, for a server that takes images by reference or bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptImage {
    pub pixels: Arc<ProcessedImage>,
    /// An absolute path or a `data:` URL; `None` for a picture made in memory.
    pub source: Option<String>,
}

/// The largest group one prompt may ask for (`n`); a bound so that a typo (`--n 1e10`) is an
/// error, not an allocation of the whole machine. GRPO groups are 4–64.
pub const MAX_SAMPLES_PER_PROMPT: usize = 4096;

/// The most sequences (prompts × `n`) one request may ask for.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 1 << 20;

/// How to sample, shared by every prompt of one [`Engine::generate`] call.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Samples per prompt (a GRPO group); they share the prompt's prefill.
    pub n: usize,
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    /// Makes sampling reproducible: sample `j` of prompt `i` draws from its own stream of this
    /// seed, so results do not depend on batching.
    pub seed: u64,
    /// Ids that end a sequence besides the model's eos ids.
    pub stop_token_ids: Vec<u32>,
    /// Texts that end a sequence; the returned text stops before them.
    pub stop_strings: Vec<String>,
    /// Keep going past the model's eos ids (the user's `stop_token_ids` still apply).
    pub ignore_eos: bool,
    /// The place of this call's first prompt in a larger batch: prompt `i` samples as prompt
    /// `first_prompt + i` of that batch would. A data-parallel rank generating its share of a
    /// step's prompts draws exactly what one process generating them all would.
    pub first_prompt: u64,
}

impl SamplingParams {
    /// The token ids that end a sequence: the request's own, then the model's `eos` ids unless
    /// `ignore_eos`.
    pub fn stop_ids(&self, eos: &[u32]) -> Vec<u32> {
        let mut ids = self.stop_token_ids.clone();
        if !self.ignore_eos {
            ids.extend(eos);
        }
        ids
    }
}

impl WeightVersion {
    /// Moves to `to`, refusing to go back: every engine's `sync_weights` starts here.
    pub fn advance_to(&mut self, to: WeightVersion) -> Result<()> {
        if to < *self {
            return Err(EngineError::VersionBackwards { current: *self, to });
        }
        *self = to;
        Ok(())
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            max_new_tokens: 256,
            sampler: SamplerConfig::default(),
            seed: 0,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            first_prompt: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token id (included in `response_ids`) or a stop string ended the sequence.
    Stop,
    /// `max_new_tokens` or the model's last position was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One sampled continuation of a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub response_ids: Vec<u32>,
    /// Per response token, its log-probability under the temperature-scaled distribution.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    /// The decoded response (special tokens skipped), when the engine has a tokenizer.
    pub text: Option<String>,
    /// The weights that sampled it.
    pub weight_version: WeightVersion,
    /// A multi-turn episode's extras; `None` for one generation.
    pub episode: Option<EpisodeTokens>,
}

/// What a multi-turn episode adds to a completion: its response interleaves the policy's turns
/// with the environment's observation tokens.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EpisodeTokens {
    /// The episode's prompt, when its environment replaced the request's.
    pub prompt_ids: Option<Vec<u32>>,
    /// Per response token: the policy generated it (`true`), or the environment wrote it.
    pub generated: Vec<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    InvalidRequest(String),
    /// A weight sync that would move the engine back to older weights.
    #[error("weight sync to {to} would go back from {current}: versions only grow")]
    VersionBackwards {
        current: WeightVersion,
        to: WeightVersion,
    },
    /// The model's next-token logits held NaN or infinities: its weights do, or the dtype
    /// overflowed.
    #[error(
        "prompt {prompt}, response token {position}: the model's logits are not finite (NaN or \
         infinity): its weights hold NaN or infinite values, or the dtype overflowed"
    )]
    NonFiniteLogits { prompt: usize, position: usize },
    /// A rollout server that could not be reached or answered with an error.
    #[error("{url}: {message}")]
    Remote { url: String, message: String },
    #[error(transparent)]
    Model(#[from] oxrl_models::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// The images of each prompt of a [`Engine::generate_with_images`] call, in the order their
/// (already expanded) image tokens appear.
pub type PromptImages = [Vec<PromptImage>];

/// A generation backend.
pub trait Engine {
    /// The version of the weights the next `generate` samples from.
    fn weight_version(&self) -> WeightVersion;

    /// Makes the engine sample from `policy`'s current weights, as `version`, before the next
    /// `generate` returns anything. `version` must not be older than the engine's. A remote
    /// engine reads the policy's named tensors (`named_parameters`) or a checkpoint it saves
    /// (`save_with`); one that shares the trainer's storage reads nothing.
    fn sync_weights(&mut self, policy: &dyn PolicyModel, version: WeightVersion) -> Result<()>;

    /// `params.n` completions for each prompt, as `result[prompt][sample]`; `images[i]` are
    /// prompt `i`'s images (vision-language models), or `images` is empty for text prompts.
    fn generate_with_images(
        &mut self,
        prompts: &[Vec<u32>],
        images: &PromptImages,
        params: &SamplingParams,
    ) -> Result<Vec<Vec<Completion>>>;

    /// Measurements of the engine's own since the last call (per-server latency and errors of
    /// a remote engine), as metrics keys; none by default.
    fn take_metrics(&mut self) -> std::collections::BTreeMap<String, f64> {
        Default::default()
    }

    /// [`Engine::generate_with_images`] for text prompts.
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
    ) -> Result<Vec<Vec<Completion>>> {
        self.generate_with_images(prompts, &[], params)
    }
}
