//! The vision half of a Qwen3-VL forward: the tower with its token ids and image processor
//! settings, and where a batch's image embeddings and DeepStack features enter the decoder.

use crate::error::{ModelError, Result};
use crate::image::{ImageProcessorConfig, ProcessedImage};
use crate::mrope::VisionTokens;
use crate::tower_checkpoints::TowerCheckpoints;
use crate::vision::{VisionOutput, VisionTower};
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// The vision half of a Qwen3-VL checkpoint: the tower, the token ids it fills, and the image
/// processor settings its images are prepared with.
pub struct Vision {
    pub tower: VisionTower,
    pub tokens: VisionTokens,
    pub processor: ImageProcessorConfig,
    /// Leave the tower's weights out of [`crate::Qwen3::make_trainable`] (`[model] freeze_vision`).
    pub frozen: bool,
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
    /// With gradient checkpointing, the tower's boundaries: `embeds` and `deepstack` then grow
    /// from the tower's output leaves, whose gradients go through the recomputed blocks.
    pub tower: Option<Arc<TowerCheckpoints>>,
}

impl VisualInjection {
    /// Runs the vision tower over `images` (in prompt order) and places the result at the image
    /// tokens of the flattened ids. Only prompt tokens carry images: callers set every other
    /// position of `flat_ids` to [`NOT_PROMPT`], so a generated image pad stays text. With
    /// `checkpoint`, a trained tower keeps only its block boundaries (a frozen one keeps no
    /// graph anyway).
    pub(crate) fn new(
        vision: &Vision,
        flat_ids: &[u32],
        images: &[&ProcessedImage],
        device: &Device,
        checkpoint: bool,
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
        let pixels = Tensor::from_vec(pixels, (rows, dim), device)?;
        let (mut out, tower) = if checkpoint && !vision.frozen {
            let tower = vision.tower.forward_checkpointed(&pixels, &grids)?;
            let out = tower.outputs();
            let out = VisionOutput {
                embeds: out.embeds.clone(),
                deepstack: out.deepstack.clone(),
            };
            (out, Some(Arc::new(tower)))
        } else {
            (vision.tower.forward(&pixels, &grids)?, None)
        };
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
            tower,
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
