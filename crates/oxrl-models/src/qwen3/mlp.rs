//! `Qwen3MLP`: the SwiGLU feed-forward block.

use super::lora::{project, Adapter};
use crate::config::Qwen3Config;
use crate::weights::{Init, Module, Slot};
use candle_core::Tensor;

pub struct Mlp {
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
    /// LoRA adapters of gate, up and down ([`super::lora`]).
    pub lora: [Option<Adapter>; 3],
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
            lora: Default::default(),
        }
    }

    fn weights(&self) -> [&Tensor; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

impl Mlp {
    /// `down(silu(gate(xn)) * up(xn))` for normed rows `xn`.
    pub fn forward(&self, xn: &Tensor) -> candle_core::Result<Tensor> {
        let [gate_lora, up_lora, down_lora] = &self.lora;
        let gate = candle_nn::ops::silu(&project(xn, &self.gate_proj, gate_lora.as_ref())?)?;
        let up = project(xn, &self.up_proj, up_lora.as_ref())?;
        project(&(gate * up)?, &self.down_proj, down_lora.as_ref())
    }
}
