//! PIL's bicubic resize (`Image.resize(size, Image.BICUBIC)`), reproduced bit for bit so that
//! pixel values equal what Hugging Face's PIL image-processor backend feeds the model.
//!
//! Pillow (`libImaging/Resample.c`) resizes in two separable passes — horizontal, then vertical —
//! each rounding to uint8. Each output sample is a weighted sum of the input samples under the
//! Keys cubic kernel (a = −0.5) stretched by the downscale factor (antialiasing), with the
//! weights normalised to sum to one and then turned into 22-bit fixed point.

/// Fractional bits of the fixed-point weights (`PRECISION_BITS` in Pillow).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The bicubic kernel's support, in input samples at scale 1.
const BICUBIC_SUPPORT: f64 = 2.0;

/// Keys' cubic convolution kernel with a = −0.5.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// The taps of every output sample along one axis: first input index and fixed-point weights.
struct Taps {
    first: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

/// `precompute_coeffs` + `normalize_coeffs_8bpc`: resampling `in_size` samples to `out_size`.
fn taps(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = BICUBIC_SUPPORT * filterscale;
    let mut first = Vec::with_capacity(out_size);
    let mut weights = Vec::with_capacity(out_size);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        // C's `(int)` truncates toward zero; the bounds are clamped to the image afterwards.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let raw: Vec<f64> = (xmin..xmax)
            .map(|x| bicubic((x as f64 - center + 0.5) / filterscale))
            .collect();
        let total: f64 = raw.iter().sum();
        let fixed = raw
            .iter()
            .map(|&w| {
                let w = if total != 0.0 { w / total } else { w };
                let scaled = w * f64::from(1u32 << PRECISION_BITS);
                // Round half away from zero, as Pillow does.
                if w < 0.0 {
                    (scaled - 0.5) as i32
                } else {
                    (scaled + 0.5) as i32
                }
            })
            .collect();
        first.push(xmin);
        weights.push(fixed);
    }
    Taps { first, weights }
}

/// Pillow's `clip8`: the fixed-point sum back to a byte.
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// An interleaved 8-bit image: `height` rows of `width × channels` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image8 {
    pub width: usize,
    pub height: usize,
    pub channels: usize,
    pub data: Vec<u8>,
}

/// Resizes `img` to `width × height` exactly as `PIL.Image.resize((width, height), BICUBIC)`
/// does in Pillow 13 (the version behind the reference fixtures).
pub fn resize_bicubic(img: &Image8, width: usize, height: usize) -> Image8 {
    let (horizontal, vertical) = (width != img.width, height != img.height);
    let mut out = img.clone();
    if vertical_first(img.width, img.height, width, height) {
        if vertical {
            out = resample_vertical(&out, height);
        }
        if horizontal {
            out = resample_horizontal(&out, width);
        }
    } else {
        if horizontal {
            out = resample_horizontal(&out, width);
        }
        if vertical {
            out = resample_vertical(&out, height);
        }
    }
    out
}

/// Pillow runs the vertical pass first when the height shrinks by more than twice as many
/// pixels as the width (`ImagingResampleInner`); each pass rounds to bytes, so the order shows
/// in the result. (Pillow before 12 always went horizontal first.)
fn vertical_first(width: usize, height: usize, new_width: usize, new_height: usize) -> bool {
    let shrink_h = height as i64 - new_height as i64;
    let shrink_w = width as i64 - new_width as i64;
    shrink_h > 0 && shrink_h > 2 * shrink_w
}

fn resample_horizontal(img: &Image8, width: usize) -> Image8 {
    let t = taps(img.width, width);
    let c = img.channels;
    let mut data = vec![0u8; width * img.height * c];
    for y in 0..img.height {
        let row = &img.data[y * img.width * c..][..img.width * c];
        let out = &mut data[y * width * c..][..width * c];
        for (xx, (first, w)) in t.first.iter().zip(&t.weights).enumerate() {
            for ch in 0..c {
                let mut acc: i64 = 1 << (PRECISION_BITS - 1);
                for (k, &wk) in w.iter().enumerate() {
                    acc += i64::from(row[(first + k) * c + ch]) * i64::from(wk);
                }
                out[xx * c + ch] = clip8(acc);
            }
        }
    }
    Image8 {
        width,
        height: img.height,
        channels: c,
        data,
    }
}

fn resample_vertical(img: &Image8, height: usize) -> Image8 {
    let t = taps(img.height, height);
    let (c, stride) = (img.channels, img.width * img.channels);
    let mut data = vec![0u8; height * stride];
    for (yy, (first, w)) in t.first.iter().zip(&t.weights).enumerate() {
        let out = &mut data[yy * stride..][..stride];
        for (i, o) in out.iter_mut().enumerate() {
            let mut acc: i64 = 1 << (PRECISION_BITS - 1);
            for (k, &wk) in w.iter().enumerate() {
                acc += i64::from(img.data[(first + k) * stride + i]) * i64::from(wk);
            }
            *o = clip8(acc);
        }
    }
    Image8 {
        width: img.width,
        height,
        channels: c,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_is_keys_cubic() {
        assert_eq!(bicubic(0.0), 1.0);
        assert_eq!(bicubic(1.0), 0.0);
        assert_eq!(bicubic(2.0), 0.0);
        // ((1.5·0.5 − 2.5)·0.25 + 1) = 0.5625 at x = 0.5; (((−3.5)·1.5 + 8)·1.5 − 4)·(−0.5) at 1.5.
        assert_eq!(bicubic(0.5), 0.5625);
        assert_eq!(bicubic(-1.5), -0.0625);
    }

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (a, b) in [(40, 96), (100, 96), (75, 64), (128, 128), (7, 3)] {
            let t = taps(a, b);
            for w in &t.weights {
                let s: i64 = w.iter().map(|&x| i64::from(x)).sum();
                assert!(
                    (s - (1 << PRECISION_BITS)).abs() <= w.len() as i64,
                    "{a}->{b}: {s}"
                );
            }
        }
    }

    #[test]
    fn the_pass_order_follows_pillow() {
        // Measured against Pillow 13: 100×75 → 96×64 shrinks the height by 11 > 2·4.
        assert!(vertical_first(100, 75, 96, 64));
        assert!(vertical_first(52, 27, 100, 13));
        // 79×80 → 32×21: 59 ≤ 2·47; growing never goes vertical first.
        assert!(!vertical_first(79, 80, 32, 21));
        assert!(!vertical_first(40, 30, 96, 64));
    }

    #[test]
    fn a_constant_image_stays_constant_and_same_size_is_a_copy() {
        let img = Image8 {
            width: 5,
            height: 3,
            channels: 3,
            data: vec![77; 45],
        };
        let r = resize_bicubic(&img, 11, 7);
        assert!(r.data.iter().all(|&v| v == 77));
        assert_eq!(resize_bicubic(&img, 5, 3), img);
    }
}
