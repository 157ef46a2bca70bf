//! The tensors of a Hugging Face checkpoint read one at a time from its safetensors files, so an
//! 8B model converts in the memory of its largest tensor, not of the whole model.

use crate::error::{io_err, ExportError, Result};
use oxrl_models::checkpoint::weight_files;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The element types a checkpoint stores weights in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    F16,
    BF16,
}

impl StoredDtype {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "F32" => Some(Self::F32),
            "F16" => Some(Self::F16),
            "BF16" => Some(Self::BF16),
            _ => None,
        }
    }

    fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    /// `values` as little-endian bytes of this type (half precisions round to nearest even).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            Self::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }
}

/// Where one tensor's bytes lie.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub dtype: StoredDtype,
    pub shape: Vec<usize>,
    file: PathBuf,
    start: u64,
    len: u64,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Every tensor of a checkpoint directory, by name, read lazily.
pub struct CheckpointTensors {
    dir: PathBuf,
    entries: BTreeMap<String, TensorEntry>,
}

impl CheckpointTensors {
    /// Reads the headers of `dir`'s `model.safetensors` or of the shards its index names.
    pub fn open(dir: &Path) -> Result<Self> {
        let mut entries = BTreeMap::new();
        for file in weight_files(dir)? {
            read_header(&file, &mut entries)?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            entries,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The entry of `name`; the error names the checkpoint and the missing tensor.
    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.entries
            .get(name)
            .ok_or_else(|| ExportError::Checkpoint {
                path: self.dir.clone(),
                message: format!("no tensor `{name}` in the checkpoint's safetensors files"),
            })
    }

    /// `name`'s shape, checked against `expected`.
    pub fn shape_of(&self, name: &str, expected: &[usize]) -> Result<&TensorEntry> {
        let entry = self.entry(name)?;
        if entry.shape != expected {
            return Err(ExportError::Checkpoint {
                path: entry.file.clone(),
                message: format!(
                    "tensor `{name}` has shape {:?}; the config implies {expected:?}",
                    entry.shape
                ),
            });
        }
        Ok(entry)
    }

    /// `name`'s values as f32 (exact for every stored dtype), row-major.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let entry = self.entry(name)?;
        let mut bytes = vec![0u8; entry.len as usize];
        let mut f = std::fs::File::open(&entry.file).map_err(io_err(&entry.file))?;
        f.seek(SeekFrom::Start(entry.start))
            .and_then(|_| f.read_exact(&mut bytes))
            .map_err(io_err(&entry.file))?;
        let values = match entry.dtype {
            StoredDtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            StoredDtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            StoredDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        };
        Ok(values)
    }
}

/// Adds the tensors of one safetensors file (an 8-byte header length, a JSON header, the data).
fn read_header(file: &Path, entries: &mut BTreeMap<String, TensorEntry>) -> Result<()> {
    let bad = |message: String| ExportError::Checkpoint {
        path: file.to_path_buf(),
        message,
    };
    let mut f = std::fs::File::open(file).map_err(io_err(file))?;
    let file_len = f.metadata().map_err(io_err(file))?.len();
    let mut len_bytes = [0u8; 8];
    f.read_exact(&mut len_bytes).map_err(io_err(file))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > file_len.saturating_sub(8) {
        return Err(bad(format!(
            "the safetensors header claims {header_len} bytes; the file has {file_len}"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(io_err(file))?;
    let header: Value = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("the safetensors header is not JSON: {e}")))?;
    let Value::Object(map) = header else {
        return Err(bad("the safetensors header is not a JSON object".into()));
    };
    let data_start = 8 + header_len;
    for (name, info) in map {
        if name == "__metadata__" {
            continue;
        }
        let dtype_name = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        let dtype = StoredDtype::parse(dtype_name).ok_or_else(|| {
            bad(format!(
                "tensor `{name}` is stored as {dtype_name}; export reads F32, F16 or BF16"
            ))
        })?;
        let shape: Option<Vec<usize>> = info
            .get("shape")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .and_then(|s: Option<Vec<usize>>| s);
        let offsets: Option<Vec<u64>> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(Value::as_u64).collect())
            .and_then(|o: Option<Vec<u64>>| o);
        let (Some(shape), Some([begin, end])) = (shape, offsets.as_deref()) else {
            return Err(bad(format!(
                "tensor `{name}` needs `shape` and two `data_offsets`"
            )));
        };
        let (begin, end) = (*begin, *end);
        let expected = shape.iter().product::<usize>() * dtype.bytes();
        if end < begin || (end - begin) as usize != expected || data_start + end > file_len {
            return Err(bad(format!(
                "tensor `{name}`: data_offsets [{begin}, {end}] do not hold {shape:?} {dtype_name} \
                 inside the file"
            )));
        }
        entries.insert(
            name,
            TensorEntry {
                dtype,
                shape,
                file: file.to_path_buf(),
                start: data_start + begin,
                len: end - begin,
            },
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxrl_fixtures::fixture;

    #[test]
    fn reads_the_fixture_tensors_lazily_and_names_missing_ones() {
        let tensors = CheckpointTensors::open(&fixture("qwen3-tiny")).unwrap();
        let embed = tensors
            .shape_of("model.embed_tokens.weight", &[1024, 64])
            .unwrap();
        assert_eq!(embed.dtype, StoredDtype::F32);
        let values = tensors.read_f32("model.norm.weight").unwrap();
        assert_eq!(values.len(), 64);
        assert!(values.iter().all(|v| v.is_finite()));
        let err = tensors.entry("model.nope").unwrap_err().to_string();
        assert!(err.contains("model.nope"), "{err}");
        let err = tensors
            .shape_of("model.norm.weight", &[32])
            .unwrap_err()
            .to_string();
        assert!(err.contains("[64]") && err.contains("[32]"), "{err}");
    }
}
