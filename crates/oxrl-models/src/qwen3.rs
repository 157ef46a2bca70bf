//! Qwen3 decoder (`Qwen3ForCausalLM`), per qwen3-vl-spec §1, and Qwen3-VL
//! (`Qwen3VLForConditionalGeneration`, §2): the same decoder with interleaved MRoPE, image
//! embeddings written over the `<|image_pad|>` tokens and DeepStack features added after the
//! first text layers, fed by the vision tower in [`crate::vision`].
//!
//! Two paths over the same weights give the same numbers:
//! - the training path here ([`Qwen3::forward`], [`Qwen3::score_batch`]) is built only from candle
//!   primitives that carry a backward (no candle-nn fused rms_norm / rope / softmax_last_dim, which
//!   silently drop gradients), on right-padded batches;
//! - the inference path in [`crate::kv_cache`] decodes many sequences of different lengths at once
//!   with a per-sequence KV cache.

use crate::checkpoint::load_tensors;
use crate::config::Qwen3Config;
use crate::error::{ModelError, Result};
use crate::image::{ImageProcessorConfig, ProcessedImage};
use crate::mrope::VisionTokens;
use crate::vision::{VisionConfig, VisionTower};
use candle_core::{DType, Device, Tensor, Var, D};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub struct Layer {
    pub input_layernorm: Tensor,
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    pub post_attention_layernorm: Tensor,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

impl Layer {
    /// The layer's weights under their checkpoint names relative to `model.layers.{i}.`, in
    /// transformers' `named_parameters()` order (attention, MLP, then the two norms).
    fn named(&self) -> [(&'static str, &Tensor); 11] {
        [
            ("self_attn.q_proj.weight", &self.q_proj),
            ("self_attn.k_proj.weight", &self.k_proj),
            ("self_attn.v_proj.weight", &self.v_proj),
            ("self_attn.o_proj.weight", &self.o_proj),
            ("self_attn.q_norm.weight", &self.q_norm),
            ("self_attn.k_norm.weight", &self.k_norm),
            ("mlp.gate_proj.weight", &self.gate_proj),
            ("mlp.up_proj.weight", &self.up_proj),
            ("mlp.down_proj.weight", &self.down_proj),
            ("input_layernorm.weight", &self.input_layernorm),
            (
                "post_attention_layernorm.weight",
                &self.post_attention_layernorm,
            ),
        ]
    }
}

/// The vision half of a Qwen3-VL checkpoint: the tower, the token ids it fills, and the image
/// processor settings its images are prepared with.
pub struct Vision {
    pub tower: VisionTower,
    pub tokens: VisionTokens,
    pub processor: ImageProcessorConfig,
    /// Leave the tower's weights out of [`Qwen3::make_trainable`] (`[model] freeze_vision`).
    pub frozen: bool,
}

pub struct Qwen3 {
    /// The text decoder's configuration (`text_config` of a Qwen3-VL checkpoint).
    pub config: Qwen3Config,
    /// The checkpoint's `config.json` as read, written back on save so no key is lost.
    pub config_json: Value,
    pub embed_tokens: Tensor,
    pub layers: Vec<Layer>,
    pub norm: Tensor,
    /// `lm_head.weight` when the checkpoint has it, otherwise the (tied) embedding.
    pub lm_head: Tensor,
    /// True when `lm_head` is the embedding matrix (no `lm_head.weight` in the checkpoint).
    pub tied: bool,
    /// The vision tower of a Qwen3-VL checkpoint; `None` for a text-only Qwen3.
    pub vision: Option<Vision>,
    pub dtype: DType,
    pub device: Device,
}

/// How a checkpoint's `config.json` describes the model: the text decoder and, for Qwen3-VL,
/// the vision tower and its token ids.
fn parse_config(
    v: &Value,
    path: &Path,
) -> Result<(Qwen3Config, Option<(VisionConfig, VisionTokens)>)> {
    let Some(vision) = v.get("vision_config") else {
        return Ok((Qwen3Config::from_value(v, path)?, None));
    };
    let text = v.get("text_config").ok_or_else(|| ModelError::ConfigKey {
        path: path.to_path_buf(),
        key: "text_config".into(),
        expected:
            "the text decoder's settings (a Qwen3-VL config has both text_config and vision_config)"
                .into(),
    })?;
    let mut config = Qwen3Config::from_value(text, path)?;
    if config.mrope_section.is_none() {
        config.mrope_section = Some([24, 20, 20]);
    }
    // transformers 5 ties from the top-level flag (4.x read text_config's).
    config.tie_word_embeddings = v
        .get("tie_word_embeddings")
        .or_else(|| text.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    config.stored_dtype = v
        .get("dtype")
        .or_else(|| v.get("torch_dtype"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .or(config.stored_dtype);
    let vision = VisionConfig::from_value(vision, path)?;
    let id = |key: &str, default: u32| -> Result<u32> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_u64()
                .filter(|&n| n <= u32::MAX as u64)
                .map(|n| n as u32)
                .ok_or_else(|| ModelError::ConfigKey {
                    path: path.to_path_buf(),
                    key: key.into(),
                    expected: "a token id".into(),
                }),
        }
    };
    let tokens = VisionTokens {
        image_token_id: id("image_token_id", 151_655)?,
        video_token_id: id("video_token_id", 151_656)?,
        vision_start_token_id: id("vision_start_token_id", 151_652)?,
        vision_end_token_id: id("vision_end_token_id", 151_653)?,
        merge_size: vision.spatial_merge_size,
    };
    if vision.out_hidden_size != config.hidden_size {
        return Err(ModelError::ConfigKey {
            path: path.to_path_buf(),
            key: "vision_config.out_hidden_size".into(),
            expected: format!("the text hidden size {}", config.hidden_size),
        });
    }
    Ok((config, Some((vision, tokens))))
}

/// What turning images into prompt input takes — the image processor and the vision token
/// ids — without the weights, so datasets can be prepared (and rejected) before a model loads.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePrompting {
    pub tokens: VisionTokens,
    pub processor: ImageProcessorConfig,
}

impl ImagePrompting {
    /// Reads `config.json` and `preprocessor_config.json` of a checkpoint directory; `None`
    /// when it is a text-only model.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("config.json");
        let v: Value = crate::config::read_json(&path)?;
        let Some((_, tokens)) = parse_config(&v, &path)?.1 else {
            return Ok(None);
        };
        let pre = dir.join("preprocessor_config.json");
        let processor = match pre.exists() {
            true => ImageProcessorConfig::from_file(&pre)?,
            false => ImageProcessorConfig::default(),
        };
        Ok(Some(Self { tokens, processor }))
    }

    /// Loads and processes `sources`; an error when there are images but no way to take them.
    pub fn prepare_with(
        this: Option<&Self>,
        sources: &[crate::image::ImageSource],
    ) -> Result<Vec<Arc<ProcessedImage>>> {
        if sources.is_empty() {
            return Ok(Vec::new());
        }
        let this = this.ok_or_else(|| {
            ModelError::InvalidInput(
                "the input has images, but the model has no vision tower (not a Qwen3-VL checkpoint)"
                    .into(),
            )
        })?;
        sources
            .iter()
            .map(|s| {
                let img = s.load()?;
                crate::image::process(&img, &this.processor)
                    .map(Arc::new)
                    .map_err(|e| ModelError::InvalidInput(format!("{}: {e}", s.describe())))
            })
            .collect()
    }

    /// Expands each image's single pad in `ids` (see [`VisionTokens::expand_image_pads`]).
    pub fn expand(&self, ids: &[u32], images: &[Arc<ProcessedImage>]) -> Result<Vec<u32>> {
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        self.tokens.expand_image_pads(ids, &grids)
    }
}

/// Checkpoint prefix of the text decoder's weights: `model.language_model.` in Qwen3-VL.
fn text_prefix(vl: bool) -> &'static str {
    if vl {
        "model.language_model."
    } else {
        "model."
    }
}

/// Stands in [`VisualInjection::new`]'s ids for a token outside any prompt.
pub(crate) const NOT_PROMPT: u32 = u32::MAX;

/// The visual part of a batch's forward: where the image tokens sit in the flattened
/// `[B·S]` rows, the merged image embeddings written there, and the DeepStack features added
/// there after the first text layers.
pub(crate) struct VisualInjection {
    /// Flat row index of every image token, in image order.
    pub index: Tensor,
    /// `[B·S, 1]`: 0 at image tokens, 1 elsewhere (the text embedding is replaced, not summed).
    pub keep: Tensor,
    pub embeds: Tensor,
    pub deepstack: Vec<Tensor>,
}

impl VisualInjection {
    /// Runs the vision tower over `images` (in prompt order) and places the result at the image
    /// tokens of the flattened ids. Only prompt tokens carry images: callers set every other
    /// position of `flat_ids` to [`NOT_PROMPT`], so a generated image pad stays text.
    pub(crate) fn new(
        vision: &Vision,
        flat_ids: &[u32],
        images: &[&ProcessedImage],
        device: &Device,
    ) -> Result<Self> {
        // The n samples of a GRPO group share their prompt's images (one `Arc`): the tower runs
        // once per distinct image and its rows are gathered per use (the gather's backward
        // sums the uses' gradients, as separate forwards would).
        let mut distinct: Vec<&ProcessedImage> = Vec::new();
        let mut which = Vec::with_capacity(images.len());
        for &img in images {
            match distinct.iter().position(|d| std::ptr::eq(*d, img)) {
                Some(k) => which.push(k),
                None => {
                    which.push(distinct.len());
                    distinct.push(img);
                }
            }
        }
        let grids: Vec<[usize; 3]> = distinct.iter().map(|i| i.grid_thw).collect();
        let rows: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
        let dim = vision.tower.config.patch_dim();
        let mut pixels = Vec::with_capacity(rows * dim);
        for img in &distinct {
            pixels.extend_from_slice(&img.pixel_values);
        }
        if pixels.len() != rows * dim {
            return Err(ModelError::InvalidInput(format!(
                "image pixel values hold {} numbers; their grids {grids:?} need {}",
                pixels.len(),
                rows * dim
            )));
        }
        let mut out = vision
            .tower
            .forward(&Tensor::from_vec(pixels, (rows, dim), device)?, &grids)?;
        if distinct.len() < images.len() {
            let merged = |g: &[usize; 3]| vision.tokens.tokens_of(*g);
            let starts: Vec<usize> = grids
                .iter()
                .scan(0, |at, g| {
                    let s = *at;
                    *at += merged(g);
                    Some(s)
                })
                .collect();
            let gather: Vec<u32> = which
                .iter()
                .flat_map(|&k| (starts[k]..starts[k] + merged(&grids[k])).map(|r| r as u32))
                .collect();
            let n = gather.len();
            let gather = Tensor::from_vec(gather, n, device)?;
            out.embeds = out.embeds.index_select(&gather, 0)?;
            for f in &mut out.deepstack {
                *f = f.index_select(&gather, 0)?;
            }
        }
        let image_token = vision.tokens.image_token_id;
        let index: Vec<u32> = (0..flat_ids.len() as u32)
            .filter(|&i| flat_ids[i as usize] == image_token)
            .collect();
        if index.len() != out.embeds.dim(0)? {
            return Err(ModelError::InvalidInput(format!(
                "the batch has {} image tokens but its images give {} embeddings",
                index.len(),
                out.embeds.dim(0)?
            )));
        }
        let keep: Vec<f32> = flat_ids
            .iter()
            .map(|&t| if t == image_token { 0.0 } else { 1.0 })
            .collect();
        let n = index.len();
        Ok(Self {
            index: Tensor::from_vec(index, n, device)?,
            keep: Tensor::from_vec(keep, (flat_ids.len(), 1), device)?,
            embeds: out.embeds,
            deepstack: out.deepstack,
        })
    }

    /// `x` `[B·S, D]` with the image embeddings in place of the image tokens' embeddings.
    pub(crate) fn write_embeds(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.broadcast_mul(&self.keep.to_dtype(x.dtype())?)?.index_add(
            &self.index,
            &self.embeds.to_dtype(x.dtype())?,
            0,
        )
    }

    /// `x` `[B·S, D]` plus DeepStack feature `layer` at the image tokens (after text layer
    /// `layer`; nothing past the last feature).
    pub(crate) fn add_deepstack(&self, x: &Tensor, layer: usize) -> candle_core::Result<Tensor> {
        match self.deepstack.get(layer) {
            Some(f) => x.index_add(&self.index, &f.to_dtype(x.dtype())?, 0),
            None => Ok(x.clone()),
        }
    }
}

fn take(map: &mut HashMap<String, Tensor>, name: &str, shape: &[usize]) -> Result<Tensor> {
    let t = map
        .remove(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    if t.dims() != shape {
        return Err(ModelError::TensorShape {
            name: name.to_string(),
            got: t.dims().to_vec(),
            expected: shape.to_vec(),
        });
    }
    Ok(t)
}

/// `weight * (x / sqrt(mean(x²) + eps))`, statistics in f32, cast back before the weight multiply.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&inv)?
        .to_dtype(dtype)?
        .broadcast_mul(weight)
}

/// Half-split (NeoX) rotary embedding: `x*cos + rotate_half(x)*sin`.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// `x · wᵀ` for `x` of any rank.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.broadcast_matmul(&w.t()?)
}

/// One sequence to score: `log p(response[i] | prompt ++ response[..i])` at a temperature.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreRequest {
    /// Prompt ids, each image already expanded to its run of image tokens.
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    pub temperature: f64,
    /// The prompt's images, in the order their tokens appear (Qwen3-VL only).
    pub images: Vec<Arc<ProcessedImage>>,
}

impl ScoreRequest {
    /// A text-only request.
    pub fn text(prompt_ids: Vec<u32>, response_ids: Vec<u32>, temperature: f64) -> Self {
        Self {
            prompt_ids,
            response_ids,
            temperature,
            images: Vec::new(),
        }
    }
}

/// Response log-probs of a batch: `[R]` f32 over every response token, request after request.
pub struct BatchLogprobs {
    pub logprobs: Tensor,
    /// Per-token entropy `[R]`, when asked for.
    pub entropy: Option<Tensor>,
    /// Response length of each request.
    pub lens: Vec<usize>,
}

/// Per request: response log-probs, and entropies (empty when not asked for).
pub type LogprobsAndEntropy = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Which per-token entropies [`Qwen3::response_logprobs`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entropy {
    None,
    /// Values only (a metric): one extra fused pass, no gradient.
    Value,
    /// With a gradient (an entropy bonus in the loss): the slower differentiable path.
    Differentiable,
}

/// Padded tokens (batch × longest sequence) per training-path forward while scoring.
const SCORE_BATCH_TOKENS: usize = 8192;

/// Logit elements materialised at once while scoring without gradient (512 MB in f32).
const SCORE_LOGIT_ELEMENTS: usize = 1 << 27;

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
        let (config, vision) = parse_config(&config_json, source)?;
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
                Some(rest) => (format!("model.{rest}"), v),
                None => (k, v),
            })
            .collect();
        let c = &config;
        let (d, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (h, kv) = (c.num_attention_heads, c.num_key_value_heads);
        let embed_tokens = take(&mut t, "model.embed_tokens.weight", &[c.vocab_size, d])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let mut w = |name: &str, shape: &[usize]| {
                take(&mut t, &format!("model.layers.{l}.{name}"), shape)
            };
            layers.push(Layer {
                input_layernorm: w("input_layernorm.weight", &[d])?,
                q_proj: w("self_attn.q_proj.weight", &[h * hd, d])?,
                k_proj: w("self_attn.k_proj.weight", &[kv * hd, d])?,
                v_proj: w("self_attn.v_proj.weight", &[kv * hd, d])?,
                o_proj: w("self_attn.o_proj.weight", &[d, h * hd])?,
                q_norm: w("self_attn.q_norm.weight", &[hd])?,
                k_norm: w("self_attn.k_norm.weight", &[hd])?,
                post_attention_layernorm: w("post_attention_layernorm.weight", &[d])?,
                gate_proj: w("mlp.gate_proj.weight", &[i, d])?,
                up_proj: w("mlp.up_proj.weight", &[i, d])?,
                down_proj: w("mlp.down_proj.weight", &[d, i])?,
            });
        }
        let norm = take(&mut t, "model.norm.weight", &[d])?;
        let (lm_head, tied) = match t.contains_key("lm_head.weight") {
            true => (take(&mut t, "lm_head.weight", &[c.vocab_size, d])?, false),
            false => (embed_tokens.clone(), true),
        };
        Ok(Self {
            config,
            config_json,
            embed_tokens,
            layers,
            norm,
            lm_head,
            tied,
            vision,
            dtype,
            device: device.clone(),
        })
    }

    /// Every distinct weight under its checkpoint name (cheap handle clones); a tied `lm_head`
    /// is not listed, as transformers leaves it out of the safetensors files.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let p = self.text_prefix();
        let mut out = Vec::new();
        if let Some(v) = &self.vision {
            out.extend(v.tower.named_parameters());
        }
        out.push((format!("{p}embed_tokens.weight"), self.embed_tokens.clone()));
        for (l, layer) in self.layers.iter().enumerate() {
            for (name, t) in layer.named() {
                out.push((format!("{p}layers.{l}.{name}"), t.clone()));
            }
        }
        out.push((format!("{p}norm.weight"), self.norm.clone()));
        if !self.tied {
            out.push(("lm_head.weight".to_string(), self.lm_head.clone()));
        }
        out
    }

    /// Turns every weight into a candle `Var` so a backward pass reaches it (a tied `lm_head`
    /// shares the embedding's var; a frozen vision tower stays constant); returns the vars by
    /// checkpoint name.
    pub fn make_trainable(&mut self) -> Result<Vec<(String, Var)>> {
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
        if let (Some(v), Some((p, frozen))) = (&mut self.vision, processor) {
            v.processor = p;
            v.frozen = frozen;
        }
        Ok(vars)
    }

    /// cos/sin tables `[positions.len(), hd]` for `(T, H, W)` positions, computed in f32 then
    /// cast to the model dtype. Plain RoPE reads the T row; interleaved MRoPE takes frequency
    /// `i` from H when `i % 3 == 1` and `i < 3·section[1]`, from W when `i % 3 == 2` and
    /// `i < 3·section[2]`, else from T (so equal rows give plain RoPE).
    pub(crate) fn rope_tables(
        &self,
        positions: &[[u32; 3]],
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let hd = self.config.head_dim;
        let theta = self.config.rope_theta as f32;
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let axis: Vec<usize> = (0..hd / 2)
            .map(|i| match self.config.mrope_section {
                Some([_, h, _]) if i % 3 == 1 && i < 3 * h => 1,
                Some([_, _, w]) if i % 3 == 2 && i < 3 * w => 2,
                _ => 0,
            })
            .collect();
        let mut emb = Vec::with_capacity(positions.len() * hd);
        for p in positions {
            let freqs = inv_freq.iter().zip(&axis).map(|(f, &a)| p[a] as f32 * f);
            emb.extend(freqs.clone());
            emb.extend(freqs);
        }
        let emb = Tensor::from_vec(emb, (positions.len(), hd), &self.device)?;
        Ok((
            emb.cos()?.to_dtype(self.dtype)?,
            emb.sin()?.to_dtype(self.dtype)?,
        ))
    }

    /// Q, K (normed and rotated) and V of one layer for rows `xn [.., S, D]` → `[.., S, heads, hd]`.
    pub(crate) fn qkv(
        &self,
        layer: &Layer,
        xn: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let mut shape = xn.dims().to_vec();
        shape.pop();
        let split = |t: Tensor, heads: usize| {
            let mut s = shape.clone();
            s.extend([heads, hd]);
            t.reshape(s)
        };
        let q = split(linear(xn, &layer.q_proj)?, h)?;
        let k = split(linear(xn, &layer.k_proj)?, kv)?;
        let v = split(linear(xn, &layer.v_proj)?, kv)?;
        // cos/sin are [S, hd]; heads sit between S and hd.
        let (cos, sin) = (cos.unsqueeze(D::Minus2)?, sin.unsqueeze(D::Minus2)?);
        let q = rope(&rms_norm(&q, &layer.q_norm, c.rms_norm_eps)?, &cos, &sin)?;
        let k = rope(&rms_norm(&k, &layer.k_norm, c.rms_norm_eps)?, &cos, &sin)?;
        Ok((q, k, v))
    }

    /// The residual stream after the SwiGLU MLP block: `x + down(silu(gate(n(x))) * up(n(x)))`.
    pub(crate) fn mlp_block(&self, layer: &Layer, x: &Tensor) -> candle_core::Result<Tensor> {
        let xn = rms_norm(x, &layer.post_attention_layernorm, self.config.rms_norm_eps)?;
        let gate = candle_nn::ops::silu(&linear(&xn, &layer.gate_proj)?)?;
        let up = linear(&xn, &layer.up_proj)?;
        x + linear(&(gate * up)?, &layer.down_proj)?
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
        let (b, s) = input_ids.dims2()?;
        let c = &self.config;
        let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (cos, sin) = match positions {
            // Per-row tables [B, S, hd]: they broadcast over the heads like the shared [S, hd].
            Some(p) => {
                let (cos, sin) = self.rope_tables(p)?;
                (cos.reshape((b, s, hd))?, sin.reshape((b, s, hd))?)
            }
            None => {
                let p: Vec<[u32; 3]> = (0..s as u32).map(|i| [i; 3]).collect();
                self.rope_tables(&p)?
            }
        };
        let mask: Vec<f32> = (0..s)
            .flat_map(|i| (0..s).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, s, s), &self.device)?;
        let mut x = self
            .embed_tokens
            .index_select(&input_ids.flatten_all()?, 0)?;
        if let Some(v) = visual {
            x = v.write_embeds(&x)?;
        }
        let mut x = x.reshape((b, s, c.hidden_size))?;
        for (l, layer) in self.layers.iter().enumerate() {
            let xn = rms_norm(&x, &layer.input_layernorm, c.rms_norm_eps)?;
            let (q, k, v) = self.qkv(layer, &xn, &cos, &sin)?;
            let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
            let n_rep = h / kv;
            let (k, v) = if n_rep == 1 {
                (k, v)
            } else {
                let rep = |t: Tensor| -> candle_core::Result<Tensor> {
                    t.unsqueeze(2)?
                        .broadcast_as((b, kv, n_rep, s, hd))?
                        .reshape((b, h, s, hd))
                };
                (rep(k)?, rep(v)?)
            };
            let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * (hd as f64).powf(-0.5))?
                .to_dtype(DType::F32)?
                .broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(self.dtype)?;
            let attn = probs
                .matmul(&v.contiguous()?)?
                .transpose(1, 2)?
                .reshape((b, s, h * hd))?;
            x = (x + linear(&attn, &layer.o_proj)?)?;
            x = self.mlp_block(layer, &x)?;
            if let Some(v) = visual.filter(|v| l < v.deepstack.len()) {
                x = v
                    .add_deepstack(&x.reshape((b * s, c.hidden_size))?, l)?
                    .reshape((b, s, c.hidden_size))?;
            }
        }
        rms_norm(&x, &self.norm, c.rms_norm_eps)
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
                let visual = VisualInjection::new(v, &locate, &imgs, &self.device)?;
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
        let context = |e: ModelError| ModelError::InvalidInput(format!("{what}: {e}"));
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

    /// How this model's prompts take images (`None` for a text-only Qwen3).
    pub fn image_prompting(&self) -> Option<ImagePrompting> {
        self.vision.as_ref().map(|v| ImagePrompting {
            tokens: v.tokens,
            processor: v.processor.clone(),
        })
    }

    /// Loads and processes `sources` with the checkpoint's image processor.
    pub fn prepare_images(
        &self,
        sources: &[crate::image::ImageSource],
    ) -> Result<Vec<Arc<ProcessedImage>>> {
        ImagePrompting::prepare_with(self.image_prompting().as_ref(), sources)
    }

    /// Prompt ids with each image's single `<|image_pad|>` expanded to its token count (ids
    /// already expanded, or without images, come back unchanged).
    pub fn expand_image_pads(
        &self,
        ids: &[u32],
        images: &[Arc<ProcessedImage>],
    ) -> Result<Vec<u32>> {
        match self.image_prompting() {
            _ if images.is_empty() => Ok(ids.to_vec()),
            None => self
                .validate_images(ids, images, "prompt")
                .map(|_| ids.to_vec()),
            Some(p) => p.expand(ids, images),
        }
    }

    /// Per-token log-probabilities of each request's response, in request order. Requests are
    /// batched (right-padded) through the training path, so these are the numbers training sees.
    pub fn score_batch(&self, requests: &[ScoreRequest]) -> Result<Vec<Vec<f32>>> {
        Ok(self.score_batch_inner(requests, false)?.0)
    }

    /// [`Qwen3::score_batch`] plus the entropy of the temperature-scaled distribution at every
    /// response position, from the same pass over the vocabulary.
    pub fn score_batch_with_entropy(
        &self,
        requests: &[ScoreRequest],
    ) -> Result<LogprobsAndEntropy> {
        self.score_batch_inner(requests, true)
    }

    fn score_batch_inner(
        &self,
        requests: &[ScoreRequest],
        with_entropy: bool,
    ) -> Result<LogprobsAndEntropy> {
        for (i, r) in requests.iter().enumerate() {
            if r.prompt_ids.is_empty() || r.response_ids.is_empty() {
                return Err(ModelError::InvalidInput(format!(
                    "request {i}: scoring needs at least one prompt token and one response token"
                )));
            }
            if !(r.temperature > 0.0 && r.temperature.is_finite()) {
                return Err(ModelError::InvalidInput(format!(
                    "request {i}: temperature must be a positive number, got {}",
                    r.temperature
                )));
            }
            let ids: Vec<u32> = r
                .prompt_ids
                .iter()
                .chain(&r.response_ids)
                .copied()
                .collect();
            self.validate_ids(&ids, &format!("request {i}"))?;
            self.validate_images(&r.prompt_ids, &r.images, &format!("request {i}"))?;
        }
        let (mut out, mut entropies) = (Vec::with_capacity(requests.len()), Vec::new());
        let mut start = 0;
        while start < requests.len() {
            let len = |r: &ScoreRequest| r.prompt_ids.len() + r.response_ids.len();
            let mut end = start + 1;
            let mut longest = len(&requests[start]);
            while end < requests.len() {
                let l = longest.max(len(&requests[end]));
                if l * (end - start + 1) > SCORE_BATCH_TOKENS {
                    break;
                }
                longest = l;
                end += 1;
            }
            let (lp, h) = self.score_padded(&requests[start..end], longest, with_entropy)?;
            out.extend(lp);
            entropies.extend(h);
            start = end;
        }
        Ok((out, entropies))
    }

    /// Log-probs (and entropies, when asked, else none) of one padded batch.
    fn score_padded(
        &self,
        batch: &[ScoreRequest],
        longest: usize,
        with_entropy: bool,
    ) -> Result<LogprobsAndEntropy> {
        let (rows, targets, temps) = self.response_hidden(batch, longest)?;
        let chunk = (SCORE_LOGIT_ELEMENTS / self.config.vocab_size).max(1);
        let (mut flat, mut flat_h) = (Vec::with_capacity(targets.len()), Vec::new());
        let mut start = 0;
        while start < targets.len() {
            let n = chunk.min(targets.len() - start);
            let logits =
                self.scaled_logits(&rows.narrow(0, start, n)?, &temps[start..start + n])?;
            let (lp, h) =
                oxrl_nn::logprob_entropy(&logits, &targets[start..start + n], with_entropy)?;
            flat.extend(lp);
            flat_h.extend(h);
            start += n;
        }
        let (mut out, mut entropies) = (Vec::with_capacity(batch.len()), Vec::new());
        let mut at = 0;
        for r in batch {
            let n = r.response_ids.len();
            out.push(flat[at..at + n].to_vec());
            if with_entropy {
                entropies.push(flat_h[at..at + n].to_vec());
            }
            at += n;
        }
        Ok((out, entropies))
    }

    /// Final hidden states of every response position of the batch, gathered into `[R, D]`
    /// (R = all response tokens, request after request), with the target ids and each row's
    /// temperature. One right-padded forward over the batch.
    fn response_hidden(
        &self,
        batch: &[ScoreRequest],
        longest: usize,
    ) -> Result<(Tensor, Vec<u32>, Vec<f32>)> {
        let mut ids = Vec::with_capacity(batch.len() * longest);
        for r in batch {
            if r.prompt_ids.is_empty() || r.response_ids.is_empty() {
                return Err(ModelError::InvalidInput(
                    "scoring needs at least one prompt token and one response token".into(),
                ));
            }
            ids.extend(&r.prompt_ids);
            ids.extend(&r.response_ids);
            ids.resize(
                ids.len() + longest - r.prompt_ids.len() - r.response_ids.len(),
                0,
            );
        }
        let hidden = match self
            .vision
            .as_ref()
            .filter(|_| batch.iter().any(|r| !r.images.is_empty()))
        {
            None => {
                let input = Tensor::from_vec(ids, (batch.len(), longest), &self.device)?;
                self.forward_hidden(&input)?
            }
            Some(vision) => {
                let mut positions = Vec::with_capacity(ids.len());
                let mut locate = Vec::with_capacity(ids.len());
                for (b, r) in batch.iter().enumerate() {
                    let grids: Vec<[usize; 3]> = r.images.iter().map(|i| i.grid_thw).collect();
                    positions.extend(vision.tokens.sequence_positions(
                        &r.prompt_ids,
                        r.response_ids.len(),
                        &grids,
                    )?);
                    positions.resize((b + 1) * longest, [0; 3]);
                    locate.extend(&r.prompt_ids);
                    locate.resize((b + 1) * longest, NOT_PROMPT);
                }
                let images: Vec<&ProcessedImage> = batch
                    .iter()
                    .flat_map(|r| r.images.iter().map(|i| &**i))
                    .collect();
                let visual = VisualInjection::new(vision, &locate, &images, &self.device)?;
                let input = Tensor::from_vec(ids, (batch.len(), longest), &self.device)?;
                self.forward_hidden_with(&input, Some(&positions), Some(&visual))?
            }
        };
        let mut rows = Vec::with_capacity(batch.len());
        let (mut targets, mut temps) = (Vec::new(), Vec::new());
        for (b, r) in batch.iter().enumerate() {
            rows.push(
                hidden
                    .get(b)?
                    .narrow(0, r.prompt_ids.len() - 1, r.response_ids.len())?,
            );
            targets.extend(&r.response_ids);
            temps.extend(std::iter::repeat_n(
                r.temperature as f32,
                r.response_ids.len(),
            ));
        }
        Ok((Tensor::cat(&rows, 0)?, targets, temps))
    }

    /// `lm_head(rows) / T` per row, in f32.
    fn scaled_logits(&self, rows: &Tensor, temps: &[f32]) -> candle_core::Result<Tensor> {
        let logits = linear(rows, &self.lm_head)?.to_dtype(DType::F32)?;
        if temps.iter().all(|&t| t == 1.0) {
            return Ok(logits);
        }
        let t = Tensor::from_slice(temps, (temps.len(), 1), &self.device)?;
        logits.broadcast_div(&t)
    }

    /// Response log-probs of the whole batch as one differentiable `[R]` tensor (the training
    /// path: gradients reach every weight), requests one after another, through the fused
    /// vocabulary kernel; plus per-token entropies of the temperature-scaled distribution as
    /// `entropy` asks.
    pub fn response_logprobs(
        &self,
        batch: &[ScoreRequest],
        entropy: Entropy,
    ) -> Result<BatchLogprobs> {
        let longest = batch
            .iter()
            .map(|r| r.prompt_ids.len() + r.response_ids.len())
            .max()
            .unwrap_or(0);
        let (rows, targets, temps) = self.response_hidden(batch, longest)?;
        let logits = self.scaled_logits(&rows, &temps)?;
        let logprobs = oxrl_nn::target_logprobs(&logits, &targets)?;
        let entropy = match entropy {
            Entropy::None => None,
            Entropy::Value => {
                let h = oxrl_nn::logprob_entropy(&logits.detach(), &targets, true)?.1;
                Some(Tensor::from_vec(h, targets.len(), &self.device)?)
            }
            Entropy::Differentiable => {
                let logp_all = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
                Some((logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?)
            }
        };
        Ok(BatchLogprobs {
            logprobs,
            entropy,
            lens: batch.iter().map(|r| r.response_ids.len()).collect(),
        })
    }
}

impl Qwen3 {
    /// Saves the model as a Hugging Face checkpoint directory in its compute dtype (see
    /// [`crate::checkpoint::save_checkpoint`]), copying tokenizer and generation files from `copy_from`.
    pub fn save(&self, out: &Path, copy_from: Option<&Path>) -> Result<()> {
        self.save_sharded(out, copy_from, crate::checkpoint::MAX_SHARD_BYTES)
    }

    /// [`Qwen3::save`] with shards of at most `max_shard_bytes` (a single tensor may exceed it).
    pub fn save_sharded(
        &self,
        out: &Path,
        copy_from: Option<&Path>,
        max_shard_bytes: usize,
    ) -> Result<()> {
        self.save_with(out, copy_from, max_shard_bytes, &|_| Ok(()))
    }

    /// [`Qwen3::save_sharded`] with `extra` writing more files into the checkpoint before it
    /// becomes visible under its name.
    pub fn save_with(
        &self,
        out: &Path,
        copy_from: Option<&Path>,
        max_shard_bytes: usize,
        extra: &dyn Fn(&Path) -> Result<()>,
    ) -> Result<()> {
        let mut config = self.config_json.clone();
        let dtype_key = match config.get("torch_dtype") {
            Some(_) => "torch_dtype",
            None => "dtype",
        };
        config[dtype_key] = crate::checkpoint::dtype_name(self.dtype).into();
        config["tie_word_embeddings"] = self.tied.into();
        crate::checkpoint::save_checkpoint(
            out,
            &self.named_parameters(),
            &config,
            copy_from,
            max_shard_bytes,
            extra,
        )
    }
}

impl Qwen3 {
    /// A freshly initialised model as transformers makes one: every matrix (and the vision
    /// position table) from N(0, 0.02²) (`initializer_range`), every norm weight 1, every bias
    /// 0. For benchmarks, tests and new tiny policies; Qwen3-VL when the config has a
    /// `vision_config`.
    pub fn random(config_json: Value, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        let (config, vision) = parse_config(&config_json, Path::new("<random init>"))?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let std = config_json
            .get("initializer_range")
            .and_then(Value::as_f64)
            .unwrap_or(0.02) as f32;
        let mut normal = |shape: &[usize]| -> Result<Tensor> {
            let n: usize = shape.iter().product();
            // Box–Muller: two uniforms give one standard normal.
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let (u1, u2) = (1.0 - rng.random::<f32>(), rng.random::<f32>());
                    std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
                })
                .collect();
            Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
        };
        let c = &config;
        let (d, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (h, kv) = (c.num_attention_heads, c.num_key_value_heads);
        let ones = |n: usize| Tensor::ones(n, dtype, device);
        let mut t = HashMap::new();
        if let Some((vc, _)) = &vision {
            for (name, shape, init) in crate::vision::parameter_shapes(vc) {
                let x = match init {
                    crate::vision::Init::Normal => normal(&shape)?,
                    crate::vision::Init::Ones => Tensor::ones(shape, dtype, device)?,
                    crate::vision::Init::Zeros => Tensor::zeros(shape, dtype, device)?,
                };
                t.insert(name, x);
            }
        }
        t.insert(
            "model.embed_tokens.weight".to_string(),
            normal(&[c.vocab_size, d])?,
        );
        t.insert("model.norm.weight".to_string(), ones(d)?);
        if !c.tie_word_embeddings {
            t.insert("lm_head.weight".to_string(), normal(&[c.vocab_size, d])?);
        }
        for l in 0..c.num_hidden_layers {
            for (name, shape) in [
                ("self_attn.q_proj.weight", [h * hd, d]),
                ("self_attn.k_proj.weight", [kv * hd, d]),
                ("self_attn.v_proj.weight", [kv * hd, d]),
                ("self_attn.o_proj.weight", [d, h * hd]),
                ("mlp.gate_proj.weight", [i, d]),
                ("mlp.up_proj.weight", [i, d]),
                ("mlp.down_proj.weight", [d, i]),
            ] {
                t.insert(format!("model.layers.{l}.{name}"), normal(&shape)?);
            }
            for (name, n) in [
                ("input_layernorm.weight", d),
                ("post_attention_layernorm.weight", d),
                ("self_attn.q_norm.weight", hd),
                ("self_attn.k_norm.weight", hd),
            ] {
                t.insert(format!("model.layers.{l}.{name}"), ones(n)?);
            }
        }
        Self::from_tensors(config_json, Path::new("<random init>"), t, dtype, device)
    }
}

impl Qwen3 {
    /// A second handle on the same weights without autograd tracking, for the rollout engine:
    /// the tensors share storage, so an optimizer's in-place update (`Var::set`) shows in both.
    pub fn detached(&self) -> Self {
        let d = |t: &Tensor| t.detach();
        Self {
            config: self.config.clone(),
            config_json: self.config_json.clone(),
            embed_tokens: d(&self.embed_tokens),
            layers: self
                .layers
                .iter()
                .map(|l| Layer {
                    input_layernorm: d(&l.input_layernorm),
                    q_proj: d(&l.q_proj),
                    k_proj: d(&l.k_proj),
                    v_proj: d(&l.v_proj),
                    o_proj: d(&l.o_proj),
                    q_norm: d(&l.q_norm),
                    k_norm: d(&l.k_norm),
                    post_attention_layernorm: d(&l.post_attention_layernorm),
                    gate_proj: d(&l.gate_proj),
                    up_proj: d(&l.up_proj),
                    down_proj: d(&l.down_proj),
                })
                .collect(),
            norm: d(&self.norm),
            lm_head: d(&self.lm_head),
            tied: self.tied,
            vision: self.vision.as_ref().map(|v| Vision {
                tower: v.tower.map_weights(d),
                tokens: v.tokens,
                processor: v.processor.clone(),
                frozen: v.frozen,
            }),
            dtype: self.dtype,
            device: self.device.clone(),
        }
    }
}
