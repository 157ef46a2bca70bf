//! Vectorizable exp, max and sum over f32 slices, dispatched to AVX2/FMA when the CPU has them.

/// `exp(x)` for `x ≤ 0` (0 below -87, so `-inf` logits weigh nothing), within 2e-7 relative
/// error: Cephes' `expf` range reduction and polynomial, written branch-free over plain f32 ops so
/// the compiler vectorizes the loops that call it. The vocabulary-wide softmax of every sampled
/// token runs through here, which libm's scalar `expf` made the engine's largest cost after lm_head.
#[inline(always)]
pub fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
    // Adding 1.5·2²³ rounds to the nearest integer n and leaves n in the low mantissa bits,
    // so 2ⁿ is built with integer ops only (a float-to-int cast would not vectorize).
    const ROUND: f32 = 12_582_912.0;
    let xc = if x < -87.0 { -87.0 } else { x };
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = xc - n * C1 - n * C2;
    let poly = ((((P[0] * r + P[1]) * r + P[2]) * r + P[3]) * r + P[4]) * r + P[5];
    let y = poly * r * r + r + 1.0;
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

/// `dst[i] = exp((src[i] - max) * scale)`.
#[inline(always)]
fn exp_shifted_into(dst: &mut [f32], src: &[f32], max: f32, scale: f32) {
    for (w, &x) in dst.iter_mut().zip(src) {
        *w = exp_nonpos((x - max) * scale);
    }
}

/// [`exp_shifted_into`] compiled for AVX2 + FMA, twice the lanes of the x86-64 baseline.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_shifted_into_avx2(dst: &mut [f32], src: &[f32], max: f32, scale: f32) {
    exp_shifted_into(dst, src, max, scale)
}

/// `dst[i] = exp((src[i] - max) * scale)`, with AVX2/FMA when the CPU has them.
// Calling a `#[target_feature]` function is `unsafe`; it is called only after runtime detection.
#[allow(unsafe_code)]
pub fn exp_shifted(dst: &mut [f32], src: &[f32], max: f32, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { exp_shifted_into_avx2(dst, src, max, scale) };
    }
    exp_shifted_into(dst, src, max, scale)
}

/// Largest value, over eight lanes so it vectorizes.
#[inline(always)]
pub fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    acc.iter()
        .chain(rest)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Sum over eight f32 lanes (vectorized); callers keep blocks short and add them in f64.
#[inline(always)]
pub fn sum_of(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().chain(rest).sum()
}

/// Elements summed in f32 lanes before the partial sums move to f64.
const BLOCK: usize = 1024;

/// `Σ a·b` over eight f32 lanes.
#[inline(always)]
fn dot_of(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += ca[j] * cb[j];
        }
    }
    let tail = a.len() / 8 * 8;
    acc.iter().sum::<f32>()
        + a[tail..]
            .iter()
            .zip(&b[tail..])
            .map(|(x, y)| x * y)
            .sum::<f32>()
}

/// `(Σ e, Σ e·x)` with `e = exp((x − max)·scale)`; the second sum only when `with_dot`.
/// Block by block: the exps go to an L1-sized buffer, then two plain vectorized reductions,
/// folded into f64 per block.
#[inline(always)]
fn sums_shifted_generic(src: &[f32], max: f32, scale: f32, with_dot: bool) -> (f64, f64) {
    let (mut total_s, mut total_t) = (0f64, 0f64);
    let mut buf = [0f32; BLOCK];
    for block in src.chunks(BLOCK) {
        let e = &mut buf[..block.len()];
        exp_shifted_into(e, block, max, scale);
        total_s += sum_of(e) as f64;
        if with_dot {
            total_t += dot_of(e, block) as f64;
        }
    }
    (total_s, total_t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sums_shifted_avx2(src: &[f32], max: f32, scale: f32, with_dot: bool) -> (f64, f64) {
    sums_shifted_generic(src, max, scale, with_dot)
}

/// `(Σ e, Σ e·x)` with `e = exp((x − max)·scale)`: the softmax normaliser and the numerator of
/// the expected logit, in one pass (the second only when `with_dot`, else 0).
// Calling a `#[target_feature]` function is `unsafe`; it is called only after runtime detection.
#[allow(unsafe_code)]
pub fn sums_shifted(src: &[f32], max: f32, scale: f32, with_dot: bool) -> (f64, f64) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { sums_shifted_avx2(src, max, scale, with_dot) };
    }
    sums_shifted_generic(src, max, scale, with_dot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_within_2e_7_relative() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            let got = exp_nonpos(x) as f64;
            assert!(
                ((got - want) / want).abs() < 2e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos(-100.0), 0.0);
    }

    #[test]
    fn sums_match_a_direct_f64_computation() {
        let xs: Vec<f32> = (0..3001)
            .map(|i| ((i * 37) % 101) as f32 / 10.0 - 5.0)
            .collect();
        let max = max_of(&xs);
        let (s, t) = sums_shifted(&xs, max, 1.0, true);
        let ws: f64 = xs.iter().map(|&x| ((x - max) as f64).exp()).sum();
        let wt: f64 = xs
            .iter()
            .map(|&x| ((x - max) as f64).exp() * x as f64)
            .sum();
        assert!(((s - ws) / ws).abs() < 1e-6 && ((t - wt) / wt).abs() < 1e-6);
        assert_eq!(max, 5.0);
        assert!((sum_of(&xs) as f64 - xs.iter().map(|&x| x as f64).sum::<f64>()).abs() < 1e-2);
    }
}
