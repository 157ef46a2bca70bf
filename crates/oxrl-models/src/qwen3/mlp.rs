//! `Qwen3MLP`: the SwiGLU feed-forward block.

use crate::config::Qwen3Config;
use crate::ops::linear;
use crate::weights::{Init, Module, Slot};
use candle_core::Tensor;

pub struct Mlp {
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

impl Module<3> for Mlp {
    type Config = Qwen3Config;

    fn slots(c: &Qwen3Config) -> [Slot; 3] {
        let (d, i) = (c.hidden_size, c.intermediate_size);
        [
            Slot::new("gate_proj.weight", &[i, d], Init::Normal),
            Slot::new("up_proj.weight", &[i, d], Init::Normal),
            Slot::new("down_proj.weight", &[d, i], Init::Normal),
        ]
    }

    fn from_weights([gate_proj, up_proj, down_proj]: [Tensor; 3]) -> Self {
        Self {
            gate_proj,
            up_proj,
            down_proj,
        }
    }

    fn weights(&self) -> [&Tensor; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

impl Mlp {
    /// `down(silu(gate(xn)) * up(xn))` for normed rows `xn`.
    pub fn forward(&self, xn: &Tensor) -> candle_core::Result<Tensor> {
        let gate = candle_nn::ops::silu(&linear(xn, &self.gate_proj)?)?;
        let up = linear(xn, &self.up_proj)?;
        linear(&(gate * up)?, &self.down_proj)
    }
}
