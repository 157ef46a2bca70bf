//! What the rest of oxrl needs from a model, as object-safe traits: the trainer, the rollout
//! engine and the binary hold a `Box<dyn PolicyModel>` (or an `Arc` of one), the reward-model
//! reward a `Box<dyn SequenceClassifier>`, so a new architecture plugs in through
//! [`crate::registry`] without touching them.

use crate::error::Result;
use crate::image::{ImageSource, ProcessedImage};
use crate::qwen3::{BatchLogprobs, Entropy, ImagePrompting, LogprobsAndEntropy, ScoreRequest};
use crate::qwen3::{KvCache, LoraConfig, VocabSlices};
use candle_core::{Device, Tensor, Var};
use std::path::Path;
use std::sync::Arc;

/// A causal language model oxrl can sample from and train: both paths over one set of weights.
pub trait PolicyModel: Send + Sync {
    /// The checkpoint's `architectures` entry this model is.
    fn architecture(&self) -> &'static str;

    fn device(&self) -> &Device;

    fn vocab_size(&self) -> usize;

    /// The longest sequence the model takes (`max_position_embeddings`).
    fn max_positions(&self) -> usize;

    // Input checks, so bad ids or images are clear errors before any forward.

    /// Every id inside the vocabulary and the sequence within [`PolicyModel::max_positions`];
    /// `what` names the input in the error.
    fn validate_ids(&self, ids: &[u32], what: &str) -> Result<()>;

    /// `images` can be placed at the image tokens of `ids` (and the model takes images at all).
    fn validate_images(
        &self,
        ids: &[u32],
        images: &[Arc<ProcessedImage>],
        what: &str,
    ) -> Result<()>;

    // Images (Qwen3-VL); a text-only model has no prompting and refuses images.

    /// How prompts take images, readable without the weights; `None` for a text-only model.
    fn image_prompting(&self) -> Option<ImagePrompting>;

    /// Loads and processes `sources` with the checkpoint's image processor.
    fn prepare_images(&self, sources: &[ImageSource]) -> Result<Vec<Arc<ProcessedImage>>>;

    /// Prompt ids with each image's single pad expanded to its token count.
    fn expand_image_pads(&self, ids: &[u32], images: &[Arc<ProcessedImage>]) -> Result<Vec<u32>>;

    /// Keep the vision tower (if any) out of [`PolicyModel::make_trainable`].
    fn set_vision_frozen(&mut self, frozen: bool);

    /// Recompute each decoder layer in the backward instead of keeping its activations
    /// (`[trainer] gradient_checkpointing`); [`BatchLogprobs::backward`] then runs the layers'
    /// part of the backward.
    fn set_gradient_checkpointing(&mut self, on: bool);

    // The training path.

    /// Response log-probs (and entropies as `entropy` asks) of a batch as differentiable
    /// tensors: what the policy loss is built from.
    fn response_logprobs(&self, batch: &[ScoreRequest], entropy: Entropy) -> Result<BatchLogprobs>;

    /// Per-token response log-probs without gradient (call it on [`PolicyModel::detached`]).
    fn score_batch(&self, requests: &[ScoreRequest]) -> Result<Vec<Vec<f32>>>;

    /// [`PolicyModel::score_batch`] plus per-token entropies from the same pass.
    fn score_batch_with_entropy(&self, requests: &[ScoreRequest]) -> Result<LogprobsAndEntropy>;

    /// Turns the weights into `Var`s a backward pass reaches; returns them by checkpoint name
    /// (the optimizer's parameters, in order).
    fn make_trainable(&mut self) -> Result<Vec<(String, Var)>>;

    /// Every distinct weight under its checkpoint name, LoRA adapters merged in (what a
    /// rollout server loads).
    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>>;

    // LoRA adapters (PEFT's format; `crate::qwen3::lora`).

    /// Adds fresh adapters (`B` zero) as `config` says, `A` drawn from `seed`.
    fn attach_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()>;

    /// Applies the PEFT LoRA adapter in `dir` to this base model.
    fn load_adapter(&mut self, dir: &Path) -> Result<()>;

    /// The adapters' configuration, when the model has adapters.
    fn lora(&self) -> Option<LoraConfig>;

    /// Switches this handle's adapters on or off (off: the base model, from the same weights).
    fn set_adapters_enabled(&self, on: bool);

    /// Writes the adapters in PEFT's format into the existing directory `dir`.
    fn write_adapter(&self, dir: &Path, base_model: &str) -> Result<()>;

    /// Folds the adapters into the weights: a plain model that scores as the adapted one.
    fn merge_adapters(&mut self) -> Result<()>;

    /// The same weights (shared storage) without autograd tracking: the engine's view, which an
    /// optimizer's in-place `Var::set` updates too.
    fn detached(&self) -> Box<dyn PolicyModel>;

    /// Writes a Hugging Face checkpoint directory atomically, copying tokenizer and generation
    /// files from `copy_from`, with `extra` writing more files before it becomes visible.
    fn save_with(
        &self,
        out: &Path,
        copy_from: Option<&Path>,
        max_shard_bytes: usize,
        extra: &dyn Fn(&Path) -> Result<()>,
    ) -> Result<()>;

    // The inference path.

    /// An empty KV cache for one sequence.
    fn new_cache(&self) -> KvCache;

    /// Feeds `chunks[i]` (with `images[i]` for a prompt) as the next tokens of the sequence
    /// cached in `caches[i]`; returns each chunk's last-token logits.
    fn forward_cached_with(
        &self,
        chunks: &[&[u32]],
        images: &[&[Arc<ProcessedImage>]],
        caches: &mut [&mut KvCache],
    ) -> Result<VocabSlices>;

    /// [`PolicyModel::forward_cached_with`] without images (decode steps, text prompts).
    fn forward_cached(&self, chunks: &[&[u32]], caches: &mut [&mut KvCache])
        -> Result<VocabSlices>;
}

/// A model that scores whole sequences (`*ForSequenceClassification`): a reward model.
pub trait SequenceClassifier: Send + Sync {
    /// The checkpoint's `architectures` entry this model is.
    fn architecture(&self) -> &'static str;

    /// Scores per sequence.
    fn num_labels(&self) -> usize;

    /// `[num_labels]` scores of each sequence, without gradient.
    fn score_batch(&self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<f32>>>;
}
