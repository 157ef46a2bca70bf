//! The Qwen3 family behind the crate's model traits: every method delegates to the inherent
//! one, so the concrete types and the trait objects give the same numbers.

use super::reward_model::{Qwen3RewardModel, ARCHITECTURE};
use super::{BatchLogprobs, Entropy, ImagePrompting, KvCache, LogprobsAndEntropy, Qwen3};
use super::{LoraConfig, ScoreRequest, VocabSlices};
use crate::error::Result;
use crate::image::{ImageSource, ProcessedImage};
use crate::model_traits::{PolicyModel, SequenceClassifier};
use candle_core::{Device, Tensor, Var};
use std::path::Path;
use std::sync::Arc;

impl PolicyModel for Qwen3 {
    fn architecture(&self) -> &'static str {
        super::architecture(self.vision.is_some())
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn validate_ids(&self, ids: &[u32], what: &str) -> Result<()> {
        Qwen3::validate_ids(self, ids, what)
    }

    fn validate_images(
        &self,
        ids: &[u32],
        images: &[Arc<ProcessedImage>],
        what: &str,
    ) -> Result<()> {
        Qwen3::validate_images(self, ids, images, what)
    }

    fn image_prompting(&self) -> Option<ImagePrompting> {
        Qwen3::image_prompting(self)
    }

    fn prepare_images(&self, sources: &[ImageSource]) -> Result<Vec<Arc<ProcessedImage>>> {
        Qwen3::prepare_images(self, sources)
    }

    fn expand_image_pads(&self, ids: &[u32], images: &[Arc<ProcessedImage>]) -> Result<Vec<u32>> {
        Qwen3::expand_image_pads(self, ids, images)
    }

    fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    fn set_vision_frozen(&mut self, frozen: bool) {
        if let Some(v) = &mut self.vision {
            v.frozen = frozen;
        }
    }

    fn response_logprobs(&self, batch: &[ScoreRequest], entropy: Entropy) -> Result<BatchLogprobs> {
        Qwen3::response_logprobs(self, batch, entropy)
    }

    fn score_batch(&self, requests: &[ScoreRequest]) -> Result<Vec<Vec<f32>>> {
        Qwen3::score_batch(self, requests)
    }

    fn score_batch_with_entropy(&self, requests: &[ScoreRequest]) -> Result<LogprobsAndEntropy> {
        Qwen3::score_batch_with_entropy(self, requests)
    }

    fn make_trainable(&mut self) -> Result<Vec<(String, Var)>> {
        Qwen3::make_trainable(self)
    }

    fn attach_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()> {
        Qwen3::attach_lora(self, config, seed)
    }

    fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        Qwen3::load_adapter(self, dir)
    }

    fn lora(&self) -> Option<LoraConfig> {
        Qwen3::lora(self).cloned()
    }

    fn set_adapters_enabled(&self, on: bool) {
        Qwen3::set_adapters_enabled(self, on)
    }

    fn write_adapter(&self, dir: &Path, base_model: &str) -> Result<()> {
        Qwen3::write_adapter(self, dir, base_model)
    }

    fn merge_adapters(&mut self) -> Result<()> {
        Qwen3::merge_adapters(self)
    }

    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Qwen3::merged_parameters(self)
    }

    fn detached(&self) -> Box<dyn PolicyModel> {
        Box::new(Qwen3::detached(self))
    }

    fn save_with(
        &self,
        out: &Path,
        copy_from: Option<&Path>,
        max_shard_bytes: usize,
        extra: &dyn Fn(&Path) -> Result<()>,
    ) -> Result<()> {
        Qwen3::save_with(self, out, copy_from, max_shard_bytes, extra)
    }

    fn new_cache(&self) -> KvCache {
        Qwen3::new_cache(self)
    }

    fn forward_cached_with(
        &self,
        chunks: &[&[u32]],
        images: &[&[Arc<ProcessedImage>]],
        caches: &mut [&mut KvCache],
    ) -> Result<VocabSlices> {
        Qwen3::forward_cached_with(self, chunks, images, caches)
    }

    fn forward_cached(
        &self,
        chunks: &[&[u32]],
        caches: &mut [&mut KvCache],
    ) -> Result<VocabSlices> {
        Qwen3::forward_cached(self, chunks, caches)
    }
}

impl SequenceClassifier for Qwen3RewardModel {
    fn architecture(&self) -> &'static str {
        ARCHITECTURE
    }

    fn num_labels(&self) -> usize {
        self.num_labels
    }

    fn score_batch(&self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        Qwen3RewardModel::score_batch(self, sequences)
    }
}
