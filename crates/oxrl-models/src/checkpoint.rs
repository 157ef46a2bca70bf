//! Reading Hugging Face safetensors checkpoints: a single `model.safetensors` or shards listed
//! in `model.safetensors.index.json`, stored as f32, bf16 or f16, converted to the compute dtype.

use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Every tensor of the checkpoint in `dir`, converted to `dtype`.
pub fn load_tensors(dir: &Path, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    let mut tensors = HashMap::new();
    for file in weight_files(dir)? {
        for (name, t) in load_shard(&file, device)? {
            tensors.insert(name, t.to_dtype(dtype)?);
        }
    }
    Ok(tensors)
}

/// The safetensors files of a checkpoint directory: `model.safetensors`, or the shards its
/// `model.safetensors.index.json` names.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.exists() {
        return Ok(vec![single]);
    }
    if !index.exists() {
        return Err(ModelError::Io {
            path: single,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model.safetensors or model.safetensors.index.json in the model directory",
            ),
        });
    }
    let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
        path: index.clone(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
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
    Ok(shards.into_iter().map(|f| dir.join(f)).collect())
}

/// One safetensors file's tensors in their stored dtype, on `device`.
pub fn load_shard(file: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(file, device).map_err(|source| ModelError::Safetensors {
        path: file.to_path_buf(),
        source,
    })
}

/// Files beside the weights that a checkpoint directory carries through unchanged.
pub const SIDE_FILES: [&str; 11] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
];

/// Largest safetensors file written before the weights are split into shards (transformers' 5 GB).
pub const MAX_SHARD_BYTES: usize = 5_000_000_000;

/// transformers' name of a dtype in `config.json`.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` and flushes them to disk.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    std::io::Write::write_all(&mut f, bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// Saves `tensors` as a safetensors file at `path` and fsyncs it.
pub fn save_safetensors_synced<S: AsRef<str> + Ord + std::fmt::Display>(
    tensors: &HashMap<S, Tensor>,
    path: &Path,
) -> Result<()> {
    candle_core::safetensors::save(tensors, path).map_err(|source| ModelError::Safetensors {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_err(path))
}

/// Writes a Hugging Face checkpoint directory atomically: everything goes into a temporary sibling
/// directory, is fsynced, and only then renamed to `out`, so a crash never leaves a half
/// checkpoint under the final name. An existing `out` is replaced.
///
/// `tensors` are saved under their names (split into shards listed by an index when they pass
/// `max_shard_bytes`),
/// `config` becomes `config.json`, the [`SIDE_FILES`] present in `copy_from` are copied, and
/// `extra` writes anything else (optimizer and trainer state) into the directory before the rename.
pub fn save_checkpoint(
    out: &Path,
    tensors: &[(String, Tensor)],
    config: &serde_json::Value,
    copy_from: Option<&Path>,
    max_shard_bytes: usize,
    extra: &dyn Fn(&Path) -> Result<()>,
) -> Result<()> {
    write_dir_atomically(out, &|tmp| {
        let mut shards: Vec<Vec<&(String, Tensor)>> = vec![Vec::new()];
        let mut shard_bytes = 0;
        for entry in tensors {
            let bytes = entry.1.elem_count() * entry.1.dtype().size_in_bytes();
            if shard_bytes + bytes > max_shard_bytes && !shards.last().is_some_and(Vec::is_empty) {
                shards.push(Vec::new());
                shard_bytes = 0;
            }
            shard_bytes += bytes;
            if let Some(shard) = shards.last_mut() {
                shard.push(entry);
            }
        }
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        let mut total_size = 0;
        for (i, shard) in shards.iter().enumerate() {
            let file = match n {
                1 => "model.safetensors".to_string(),
                _ => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
            };
            let map: HashMap<String, Tensor> =
                shard.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
            for (k, t) in &map {
                weight_map.insert(k.clone(), file.clone().into());
                total_size += t.elem_count() * t.dtype().size_in_bytes();
            }
            save_safetensors_synced(&map, &tmp.join(&file))?;
        }
        if n > 1 {
            let index = serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
            let path = tmp.join("model.safetensors.index.json");
            write_synced(
                &path,
                serde_json::to_string_pretty(&index)
                    .unwrap_or_default()
                    .as_bytes(),
            )?;
        }
        let path = tmp.join("config.json");
        let text = serde_json::to_string_pretty(config).unwrap_or_default();
        write_synced(&path, text.as_bytes())?;
        copy_side_files(copy_from, tmp)?;
        extra(tmp)?;
        Ok(())
    })
}

/// Copies the [`SIDE_FILES`] present in `from` (the tokenizer, chat template, generation
/// config) into `to`, synced.
pub fn copy_side_files(from: Option<&Path>, to: &Path) -> Result<()> {
    let Some(src) = from else { return Ok(()) };
    for file in SIDE_FILES {
        let from = src.join(file);
        if from.exists() {
            let bytes = std::fs::read(&from).map_err(io_err(&from))?;
            write_synced(&to.join(file), &bytes)?;
        }
    }
    Ok(())
}

/// Writes a directory atomically: `write` fills a temporary sibling directory, which is renamed
/// to `out` (replacing an existing one) only once everything in it is written and fsynced, so
/// a crash never leaves a half directory under the final name. A failed write removes what it
/// wrote.
pub fn write_dir_atomically(out: &Path, write: &dyn Fn(&Path) -> Result<()>) -> Result<()> {
    let name = out
        .file_name()
        .ok_or_else(|| {
            ModelError::InvalidInput(format!("{}: not a directory name", out.display()))
        })?
        .to_string_lossy()
        .to_string();
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;

    let written = write(&tmp);
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written?;
    if out.exists() {
        let old = parent.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(out, &old).map_err(io_err(out))?;
        std::fs::rename(&tmp, out).map_err(io_err(out))?;
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    } else {
        std::fs::rename(&tmp, out).map_err(io_err(out))?;
    }
    std::fs::File::open(parent)
        .and_then(|f| f.sync_all())
        .map_err(io_err(parent))
}
