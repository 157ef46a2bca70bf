//! The Qwen3 text decoder as both export formats see it: its settings from `config.json` and
//! the Hugging Face names of its weights (under `model.` in Qwen3, `model.language_model.` in
//! Qwen3-VL).

use crate::error::Result;
use oxrl_models::config::read_json;
use oxrl_models::Qwen3Config;
use serde_json::Value;
use std::path::Path;

/// A checkpoint's decoder: its settings and where its weights are.
pub struct Decoder {
    pub config: Qwen3Config,
    /// Whether the checkpoint is Qwen3-VL (a vision tower beside the decoder).
    pub vision: bool,
    /// The whole `config.json`, for the metadata the formats carry.
    pub config_json: Value,
    prefix: &'static str,
}

impl Decoder {
    /// Reads `dir/config.json`: a Qwen3 config, or a Qwen3-VL one with the decoder's settings in
    /// `text_config` (tied embeddings read from the top level, as transformers 5 does).
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let config_json = read_json(&path)?;
        let (config, vision, prefix) = match config_json.get("text_config") {
            Some(text) if config_json.get("vision_config").is_some() => {
                let mut config = Qwen3Config::from_value(text, &path)?;
                config.tie_word_embeddings = config_json
                    .get("tie_word_embeddings")
                    .or_else(|| text.get("tie_word_embeddings"))
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                // Qwen3-VL always interleaves MRoPE; [24, 20, 20] when the config names none.
                config.mrope_section = config.mrope_section.or(Some([24, 20, 20]));
                (config, true, "model.language_model.")
            }
            _ => (
                Qwen3Config::from_value(&config_json, &path)?,
                false,
                "model.",
            ),
        };
        Ok(Self {
            config,
            vision,
            config_json,
            prefix,
        })
    }

    pub fn embed_tokens(&self) -> String {
        format!("{}embed_tokens.weight", self.prefix)
    }

    pub fn final_norm(&self) -> String {
        format!("{}norm.weight", self.prefix)
    }

    /// The output projection's weights: `lm_head.weight`, or the embeddings when tied.
    pub fn lm_head(&self) -> String {
        match self.config.tie_word_embeddings {
            true => self.embed_tokens(),
            false => "lm_head.weight".into(),
        }
    }

    /// `model.layers.{layer}.{part}` (under the decoder's prefix).
    pub fn layer(&self, layer: usize, part: &str) -> String {
        format!("{}layers.{layer}.{part}", self.prefix)
    }

    /// Every weight of one layer: (its name inside the layer, its [out, in] or [n] shape).
    pub fn layer_parts(&self) -> [(&'static str, Vec<usize>); 11] {
        let c = &self.config;
        let (h, d, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q, kv) = (c.num_attention_heads * d, c.num_key_value_heads * d);
        [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![q, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, q]),
            ("self_attn.q_norm.weight", vec![d]),
            ("self_attn.k_norm.weight", vec![d]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ]
    }
}

impl Decoder {
    /// Qwen3 has no attention biases; a checkpoint that turns them on is refused rather than
    /// exported without them.
    pub fn refuse_attention_bias(&self, dir: &Path) -> Result<()> {
        let text = self
            .config_json
            .get("text_config")
            .unwrap_or(&self.config_json);
        match text.get("attention_bias").and_then(Value::as_bool) {
            Some(true) => Err(crate::ExportError::Unsupported(format!(
                "{}: attention_bias = true; export writes Qwen3's bias-free attention",
                dir.join("config.json").display()
            ))),
            _ => Ok(()),
        }
    }
}
