//! LoRA dropout (PEFT's `lora_dropout`): while training, each adapter sees its input through
//! inverted dropout, `y = x·Wᵀ + s·(dropout_p(x)·Aᵀ)·Bᵀ` with
//! `dropout_p(x) = x ⊙ m / (1 − p)`, `m ~ Bernoulli(1 − p)` drawn per element and per adapter
//! (q, k and v see the same `x` through three masks, as PEFT's three `nn.Dropout`s do).
//!
//! Masks are a counter-based hash of (pass, adapter, element), not a stateful generator: the
//! recomputation of a checkpointed layer replays its forward's masks exactly, and nothing is
//! stored between the two. Dropout applies only inside a training pass
//! ([`DropoutPass::apply`]); scoring, sampling and the reference see the adapters whole, as a
//! model in eval mode does.

use candle_core::Tensor;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// What every adapter of one model handle shares: whether the adapters apply, and the key of
/// the training pass whose dropout masks apply (0: none).
#[derive(Debug, Default)]
pub(crate) struct AdapterSwitch {
    enabled: AtomicBool,
    dropout_pass: AtomicU64,
}

impl AdapterSwitch {
    pub(crate) fn new(enabled: bool) -> Arc<Self> {
        Arc::new(Self {
            enabled: AtomicBool::new(enabled),
            dropout_pass: AtomicU64::new(0),
        })
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub(crate) fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed)
    }

    /// The running training pass's key, if one runs.
    pub(crate) fn dropout_pass(&self) -> Option<u64> {
        Some(self.dropout_pass.load(Ordering::Relaxed)).filter(|&k| k != 0)
    }
}

/// One training forward's dropout: its key, on the switch of the handle it runs on. The
/// checkpointed backward applies it again to replay the forward's masks.
#[derive(Debug, Clone)]
pub struct DropoutPass {
    switch: Arc<AdapterSwitch>,
    pub(crate) key: u64,
}

impl DropoutPass {
    /// The `pass`-th training pass of adapters seeded with `seed`.
    pub(crate) fn new(switch: Arc<AdapterSwitch>, seed: u64, pass: u64) -> Self {
        // Never 0, which means "no pass".
        let key = mix(seed ^ mix(pass)) | 1;
        Self { switch, key }
    }

    /// Turns the masks on until the guard drops.
    pub fn apply(&self) -> PassGuard<'_> {
        self.switch.dropout_pass.store(self.key, Ordering::Relaxed);
        PassGuard(self)
    }
}

/// Turns a pass's masks off again when dropped.
pub struct PassGuard<'a>(&'a DropoutPass);

impl Drop for PassGuard<'_> {
    fn drop(&mut self) {
        self.0.switch.dropout_pass.store(0, Ordering::Relaxed);
    }
}

/// `x ⊙ m / (1 − p)` with adapter `adapter`'s mask of pass `key`.
pub(crate) fn dropout(x: &Tensor, p: f64, key: u64, adapter: u64) -> candle_core::Result<Tensor> {
    let mask = dropout_mask(p, key, adapter, x.elem_count());
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    x * mask
}

/// The mask of one adapter in one pass, already scaled: 0 where an element drops (with
/// probability `p`), `1 / (1 − p)` where it stays; element `i`'s draw is the top 24 bits of
/// `mix(stream + i)`, uniform on [0, 1).
pub fn dropout_mask(p: f64, key: u64, adapter: u64, len: usize) -> Vec<f32> {
    let stream = mix(key ^ mix(adapter.wrapping_add(0x9E37_79B9)));
    let kept = (1.0 / (1.0 - p)) as f32;
    (0..len as u64)
        .map(|i| {
            let u = (mix(stream.wrapping_add(i)) >> 40) as f64 / (1u64 << 24) as f64;
            if u < p {
                0.0
            } else {
                kept
            }
        })
        .collect()
}

/// SplitMix64's finaliser: a bijection of u64 whose outputs pass as independent uniforms.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_drops_about_p_and_scales_the_rest_by_one_over_one_minus_p() {
        let m = dropout_mask(0.25, 7, 3, 100_000);
        let dropped = m.iter().filter(|&&x| x == 0.0).count() as f64 / m.len() as f64;
        assert!((dropped - 0.25).abs() < 0.01, "dropped {dropped}");
        assert!(m.iter().all(|&x| x == 0.0 || x == 1.0 / 0.75));
        // The expectation is kept: mean(m) ≈ 1.
        let mean = m.iter().map(|&x| x as f64).sum::<f64>() / m.len() as f64;
        assert!((mean - 1.0).abs() < 0.015, "mean {mean}");
    }

    #[test]
    fn masks_replay_per_pass_and_differ_between_adapters_and_passes() {
        let a = dropout_mask(0.5, 11, 0, 64);
        assert_eq!(a, dropout_mask(0.5, 11, 0, 64));
        assert_ne!(a, dropout_mask(0.5, 11, 1, 64));
        assert_ne!(a, dropout_mask(0.5, 12, 0, 64));
        assert!(dropout_mask(0.0, 11, 0, 64).iter().all(|&x| x == 1.0));
    }

    #[test]
    fn a_pass_applies_only_while_its_guard_lives() {
        let switch = AdapterSwitch::new(true);
        let pass = DropoutPass::new(switch.clone(), 5, 1);
        assert_eq!(switch.dropout_pass(), None);
        {
            let _on = pass.apply();
            assert_eq!(switch.dropout_pass(), Some(pass.key));
        }
        assert_eq!(switch.dropout_pass(), None);
        assert_ne!(pass.key, DropoutPass::new(switch, 5, 2).key);
    }
}
