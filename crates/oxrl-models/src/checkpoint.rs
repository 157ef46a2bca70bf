//! Reading Hugging Face safetensors checkpoints: a single `model.safetensors` or shards listed
//! in `model.safetensors.index.json`, stored as f32, bf16 or f16, converted to the compute dtype.

use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// Every tensor of the checkpoint in `dir`, converted to `dtype`.
pub fn load_tensors(dir: &Path, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<_> = if single.exists() {
        vec![single]
    } else if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
            path: index.clone(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: index.clone(),
                source,
            })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::ConfigKey {
                path: index.clone(),
                key: "weight_map".into(),
                expected: "an object from tensor name to shard file".into(),
            })?;
        let shards: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
        shards.into_iter().map(|f| dir.join(f)).collect()
    } else {
        return Err(ModelError::Io {
            path: single,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model.safetensors or model.safetensors.index.json in the model directory",
            ),
        });
    };
    let mut tensors = HashMap::new();
    for file in files {
        let loaded = candle_core::safetensors::load(&file, device).map_err(|source| {
            ModelError::Safetensors {
                path: file.clone(),
                source,
            }
        })?;
        for (name, t) in loaded {
            tensors.insert(name, t.to_dtype(dtype)?);
        }
    }
    Ok(tensors)
}
