//! `Qwen3RMSNorm` as a module: one weight, applied with the hand-written [`crate::ops::rms_norm`].

use crate::ops::rms_norm;
use crate::weights::{Init, Module, Slot};
use candle_core::Tensor;

pub struct RmsNorm {
    pub weight: Tensor,
}

impl Module<1> for RmsNorm {
    /// The normalised width.
    type Config = usize;

    fn slots(&width: &usize) -> [Slot; 1] {
        [Slot::new("weight", &[width], Init::Ones)]
    }

    fn from_weights([weight]: [Tensor; 1]) -> Self {
        Self { weight }
    }

    fn weights(&self) -> [&Tensor; 1] {
        [&self.weight]
    }
}

impl RmsNorm {
    pub fn forward(&self, x: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
        rms_norm(x, &self.weight, eps)
    }
}
