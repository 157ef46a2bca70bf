//! `config.json` of a Qwen3 checkpoint, in both layouts found in the wild: hub checkpoints
//! (top-level `rope_theta`, `torch_dtype`) and what transformers 5 writes (`rope_parameters`, `dtype`).

use crate::error::{ModelError, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Qwen3-VL's interleaved MRoPE: frequencies per axis (T, H, W); `None` for plain RoPE.
    pub mrope_section: Option<[usize; 3]>,
    /// Storage dtype named by the checkpoint (`dtype` or `torch_dtype`), if any.
    pub stored_dtype: Option<String>,
}

/// A checkpoint's JSON file (`config.json`, `preprocessor_config.json`); errors name the file.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}

impl Qwen3Config {
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_value(&read_json(path)?, path)
    }

    pub fn from_value(v: &Value, path: &Path) -> Result<Self> {
        let err = |key: &str, expected: &str| ModelError::ConfigKey {
            path: path.to_path_buf(),
            key: key.to_string(),
            expected: expected.to_string(),
        };
        let usize_key = |key: &str| -> Result<usize> {
            v.get(key)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| err(key, "a non-negative integer"))
        };
        let num_attention_heads = usize_key("num_attention_heads")?;
        let hidden_size = usize_key("hidden_size")?;
        let head_dim = match v.get("head_dim") {
            Some(Value::Null) | None => hidden_size / num_attention_heads,
            Some(_) => usize_key("head_dim")?,
        };
        // Qwen3-VL text configs (`qwen3_vl_text`) always use interleaved MRoPE.
        let is_vl_text = v.get("model_type").and_then(Value::as_str) == Some("qwen3_vl_text");
        let rope = v.get("rope_parameters").or_else(|| v.get("rope_scaling"));
        let mrope_section = match rope.and_then(|p| p.get("mrope_section")) {
            Some(Value::Array(a)) if a.len() == 3 && a.iter().all(|x| x.as_u64().is_some()) => {
                let n = |i: usize| a[i].as_u64().unwrap_or(0) as usize;
                Some([n(0), n(1), n(2)])
            }
            Some(Value::Null) | None => is_vl_text.then_some([24, 20, 20]),
            Some(_) => return Err(err("rope_parameters.mrope_section", "three integers")),
        };
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .map(|t| t.as_f64().ok_or_else(|| err("rope_theta", "a number")))
            .transpose()?
            .unwrap_or(if is_vl_text { 500_000.0 } else { 1_000_000.0 });
        let rope_type = v
            .get("rope_parameters")
            .or_else(|| v.get("rope_scaling"))
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if rope_type != "default" {
            return Err(err(
                "rope_parameters.rope_type",
                &format!("\"default\" (rope type `{rope_type}` is not supported yet)"),
            ));
        }
        Ok(Self {
            vocab_size: usize_key("vocab_size")?,
            hidden_size,
            intermediate_size: usize_key("intermediate_size")?,
            num_hidden_layers: usize_key("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: match v.get("num_key_value_heads") {
                None | Some(Value::Null) => num_attention_heads,
                Some(_) => usize_key("num_key_value_heads")?,
            },
            head_dim,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta,
            max_position_embeddings: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(40960) as usize,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            mrope_section,
            stored_dtype: v
                .get("dtype")
                .or_else(|| v.get("torch_dtype"))
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_both_rope_layouts() {
        let base = json!({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4});
        let mut hub = base.clone();
        hub["rope_theta"] = json!(5000.0);
        hub["rope_scaling"] = Value::Null;
        hub["torch_dtype"] = json!("bfloat16");
        let mut v5 = base.clone();
        v5["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 5000.0});
        v5["dtype"] = json!("bfloat16");
        let a = Qwen3Config::from_value(&hub, Path::new("hub.json")).unwrap();
        let b = Qwen3Config::from_value(&v5, Path::new("v5.json")).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.rope_theta, 5000.0);
        assert_eq!(a.stored_dtype.as_deref(), Some("bfloat16"));
    }

    #[test]
    fn missing_key_names_file_and_key() {
        let e = Qwen3Config::from_value(&json!({"hidden_size": 8}), Path::new("x/config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x/config.json") && e.contains("num_attention_heads"),
            "{e}"
        );
    }
}
