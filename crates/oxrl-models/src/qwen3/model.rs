//! `Qwen3Model`: the decoder body — token embedding, the layers, the final norm — on the
//! training path (right-padded batches, causal attention, every op with a backward).

use super::decoder_layer::DecoderLayer;
use super::rms_norm::RmsNorm;
use super::rotary::rope_tables;
use super::visual::VisualInjection;
use crate::config::Qwen3Config;
use crate::error::Result;
use crate::weights::{take, Module, Slot};
use candle_core::Tensor;
use std::collections::HashMap;

pub struct Qwen3Model {
    pub embed_tokens: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
}

/// The body's weights under their names relative to its prefix (`model.`).
pub(crate) const EMBED_TOKENS: &str = "embed_tokens.weight";
const NORM: &str = "norm.";

/// The prefix of layer `l`'s weights relative to the body.
fn layer_prefix(prefix: &str, l: usize) -> String {
    format!("{prefix}layers.{l}.")
}

impl Qwen3Model {
    /// Every layer weight's full name and slot, layer after layer, then the final norm's (the
    /// embedding is drawn first, by the caller). Random initialisation draws in this order.
    pub(crate) fn layer_slots(c: &Qwen3Config, prefix: &str) -> Vec<(String, Slot)> {
        let mut out: Vec<(String, Slot)> = (0..c.num_hidden_layers)
            .flat_map(|l| DecoderLayer::slots(c, &layer_prefix(prefix, l)))
            .collect();
        out.extend(
            RmsNorm::slots(&c.hidden_size)
                .into_iter()
                .map(|s| (format!("{prefix}{NORM}{}", s.name), s)),
        );
        out
    }

    /// Takes the body's weights, under `prefix`, out of a checkpoint's tensors.
    pub(crate) fn load(
        c: &Qwen3Config,
        prefix: &str,
        t: &mut HashMap<String, Tensor>,
    ) -> Result<Self> {
        let embed_tokens = take(
            t,
            &format!("{prefix}{EMBED_TOKENS}"),
            &[c.vocab_size, c.hidden_size],
        )?;
        let layers = (0..c.num_hidden_layers)
            .map(|l| DecoderLayer::load(c, &layer_prefix(prefix, l), t))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&c.hidden_size, &format!("{prefix}{NORM}"), t)?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
        })
    }

    /// Appends every weight under its checkpoint name, in transformers' order.
    pub(crate) fn push_named(
        &self,
        c: &Qwen3Config,
        prefix: &str,
        out: &mut Vec<(String, Tensor)>,
    ) {
        out.push((format!("{prefix}{EMBED_TOKENS}"), self.embed_tokens.clone()));
        for (l, layer) in self.layers.iter().enumerate() {
            layer.push_named(c, &layer_prefix(prefix, l), out);
        }
        self.norm
            .push_named(&c.hidden_size, &format!("{prefix}{NORM}"), out);
    }

    pub(crate) fn map(&self, f: &impl Fn(&Tensor) -> Tensor) -> Self {
        Self {
            embed_tokens: f(&self.embed_tokens),
            layers: self.layers.iter().map(|l| l.map(f)).collect(),
            norm: self.norm.map(f),
        }
    }

    /// Final-norm hidden states `[B, S, D]` for right-padded `input_ids` `[B, S]` under causal
    /// attention (a real token only sees earlier positions, so padding after it changes
    /// nothing), with per-token `(T, H, W)` positions (`[B·S]`, row after row; default `0..S`
    /// on every axis) and the batch's images written over its image tokens.
    pub(crate) fn forward(
        &self,
        c: &Qwen3Config,
        input_ids: &Tensor,
        positions: Option<&[[u32; 3]]>,
        visual: Option<&VisualInjection>,
    ) -> candle_core::Result<Tensor> {
        let frame = self.frame(c, input_ids, positions)?;
        let mut x = self.embed(c, input_ids, visual)?;
        for l in 0..self.layers.len() {
            x = self.layer(c, l, &x, &frame, visual)?;
        }
        self.norm.forward(&x, c.rms_norm_eps)
    }

    /// The rotary tables and causal mask of a `[B, S]` batch.
    pub(crate) fn frame(
        &self,
        c: &Qwen3Config,
        input_ids: &Tensor,
        positions: Option<&[[u32; 3]]>,
    ) -> candle_core::Result<Frame> {
        let (b, s) = input_ids.dims2()?;
        let (dtype, device) = (self.embed_tokens.dtype(), self.embed_tokens.device());
        let hd = c.head_dim;
        let (cos, sin) = match positions {
            // Per-row tables [B, S, hd]: they broadcast over the heads like the shared [S, hd].
            Some(p) => {
                let (cos, sin) = rope_tables(c, p, dtype, device)?;
                (cos.reshape((b, s, hd))?, sin.reshape((b, s, hd))?)
            }
            None => {
                let p: Vec<[u32; 3]> = (0..s as u32).map(|i| [i; 3]).collect();
                rope_tables(c, &p, dtype, device)?
            }
        };
        let mask: Vec<f32> = (0..s)
            .flat_map(|i| (0..s).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, s, s), device)?;
        Ok(Frame { cos, sin, mask })
    }

    /// The token embeddings `[B, S, D]` of `input_ids`, images written over their tokens.
    pub(crate) fn embed(
        &self,
        c: &Qwen3Config,
        input_ids: &Tensor,
        visual: Option<&VisualInjection>,
    ) -> candle_core::Result<Tensor> {
        let (b, s) = input_ids.dims2()?;
        let mut x = self
            .embed_tokens
            .index_select(&input_ids.flatten_all()?, 0)?;
        if let Some(v) = visual {
            x = v.write_embeds(&x)?;
        }
        x.reshape((b, s, c.hidden_size))
    }

    /// Layer `l` over `x [B, S, D]`, then its DeepStack feature when it has one.
    pub(crate) fn layer(
        &self,
        c: &Qwen3Config,
        l: usize,
        x: &Tensor,
        frame: &Frame,
        visual: Option<&VisualInjection>,
    ) -> candle_core::Result<Tensor> {
        let (b, s, d) = x.dims3()?;
        let x = self.layers[l].forward(c, x, &frame.cos, &frame.sin, &frame.mask)?;
        match visual.filter(|v| l < v.deepstack.len()) {
            Some(v) => v
                .add_deepstack(&x.reshape((b * s, d))?, l)?
                .reshape((b, s, d)),
            None => Ok(x),
        }
    }
}

/// What every layer of one batch's forward shares: rotary tables and the causal mask.
pub(crate) struct Frame {
    pub cos: Tensor,
    pub sin: Tensor,
    pub mask: Tensor,
}
