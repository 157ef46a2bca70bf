//! The GGUF file format (version 3), as llama.cpp's `gguf.h` and the `gguf` Python package
//! read it: a header, typed key–value metadata, the tensor table, then the tensor data, each
//! tensor aligned to [`ALIGNMENT`] bytes. Everything is little-endian.

use std::io::{self, Write};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const VERSION: u32 = 3;
/// `general.alignment`'s default: the data section and every tensor start on it.
pub const ALIGNMENT: u64 = 32;

/// A metadata value (`gguf_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    ArrStr(Vec<String>),
    ArrI32(Vec<i32>),
}

impl MetaValue {
    fn type_id(&self) -> u32 {
        match self {
            Self::U32(_) => 4,
            Self::F32(_) => 6,
            Self::Bool(_) => 7,
            Self::Str(_) => 8,
            Self::ArrStr(_) | Self::ArrI32(_) => 9,
        }
    }
}

/// The element encodings oxrl writes (`ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q8_0,
    BF16,
}

impl GgmlType {
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q8_0 => 8,
            Self::BF16 => 30,
        }
    }

    /// Bytes of `n` elements (`n` a multiple of 32 for Q8_0).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            Self::F32 => 4 * n,
            Self::F16 | Self::BF16 => 2 * n,
            Self::Q8_0 => n / super::quant::Q8_0_BLOCK * super::quant::Q8_0_BLOCK_BYTES,
        }
    }
}

/// One row of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's dimension order: the innermost (contiguous) first, the reverse of PyTorch's.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// From the start of the data section.
    pub offset: u64,
}

pub fn pad_to_alignment(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

fn write_str(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, value: &MetaValue) -> io::Result<()> {
    match value {
        MetaValue::U32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::F32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::Bool(x) => w.write_all(&[*x as u8]),
        MetaValue::Str(s) => write_str(w, s),
        MetaValue::ArrStr(items) => {
            w.write_all(&8u32.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|s| write_str(w, s))
        }
        MetaValue::ArrI32(items) => {
            w.write_all(&5u32.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
    }
}

/// Writes everything before the tensor data, padding included; returns the bytes written.
pub fn write_head(
    w: &mut impl Write,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorInfo],
) -> io::Result<u64> {
    let mut head = Vec::new();
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        write_str(&mut head, key)?;
        head.extend_from_slice(&value.type_id().to_le_bytes());
        write_value(&mut head, value)?;
    }
    for t in tensors {
        write_str(&mut head, &t.name)?;
        head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            head.extend_from_slice(&d.to_le_bytes());
        }
        head.extend_from_slice(&t.ggml_type.id().to_le_bytes());
        head.extend_from_slice(&t.offset.to_le_bytes());
    }
    let padded = pad_to_alignment(head.len() as u64);
    head.resize(padded as usize, 0);
    w.write_all(&head)?;
    Ok(padded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_is_laid_out_as_gguf_v3_and_padded() {
        let metadata = vec![
            (
                "general.architecture".to_string(),
                MetaValue::Str("qwen3".into()),
            ),
            ("a.n".to_string(), MetaValue::U32(7)),
        ];
        let tensors = vec![TensorInfo {
            name: "t".into(),
            dims: vec![4, 2],
            ggml_type: GgmlType::F16,
            offset: 0,
        }];
        let mut out = Vec::new();
        let n = write_head(&mut out, &metadata, &tensors).unwrap();
        assert_eq!(n as usize, out.len());
        assert_eq!(n % ALIGNMENT, 0);
        assert_eq!(&out[..4], b"GGUF");
        assert_eq!(u32::from_le_bytes(out[4..8].try_into().unwrap()), 3);
        assert_eq!(u64::from_le_bytes(out[8..16].try_into().unwrap()), 1);
        assert_eq!(u64::from_le_bytes(out[16..24].try_into().unwrap()), 2);
        // The first key: its length, its bytes, then type 8 (string) and the value.
        assert_eq!(u64::from_le_bytes(out[24..32].try_into().unwrap()), 20);
        assert_eq!(&out[32..52], b"general.architecture");
        assert_eq!(u32::from_le_bytes(out[52..56].try_into().unwrap()), 8);
        assert_eq!(u64::from_le_bytes(out[56..64].try_into().unwrap()), 5);
        assert_eq!(&out[64..69], b"qwen3");
        assert_eq!(pad_to_alignment(33), 64);
        assert_eq!(GgmlType::Q8_0.bytes(64), 68);
    }
}
