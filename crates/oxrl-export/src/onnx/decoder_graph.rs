//! The Qwen3 decoder as an ONNX graph with a KV cache, in optimum's and onnxruntime-genai's
//! layout: inputs `input_ids`, `attention_mask` (every position so far, past and new),
//! `position_ids` and `past_key_values.{i}.key|value` `[batch, kv_heads, past, head_dim]`;
//! outputs `logits` `[batch, seq, vocab]` and `present.{i}.key|value` (the past with this
//! call's positions appended). Computation is f32 (the transformers forward, op for op).
//!
//! Qwen3-VL's decoder takes, besides, `image_embeds` `[n, hidden]` (the vision graph's output
//! for every image and video pad token of the batch, in sequence order), written over those
//! tokens' embeddings, and `deepstack_embeds` `[k, n, hidden]`, added to them after decoder
//! layer i < k; its `position_ids` are MRoPE's `[3, batch, seq]` (T, H, W).

use super::graph::{Attr, Dim, Graph};
use super::ops::{self, Weights};
use super::proto::DataType;
use crate::decoder::Decoder;
use crate::error::Result;
use std::io::Write;

/// What a Qwen3-VL decoder adds: the pad tokens images replace and the DeepStack depth.
pub struct VisualInputs {
    pub image_token_id: i64,
    pub video_token_id: i64,
    pub deepstack: usize,
}

/// Values the whole graph shares.
struct Shared {
    /// `[batch, 1, seq, total]`: 0 where a query may attend, f32's lowest where not.
    mask: String,
    /// `[batch, 1, seq, head_dim]`.
    cos: String,
    sin: String,
    /// `[n, 2]` (batch, position) of every image or video pad token (Qwen3-VL).
    visual_positions: Option<String>,
}

pub(super) struct DecoderGraph<'a, W: Write> {
    g: Graph<W>,
    decoder: &'a Decoder,
    weights: Weights<'a>,
    visual: Option<VisualInputs>,
}

impl<'a, W: Write> DecoderGraph<'a, W> {
    pub fn new(
        g: Graph<W>,
        decoder: &'a Decoder,
        weights: Weights<'a>,
        visual: Option<VisualInputs>,
    ) -> Self {
        Self {
            g,
            decoder,
            weights,
            visual,
        }
    }

    /// Builds the graph; `progress(done, total)` after each layer's weights are written.
    pub fn build(mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<Graph<W>> {
        let c = self.decoder.config.clone();
        let (layers, kv_heads, head_dim) = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim);
        let kv_dims = |len: &'static str| {
            [
                Dim::Named("batch_size"),
                Dim::Fixed(kv_heads),
                Dim::Named(len),
                Dim::Fixed(head_dim),
            ]
        };
        let seq = [Dim::Named("batch_size"), Dim::Named("sequence_length")];
        self.g.input("input_ids", DataType::Int64, &seq);
        self.g.input(
            "attention_mask",
            DataType::Int64,
            &[
                Dim::Named("batch_size"),
                Dim::Named("total_sequence_length"),
            ],
        );
        match &self.visual {
            None => self.g.input("position_ids", DataType::Int64, &seq),
            Some(v) => {
                self.g.input(
                    "position_ids",
                    DataType::Int64,
                    &[
                        Dim::Fixed(3),
                        Dim::Named("batch_size"),
                        Dim::Named("sequence_length"),
                    ],
                );
                let n = Dim::Named("num_visual_tokens");
                self.g.input(
                    "image_embeds",
                    DataType::Float,
                    &[n, Dim::Fixed(c.hidden_size)],
                );
                if v.deepstack > 0 {
                    self.g.input(
                        "deepstack_embeds",
                        DataType::Float,
                        &[
                            Dim::Fixed(v.deepstack),
                            Dim::Named("num_visual_tokens"),
                            Dim::Fixed(c.hidden_size),
                        ],
                    );
                }
            }
        }
        for i in 0..layers {
            for kind in ["key", "value"] {
                let name = format!("past_key_values.{i}.{kind}");
                self.g
                    .input(&name, DataType::Float, &kv_dims("past_sequence_length"));
            }
        }

        let shared = self.shared();
        let embed_shape = [c.vocab_size, c.hidden_size];
        let embed = self.weight(&self.decoder.embed_tokens(), &embed_shape)?;
        let mut hidden = self.g.op("Gather", &[&embed, "input_ids"], vec![]);
        if let Some(at) = &shared.visual_positions {
            hidden = self
                .g
                .op("ScatterND", &[&hidden, at, "image_embeds"], vec![]);
        }
        let deepstack = self.visual.as_ref().map_or(0, |v| v.deepstack);
        for layer in 0..layers {
            hidden = self.layer(layer, &hidden, &shared)?;
            if let (Some(at), true) = (&shared.visual_positions, layer < deepstack) {
                hidden = self.add_deepstack(&hidden, at, layer);
            }
            progress(layer + 1, layers);
        }
        let norm = self.weight(&self.decoder.final_norm(), &[c.hidden_size])?;
        let hidden = self.rms_norm(&hidden, &norm);
        let lm_head = match c.tie_word_embeddings {
            true => embed,
            false => self.weight(&self.decoder.lm_head(), &embed_shape)?,
        };
        let logits = ops::linear(&mut self.g, &hidden, &lm_head);
        self.g.node("Identity", &[&logits], &["logits"], vec![]);
        self.g.output(
            "logits",
            DataType::Float,
            &[
                Dim::Named("batch_size"),
                Dim::Named("sequence_length"),
                Dim::Fixed(c.vocab_size),
            ],
        );
        for i in 0..layers {
            for kind in ["key", "value"] {
                let name = format!("present.{i}.{kind}");
                self.g
                    .output(&name, DataType::Float, &kv_dims("total_sequence_length"));
            }
        }
        Ok(self.g)
    }

    fn weight(&mut self, name: &str, shape: &[usize]) -> Result<String> {
        self.weights.load(&mut self.g, name, shape, shape)
    }

    /// `h[visual] += deepstack_embeds[layer]`.
    fn add_deepstack(&mut self, hidden: &str, at: &str, layer: usize) -> String {
        let g = &mut self.g;
        let k = g.const_i64(&[layer as i64], true);
        let feature = g.op(
            "Gather",
            &["deepstack_embeds", &k],
            vec![Attr::Int("axis", 0)],
        );
        let current = g.op("GatherND", &[hidden, at], vec![]);
        let sum = g.op("Add", &[&current, &feature], vec![]);
        g.op("ScatterND", &[hidden, at, &sum], vec![])
    }

    /// `x · rsqrt(mean(x², last axis) + eps) · w`.
    fn rms_norm(&mut self, x: &str, weight: &str) -> String {
        let eps = self
            .g
            .const_f32(&[self.decoder.config.rms_norm_eps as f32], &[]);
        let sq = self.g.op("Mul", &[x, x], vec![]);
        let mean = self.g.op(
            "ReduceMean",
            &[&sq],
            vec![Attr::Ints("axes", vec![-1]), Attr::Int("keepdims", 1)],
        );
        let var_eps = self.g.op("Add", &[&mean, &eps], vec![]);
        let rms = self.g.op("Sqrt", &[&var_eps], vec![]);
        let inv = self.g.op("Reciprocal", &[&rms], vec![]);
        let normed = self.g.op("Mul", &[x, &inv], vec![]);
        self.g.op("Mul", &[&normed, weight], vec![])
    }

    /// The attention mask, the rotary tables and the visual token positions, computed once
    /// from the inputs.
    fn shared(&mut self) -> Shared {
        let c = &self.decoder.config;
        let g = &mut self.g;
        // Positions: keys 0..total, queries past..total (past = total − seq).
        let one_idx = g.const_i64(&[1], true);
        let zero = g.const_i64(&[0], true);
        let one = g.const_i64(&[1], true);
        let mask_shape = g.op("Shape", &["attention_mask"], vec![]);
        let total = g.op(
            "Gather",
            &[&mask_shape, &one_idx],
            vec![Attr::Int("axis", 0)],
        );
        let ids_shape = g.op("Shape", &["input_ids"], vec![]);
        let seq = g.op(
            "Gather",
            &[&ids_shape, &one_idx],
            vec![Attr::Int("axis", 0)],
        );
        let past = g.op("Sub", &[&total, &seq], vec![]);
        let key_pos = g.op("Range", &[&zero, &total, &one], vec![]);
        let query_pos = g.op("Range", &[&past, &total, &one], vec![]);
        let axis0 = g.const_i64(&[0], false);
        let axis1 = g.const_i64(&[1], false);
        let keys = g.op("Unsqueeze", &[&key_pos, &axis0], vec![]);
        let queries = g.op("Unsqueeze", &[&query_pos, &axis1], vec![]);
        let causal = g.op("LessOrEqual", &[&keys, &queries], vec![]);
        let attend = g.op(
            "Cast",
            &["attention_mask"],
            vec![Attr::Int("to", DataType::Bool as i64)],
        );
        let axes12 = g.const_i64(&[1, 2], false);
        let attend = g.op("Unsqueeze", &[&attend, &axes12], vec![]);
        let allowed = g.op("And", &[&causal, &attend], vec![]);
        let open = g.const_f32(&[0.0], &[]);
        let closed = g.const_f32(&[f32::MIN], &[]);
        let mask = g.op("Where", &[&allowed, &open, &closed], vec![]);

        // RoPE: θ_i = position · base^(−2i/d), the table duplicated as [θ, θ] (transformers'
        // rotate_half layout), inv_freq computed in f32 as transformers does.
        let d = c.head_dim;
        let base = c.rope_theta as f32;
        let inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        let inv_freq = g.const_f32(&inv_freq, &[(d / 2) as i64]);
        let positions = g.op(
            "Cast",
            &["position_ids"],
            vec![Attr::Int("to", DataType::Float as i64)],
        );
        let minus1 = g.const_i64(&[-1], false);
        let positions = g.op("Unsqueeze", &[&positions, &minus1], vec![]);
        let mut freqs = g.op("Mul", &[&positions, &inv_freq], vec![]);
        if let Some(section) = c.mrope_section {
            // Interleaved MRoPE: frequency i follows H if i % 3 == 1 and i < 3·section[1], W
            // if i % 3 == 2 and i < 3·section[2], else T — a one-hot choice per frequency
            // over the three position rows, summed away.
            let axis_of = |i: usize| match i % 3 {
                1 if i < 3 * section[1] => 1,
                2 if i < 3 * section[2] => 2,
                _ => 0,
            };
            let choice: Vec<f32> = (0..3)
                .flat_map(|a| (0..d / 2).map(move |i| (axis_of(i) == a) as u8 as f32))
                .collect();
            let choice = g.const_f32(&choice, &[3, 1, 1, (d / 2) as i64]);
            let chosen = g.op("Mul", &[&freqs, &choice], vec![]);
            freqs = g.op(
                "ReduceSum",
                &[&chosen, &axis0],
                vec![Attr::Int("keepdims", 0)],
            );
        }
        let emb = g.op("Concat", &[&freqs, &freqs], vec![Attr::Int("axis", -1)]);
        let (cos, sin) = ops::cos_sin(g, &emb);
        let cos = g.op("Unsqueeze", &[&cos, &axis1], vec![]);
        let sin = g.op("Unsqueeze", &[&sin, &axis1], vec![]);

        let visual_positions = self.visual.as_ref().map(|v| {
            let image = g.const_i64(&[v.image_token_id], true);
            let video = g.const_i64(&[v.video_token_id], true);
            let is_image = g.op("Equal", &["input_ids", &image], vec![]);
            let is_video = g.op("Equal", &["input_ids", &video], vec![]);
            let visual = g.op("Or", &[&is_image, &is_video], vec![]);
            let at = g.op("NonZero", &[&visual], vec![]);
            g.op("Transpose", &[&at], vec![Attr::Ints("perm", vec![1, 0])])
        });
        Shared {
            mask,
            cos,
            sin,
            visual_positions,
        }
    }

    /// `[batch, seq, heads·d]` → `[batch, heads, seq, d]`, with the per-head RMSNorm when given.
    fn heads(&mut self, x: &str, heads: usize, norm: Option<&str>) -> String {
        let d = self.decoder.config.head_dim as i64;
        let shape = self.g.const_i64(&[0, 0, heads as i64, d], false);
        let mut x = self.g.op("Reshape", &[x, &shape], vec![]);
        if let Some(w) = norm {
            x = self.rms_norm(&x, w);
        }
        self.g.op(
            "Transpose",
            &[&x],
            vec![Attr::Ints("perm", vec![0, 2, 1, 3])],
        )
    }

    /// Each KV head repeated for the query heads that share it: `[b, kv, t, d]` → `[b, h, t, d]`.
    fn repeat_kv(&mut self, x: &str) -> String {
        let c = &self.decoder.config;
        let n_rep = c.num_attention_heads / c.num_key_value_heads;
        if n_rep == 1 {
            return x.to_string();
        }
        let g = &mut self.g;
        let axis2 = g.const_i64(&[2], false);
        let expanded = g.op("Unsqueeze", &[x, &axis2], vec![]);
        let shape = g.op("Shape", &[x], vec![]);
        let (s0, s2, s4) = (
            g.const_i64(&[0], false),
            g.const_i64(&[2], false),
            g.const_i64(&[4], false),
        );
        let lead = g.op("Slice", &[&shape, &s0, &s2], vec![]);
        let tail = g.op("Slice", &[&shape, &s2, &s4], vec![]);
        let rep = g.const_i64(&[n_rep as i64], false);
        let target = g.op("Concat", &[&lead, &rep, &tail], vec![Attr::Int("axis", 0)]);
        let expanded = g.op("Expand", &[&expanded, &target], vec![]);
        let heads = g.const_i64(
            &[0, c.num_attention_heads as i64, -1, c.head_dim as i64],
            false,
        );
        g.op("Reshape", &[&expanded, &heads], vec![])
    }

    fn layer(&mut self, layer: usize, hidden: &str, shared: &Shared) -> Result<String> {
        let c = self.decoder.config.clone();
        let mut w = std::collections::HashMap::new();
        for (part, shape) in self.decoder.layer_parts() {
            let name = self.decoder.layer(layer, part);
            w.insert(part, self.weight(&name, &shape)?);
        }
        let x = self.rms_norm(hidden, &w["input_layernorm.weight"]);
        let q = ops::linear(&mut self.g, &x, &w["self_attn.q_proj.weight"]);
        let k = ops::linear(&mut self.g, &x, &w["self_attn.k_proj.weight"]);
        let v = ops::linear(&mut self.g, &x, &w["self_attn.v_proj.weight"]);
        let q = self.heads(
            &q,
            c.num_attention_heads,
            Some(&w["self_attn.q_norm.weight"]),
        );
        let k = self.heads(
            &k,
            c.num_key_value_heads,
            Some(&w["self_attn.k_norm.weight"]),
        );
        let v = self.heads(&v, c.num_key_value_heads, None);
        let q = ops::rope(&mut self.g, &q, &shared.cos, &shared.sin, c.head_dim);
        let k = ops::rope(&mut self.g, &k, &shared.cos, &shared.sin, c.head_dim);

        let (present_k, present_v) = (
            format!("present.{layer}.key"),
            format!("present.{layer}.value"),
        );
        let past_k = format!("past_key_values.{layer}.key");
        let past_v = format!("past_key_values.{layer}.value");
        self.g.node(
            "Concat",
            &[&past_k, &k],
            &[&present_k],
            vec![Attr::Int("axis", 2)],
        );
        self.g.node(
            "Concat",
            &[&past_v, &v],
            &[&present_v],
            vec![Attr::Int("axis", 2)],
        );
        let keys = self.repeat_kv(&present_k);
        let values = self.repeat_kv(&present_v);

        let g = &mut self.g;
        let keys_t = g.op(
            "Transpose",
            &[&keys],
            vec![Attr::Ints("perm", vec![0, 1, 3, 2])],
        );
        let scores = g.op("MatMul", &[&q, &keys_t], vec![]);
        let scale = g.const_f32(&[1.0 / (c.head_dim as f32).sqrt()], &[]);
        let scores = g.op("Mul", &[&scores, &scale], vec![]);
        let scores = g.op("Add", &[&scores, &shared.mask], vec![]);
        let probs = g.op("Softmax", &[&scores], vec![Attr::Int("axis", -1)]);
        let attn = g.op("MatMul", &[&probs, &values], vec![]);
        let attn = g.op(
            "Transpose",
            &[&attn],
            vec![Attr::Ints("perm", vec![0, 2, 1, 3])],
        );
        let flat = g.const_i64(&[0, 0, (c.num_attention_heads * c.head_dim) as i64], false);
        let attn = g.op("Reshape", &[&attn, &flat], vec![]);
        let attn = ops::linear(g, &attn, &w["self_attn.o_proj.weight"]);
        let hidden = g.op("Add", &[hidden, &attn], vec![]);

        let x = self.rms_norm(&hidden, &w["post_attention_layernorm.weight"]);
        let g = &mut self.g;
        let gate = ops::linear(g, &x, &w["mlp.gate_proj.weight"]);
        let up = ops::linear(g, &x, &w["mlp.up_proj.weight"]);
        let act = ops::silu(g, &gate);
        let inner = g.op("Mul", &[&act, &up], vec![]);
        let down = ops::linear(g, &inner, &w["mlp.down_proj.weight"]);
        Ok(g.op("Add", &[&hidden, &down], vec![]))
    }
}
