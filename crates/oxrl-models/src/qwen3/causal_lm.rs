//! `Qwen3ForCausalLM` (and `Qwen3VLForConditionalGeneration`, the same decoder under a vision
//! tower): the decoder body, the LM head and the checkpoint's configuration.

use super::config::{text_prefix, ModelConfig};
use super::kv_cache::CacheKind;
use super::lora::LoraState;
use super::model::Qwen3Model;
use super::visual::{Vision, VisualInjection, NOT_PROMPT};
use crate::checkpoint::load_tensors;
use crate::config::Qwen3Config;
use crate::error::{ModelError, Result};
use crate::image::{ImageProcessorConfig, ProcessedImage};
use crate::ops::linear;
use crate::vision::VisionTower;
use crate::weights::take;
use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The LM head's checkpoint name; absent when it is tied to the embedding.
pub(crate) const LM_HEAD: &str = "lm_head.weight";

/// Where the decoder body's weights sit once a Qwen3-VL checkpoint's `model.language_model.`
/// prefix is folded onto the text model's.
pub(crate) const BODY: &str = "model.";

/// The causal LM: the body, the LM head, and for Qwen3-VL the vision half. One type for both
/// so the trainer, the engine, checkpoints and `make_trainable` serve text and images alike.
pub struct Qwen3 {
    /// The text decoder's configuration (`text_config` of a Qwen3-VL checkpoint).
    pub config: Qwen3Config,
    /// The checkpoint's `config.json` as read, written back on save so no key is lost.
    pub config_json: Value,
    /// The decoder body (`model.*`, or `model.language_model.*` in Qwen3-VL).
    pub model: Qwen3Model,
    /// `lm_head.weight` when the checkpoint has it, otherwise the (tied) embedding.
    pub lm_head: Tensor,
    /// True when `lm_head` is the embedding matrix (no `lm_head.weight` in the checkpoint).
    pub tied: bool,
    /// The vision tower of a Qwen3-VL checkpoint; `None` for a text-only Qwen3.
    pub vision: Option<Vision>,
    pub dtype: DType,
    pub device: Device,
    /// Where the inference path's KV caches live ([`CacheKind::for_device`] unless set).
    pub kv_cache: CacheKind,
    /// Recompute each decoder layer in the backward instead of keeping its activations
    /// ([`super::checkpointing`]).
    pub gradient_checkpointing: bool,
    /// Most logit elements the training path holds at once: a batch with more response rows
    /// than this allows runs lm_head and the log-probs in chunks ([`super::chunked_head`]).
    pub logit_chunk_elements: usize,
    /// LoRA adapters on the decoder's projections, when the model has them ([`super::lora`]).
    pub lora: Option<LoraState>,
}

/// [`Qwen3::logit_chunk_elements`] unless set: 256 Mi elements (1 GiB of f32 logits; 1,766
/// response tokens at Qwen3's vocabulary). Chunks cost one more lm_head forward per row, so
/// batches below this keep their logits (W1's 512 rows: the update took 1.5–1.8× as long
/// chunked by 220 rows on 2 cores).
pub const LOGIT_CHUNK_ELEMENTS: usize = 1 << 28;

impl Qwen3 {
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config_json: Value = crate::config::read_json(&config_path)?;
        let tensors = load_tensors(dir, dtype, device)?;
        let mut model = Self::from_tensors(config_json, &config_path, tensors, dtype, device)?;
        if let Some(vision) = &mut model.vision {
            let pre = dir.join("preprocessor_config.json");
            if pre.exists() {
                vision.processor = ImageProcessorConfig::from_file(&pre)?;
            }
        }
        Ok(model)
    }

    /// Checkpoint prefix of the text decoder's weights.
    fn text_prefix(&self) -> &'static str {
        text_prefix(self.vision.is_some())
    }

    /// Builds the model `config_json` describes (read from `source`, named in errors) from
    /// tensors under their checkpoint names.
    pub fn from_tensors(
        config_json: Value,
        source: &Path,
        mut t: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let ModelConfig {
            text: config,
            vision,
        } = ModelConfig::from_value(&config_json, source)?;
        let vision = vision
            .map(|(vc, tokens)| -> Result<Vision> {
                Ok(Vision {
                    tower: VisionTower::from_tensors(vc, &mut t, dtype, device)?,
                    tokens,
                    processor: ImageProcessorConfig::default(),
                    frozen: false,
                })
            })
            .transpose()?;
        let prefix = text_prefix(vision.is_some());
        let mut t: HashMap<String, Tensor> = t
            .into_iter()
            .map(|(k, v)| match k.strip_prefix(prefix) {
                Some(rest) => (format!("{BODY}{rest}"), v),
                None => (k, v),
            })
            .collect();
        let model = Qwen3Model::load(&config, BODY, &mut t)?;
        let (lm_head, tied) = match t.contains_key(LM_HEAD) {
            true => (
                take(&mut t, LM_HEAD, &[config.vocab_size, config.hidden_size])?,
                false,
            ),
            false => (model.embed_tokens.clone(), true),
        };
        Ok(Self {
            config,
            config_json,
            model,
            lm_head,
            tied,
            vision,
            dtype,
            device: device.clone(),
            kv_cache: CacheKind::for_device(device),
            gradient_checkpointing: false,
            logit_chunk_elements: LOGIT_CHUNK_ELEMENTS,
            lora: None,
        })
    }

    /// Every distinct weight under its checkpoint name (cheap handle clones); a tied `lm_head`
    /// is not listed, as transformers leaves it out of the safetensors files.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        if let Some(v) = &self.vision {
            out.extend(v.tower.named_parameters());
        }
        self.model
            .push_named(&self.config, self.text_prefix(), &mut out);
        if !self.tied {
            out.push((LM_HEAD.to_string(), self.lm_head.clone()));
        }
        out
    }

    /// Turns every weight into a candle `Var` so a backward pass reaches it (a tied `lm_head`
    /// shares the embedding's var; a frozen vision tower stays constant); returns the vars by
    /// checkpoint name.
    pub fn make_trainable(&mut self) -> Result<Vec<(String, Var)>> {
        if self.lora.is_some() {
            return self.make_adapters_trainable();
        }
        let frozen = self.vision.as_ref().is_some_and(|v| v.frozen);
        let mut vars = Vec::new();
        let mut tensors = HashMap::new();
        for (name, t) in self.named_parameters() {
            if frozen && name.starts_with(crate::vision::VISION_PREFIX) {
                tensors.insert(name, t);
                continue;
            }
            let var = Var::from_tensor(&t)?;
            tensors.insert(name.clone(), var.as_tensor().clone());
            vars.push((name, var));
        }
        let config_json = std::mem::take(&mut self.config_json);
        let settings = (
            self.kv_cache,
            self.gradient_checkpointing,
            self.logit_chunk_elements,
        );
        let processor = self
            .vision
            .as_ref()
            .map(|v| (v.processor.clone(), v.frozen));
        *self = Self::from_tensors(
            config_json,
            Path::new("<trainable copy>"),
            tensors,
            self.dtype,
            &self.device,
        )?;
        (
            self.kv_cache,
            self.gradient_checkpointing,
            self.logit_chunk_elements,
        ) = settings;
        if let (Some(v), Some((p, frozen))) = (&mut self.vision, processor) {
            v.processor = p;
            v.frozen = frozen;
        }
        Ok(vars)
    }

    /// Final-norm hidden states `[B, S, D]` for right-padded `input_ids` `[B, S]` under causal
    /// attention: a real token only sees earlier positions, so padding after it changes nothing.
    pub fn forward_hidden(&self, input_ids: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_hidden_with(input_ids, None, None)
    }

    /// [`Qwen3::forward_hidden`] with per-token `(T, H, W)` positions (`[B·S]`, row after row;
    /// default `0..S` on every axis) and the images of the batch written over its image tokens.
    pub(crate) fn forward_hidden_with(
        &self,
        input_ids: &Tensor,
        positions: Option<&[[u32; 3]]>,
        visual: Option<&VisualInjection>,
    ) -> candle_core::Result<Tensor> {
        self.model
            .forward(&self.config, input_ids, positions, visual)
    }

    /// Logits `[B, S, vocab]` for right-padded `input_ids` `[B, S]` (training path).
    pub fn forward(&self, input_ids: &Tensor) -> candle_core::Result<Tensor> {
        linear(&self.forward_hidden(input_ids)?, &self.lm_head)
    }

    /// Logits `[S, vocab]` of `prompt ++ continuation`, the prompt's image tokens taking
    /// `images` in order (the training path; Qwen3-VL, or a text model when `images` is empty).
    pub fn forward_with_images(
        &self,
        prompt: &[u32],
        continuation: &[u32],
        images: &[Arc<ProcessedImage>],
    ) -> Result<Tensor> {
        let ids: Vec<u32> = prompt.iter().chain(continuation).copied().collect();
        self.validate_ids(&ids, "input")?;
        self.validate_images(prompt, images, "prompt")?;
        let input = Tensor::from_slice(&ids, (1, ids.len()), &self.device)?;
        let hidden = match (&self.vision, images.is_empty()) {
            (Some(v), false) => {
                let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
                let positions = v
                    .tokens
                    .sequence_positions(prompt, continuation.len(), &grids)?;
                let imgs: Vec<&ProcessedImage> = images.iter().map(|i| &**i).collect();
                let mut locate = prompt.to_vec();
                locate.resize(ids.len(), NOT_PROMPT);
                let visual = VisualInjection::new(v, &locate, &imgs, &self.device, false)?;
                self.forward_hidden_with(&input, Some(&positions), Some(&visual))?
            }
            _ => self.forward_hidden(&input)?,
        };
        Ok(linear(&hidden.squeeze(0)?, &self.lm_head)?)
    }

    /// Checks that every id is inside the vocabulary.
    pub fn validate_vocab(&self, ids: &[u32], what: &str) -> Result<()> {
        let vocab = self.config.vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(ModelError::InvalidInput(format!(
                "{what}: token id {bad} is outside the vocabulary (size {vocab})"
            ))),
            None => Ok(()),
        }
    }

    /// Checks that every id is inside the vocabulary and the sequence fits the model's positions.
    pub fn validate_ids(&self, ids: &[u32], what: &str) -> Result<()> {
        self.validate_vocab(ids, what)?;
        let max = self.config.max_position_embeddings;
        if ids.len() > max {
            return Err(ModelError::InvalidInput(format!(
                "{what}: {} tokens exceed the model's {max} positions (max_position_embeddings)",
                ids.len()
            )));
        }
        Ok(())
    }

    /// Checks that `images` can be placed at the image tokens of `ids`: the model has a vision
    /// tower, and the image tokens come in runs of each image's token count.
    pub fn validate_images(
        &self,
        ids: &[u32],
        images: &[Arc<ProcessedImage>],
        what: &str,
    ) -> Result<()> {
        let context = |e: ModelError| ModelError::Input {
            what: what.to_string(),
            source: Box::new(e),
        };
        match &self.vision {
            None if images.is_empty() => Ok(()),
            None => Err(ModelError::InvalidInput(format!(
                "{what}: the input has images, but the model has no vision tower (not a Qwen3-VL checkpoint)"
            ))),
            Some(v) => {
                let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
                v.tokens.rope_index(ids, &grids).map(|_| ()).map_err(context)
            }
        }
    }
}
