//! `Qwen3DecoderLayer`: pre-norm attention and MLP blocks, each added to the residual stream.

use super::attention::Attention;
use super::lora::map_adapters;
use super::mlp::Mlp;
use super::rms_norm::RmsNorm;
use crate::config::Qwen3Config;
use crate::error::Result;
use crate::weights::{Module, Slot};
use candle_core::Tensor;
use std::collections::HashMap;

pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
}

/// The layer's parts under their checkpoint names, in transformers' `named_parameters()` order.
const SELF_ATTN: &str = "self_attn.";
const MLP: &str = "mlp.";
const INPUT_LAYERNORM: &str = "input_layernorm.";
const POST_ATTENTION_LAYERNORM: &str = "post_attention_layernorm.";

impl DecoderLayer {
    /// Every weight of a layer under `prefix` (`model.layers.{i}.`): full name and slot.
    pub(crate) fn slots(c: &Qwen3Config, prefix: &str) -> Vec<(String, Slot)> {
        let full = |part: &str, slots: &[Slot]| -> Vec<(String, Slot)> {
            slots
                .iter()
                .map(|s| (format!("{prefix}{part}{}", s.name), s.clone()))
                .collect()
        };
        [
            full(SELF_ATTN, &Attention::slots(c)),
            full(MLP, &Mlp::slots(c)),
            full(INPUT_LAYERNORM, &RmsNorm::slots(&c.hidden_size)),
            full(POST_ATTENTION_LAYERNORM, &RmsNorm::slots(&c.hidden_size)),
        ]
        .concat()
    }

    pub(crate) fn load(
        c: &Qwen3Config,
        prefix: &str,
        t: &mut HashMap<String, Tensor>,
    ) -> Result<Self> {
        let d = c.hidden_size;
        Ok(Self {
            self_attn: Attention::load(c, &format!("{prefix}{SELF_ATTN}"), t)?,
            mlp: Mlp::load(c, &format!("{prefix}{MLP}"), t)?,
            input_layernorm: RmsNorm::load(&d, &format!("{prefix}{INPUT_LAYERNORM}"), t)?,
            post_attention_layernorm: RmsNorm::load(
                &d,
                &format!("{prefix}{POST_ATTENTION_LAYERNORM}"),
                t,
            )?,
        })
    }

    pub(crate) fn push_named(
        &self,
        c: &Qwen3Config,
        prefix: &str,
        out: &mut Vec<(String, Tensor)>,
    ) {
        let d = c.hidden_size;
        self.self_attn
            .push_named(c, &format!("{prefix}{SELF_ATTN}"), out);
        self.mlp.push_named(c, &format!("{prefix}{MLP}"), out);
        self.input_layernorm
            .push_named(&d, &format!("{prefix}{INPUT_LAYERNORM}"), out);
        self.post_attention_layernorm.push_named(
            &d,
            &format!("{prefix}{POST_ATTENTION_LAYERNORM}"),
            out,
        );
    }

    pub(crate) fn map(&self, f: &impl Fn(&Tensor) -> Tensor) -> Self {
        Self {
            self_attn: Attention {
                lora: map_adapters(&self.self_attn.lora, f),
                ..self.self_attn.map(f)
            },
            mlp: Mlp {
                lora: map_adapters(&self.mlp.lora, f),
                ..self.mlp.map(f)
            },
            input_layernorm: self.input_layernorm.map(f),
            post_attention_layernorm: self.post_attention_layernorm.map(f),
        }
    }

    /// The training path: `x [B, S, D]` through attention (under `mask`) and the MLP.
    pub(crate) fn forward(
        &self,
        c: &Qwen3Config,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let xn = self.input_layernorm.forward(x, c.rms_norm_eps)?;
        let x = (x + self.self_attn.forward(c, &xn, cos, sin, mask)?)?;
        self.mlp_residual(c, &x)
    }

    /// The residual stream after the MLP block: `x + mlp(post_attention_layernorm(x))`.
    pub(crate) fn mlp_residual(&self, c: &Qwen3Config, x: &Tensor) -> candle_core::Result<Tensor> {
        let xn = self.post_attention_layernorm.forward(x, c.rms_norm_eps)?;
        x + self.mlp.forward(&xn)?
    }
}
