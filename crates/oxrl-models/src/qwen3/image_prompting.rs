//! Turning images into prompt input: the image processor and the vision token ids, readable
//! without the weights so datasets can be prepared (and rejected) before a model loads.

use super::config::ModelConfig;
use super::Qwen3;
use crate::error::{ModelError, Result};
use crate::image::{ImageProcessorConfig, ProcessedImage};
use crate::mrope::VisionTokens;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

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
        let Some((_, tokens)) = ModelConfig::from_value(&v, &path)?.vision else {
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
                    .map_err(|e| ModelError::Input {
                        what: s.describe(),
                        source: Box::new(e),
                    })
            })
            .collect()
    }

    /// Expands each image's single pad in `ids` (see [`VisionTokens::expand_image_pads`]).
    pub fn expand(&self, ids: &[u32], images: &[Arc<ProcessedImage>]) -> Result<Vec<u32>> {
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        self.tokens.expand_image_pads(ids, &grids)
    }
}

impl Qwen3 {
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
}
