//! Encoding f32 values as ggml stores them: f32, f16 and bf16 (round to nearest even), and
//! Q8_0 — blocks of 32 values sharing one f16 scale `d = max|x| / 127`, each value
//! `round(x / d)` as an int8 (ggml's `quantize_row_q8_0_ref`: rounding half away from zero).

use super::format::GgmlType;
use crate::tensors::StoredDtype;

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: the f16 scale and 32 int8s.
pub const Q8_0_BLOCK_BYTES: usize = 2 + Q8_0_BLOCK;

/// `values` in `ggml_type`'s bytes (for Q8_0, `values.len()` is a multiple of 32).
pub fn encode(values: &[f32], ggml_type: GgmlType) -> Vec<u8> {
    match ggml_type {
        GgmlType::F32 => StoredDtype::F32.encode(values),
        GgmlType::F16 => StoredDtype::F16.encode(values),
        GgmlType::BF16 => StoredDtype::BF16.encode(values),
        GgmlType::Q8_0 => values
            .chunks_exact(Q8_0_BLOCK)
            .flat_map(q8_0_block)
            .collect(),
    }
}

fn q8_0_block(block: &[f32]) -> Vec<u8> {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = Vec::with_capacity(Q8_0_BLOCK_BYTES);
    out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
    out.extend(block.iter().map(|v| ((v * inv).round() as i8) as u8));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_scales_by_the_block_maximum_and_rounds_half_away_from_zero() {
        // max |x| = 127, so d = 1 and the values round as they are.
        let mut block = vec![0f32; 32];
        block[0] = 127.0;
        block[1] = -63.5;
        block[2] = 0.5;
        block[3] = -1.5;
        block[4] = 0.49;
        let bytes = encode(&block, GgmlType::Q8_0);
        assert_eq!(bytes.len(), 34);
        let d = half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32();
        assert_eq!(d, 1.0);
        let q: Vec<i8> = bytes[2..].iter().map(|b| *b as i8).collect();
        assert_eq!(&q[..6], &[127, -64, 1, -2, 0, 0]);
    }

    #[test]
    fn an_all_zero_block_has_scale_zero() {
        let bytes = encode(&[0.0; 32], GgmlType::Q8_0);
        assert!(bytes.iter().all(|b| *b == 0));
    }

    #[test]
    fn half_precisions_round_to_nearest() {
        let bytes = encode(&[1.0, -2.5], GgmlType::F16);
        assert_eq!(bytes, vec![0x00, 0x3c, 0x00, 0xc1]);
        let bytes = encode(&[1.0], GgmlType::BF16);
        assert_eq!(bytes, vec![0x80, 0x3f]);
    }
}
