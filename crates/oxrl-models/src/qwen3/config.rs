//! What a checkpoint's `config.json` says about the model: the text decoder's settings and, for
//! Qwen3-VL (a config with `vision_config`), the vision tower's and its token ids.

use crate::config::Qwen3Config;
use crate::error::{ModelError, Result};
use crate::mrope::VisionTokens;
use crate::vision::VisionConfig;
use serde_json::Value;
use std::path::Path;

/// Qwen3-VL's interleaved MRoPE split when the text config does not name one.
const DEFAULT_MROPE_SECTION: [usize; 3] = [24, 20, 20];

/// A parsed `config.json`: the decoder, and the vision half of a Qwen3-VL checkpoint.
pub(crate) struct ModelConfig {
    pub text: Qwen3Config,
    pub vision: Option<(VisionConfig, VisionTokens)>,
}

impl ModelConfig {
    /// Reads both layouts: a text-only Qwen3 config, or a Qwen3-VL one whose decoder settings
    /// sit in `text_config` beside `vision_config`. `path` names the file in errors.
    pub fn from_value(v: &Value, path: &Path) -> Result<Self> {
        let Some(vision) = v.get("vision_config") else {
            return Ok(Self {
                text: Qwen3Config::from_value(v, path)?,
                vision: None,
            });
        };
        let config_key = |key: &str, expected: String| ModelError::ConfigKey {
            path: path.to_path_buf(),
            key: key.into(),
            expected,
        };
        let text = v.get("text_config").ok_or_else(|| {
            config_key(
                "text_config",
                "the text decoder's settings (a Qwen3-VL config has both text_config and vision_config)"
                    .into(),
            )
        })?;
        let mut config = Qwen3Config::from_value(text, path)?;
        if config.mrope_section.is_none() {
            config.mrope_section = Some(DEFAULT_MROPE_SECTION);
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
                    .ok_or_else(|| config_key(key, "a token id".into())),
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
            return Err(config_key(
                "vision_config.out_hidden_size",
                format!("the text hidden size {}", config.hidden_size),
            ));
        }
        Ok(Self {
            text: config,
            vision: Some((vision, tokens)),
        })
    }
}

/// Checkpoint prefix of the text decoder's weights: `model.language_model.` in Qwen3-VL.
pub(crate) fn text_prefix(vl: bool) -> &'static str {
    if vl {
        "model.language_model."
    } else {
        "model."
    }
}
