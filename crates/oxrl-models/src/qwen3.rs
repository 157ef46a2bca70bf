//! Qwen3 decoder (`Qwen3ForCausalLM`), per qwen3-vl-spec §1.
//!
//! The forward pass here is built only from candle primitives that carry a backward
//! (no candle-nn fused rms_norm / rope / softmax_last_dim, which silently drop gradients),
//! so the same code serves scoring and training.

use crate::checkpoint::load_tensors;
use crate::config::Qwen3Config;
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor, D};
use std::collections::HashMap;
use std::path::Path;

pub struct Layer {
    pub input_layernorm: Tensor,
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    pub post_attention_layernorm: Tensor,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

pub struct Qwen3 {
    pub config: Qwen3Config,
    pub embed_tokens: Tensor,
    pub layers: Vec<Layer>,
    pub norm: Tensor,
    /// `lm_head.weight` when the checkpoint has it, otherwise the (tied) embedding.
    pub lm_head: Tensor,
    pub dtype: DType,
    pub device: Device,
}

fn take(map: &mut HashMap<String, Tensor>, name: &str, shape: &[usize]) -> Result<Tensor> {
    let t = map
        .remove(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    if t.dims() != shape {
        return Err(ModelError::TensorShape {
            name: name.to_string(),
            got: t.dims().to_vec(),
            expected: shape.to_vec(),
        });
    }
    Ok(t)
}

/// `weight * (x / sqrt(mean(x²) + eps))`, statistics in f32, cast back before the weight multiply.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&inv)?
        .to_dtype(dtype)?
        .broadcast_mul(weight)
}

/// Half-split (NeoX) rotary embedding: `x*cos + rotate_half(x)*sin`.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// `x · wᵀ` for `x` of any rank.
fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.broadcast_matmul(&w.t()?)
}

impl Qwen3 {
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let config = Qwen3Config::from_file(&dir.join("config.json"))?;
        let tensors = load_tensors(dir, dtype, device)?;
        Self::from_tensors(config, tensors, dtype, device)
    }

    pub fn from_tensors(
        config: Qwen3Config,
        mut t: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let c = &config;
        let (d, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (h, kv) = (c.num_attention_heads, c.num_key_value_heads);
        let embed_tokens = take(&mut t, "model.embed_tokens.weight", &[c.vocab_size, d])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                input_layernorm: take(&mut t, &format!("{p}.input_layernorm.weight"), &[d])?,
                q_proj: take(
                    &mut t,
                    &format!("{p}.self_attn.q_proj.weight"),
                    &[h * hd, d],
                )?,
                k_proj: take(
                    &mut t,
                    &format!("{p}.self_attn.k_proj.weight"),
                    &[kv * hd, d],
                )?,
                v_proj: take(
                    &mut t,
                    &format!("{p}.self_attn.v_proj.weight"),
                    &[kv * hd, d],
                )?,
                o_proj: take(
                    &mut t,
                    &format!("{p}.self_attn.o_proj.weight"),
                    &[d, h * hd],
                )?,
                q_norm: take(&mut t, &format!("{p}.self_attn.q_norm.weight"), &[hd])?,
                k_norm: take(&mut t, &format!("{p}.self_attn.k_norm.weight"), &[hd])?,
                post_attention_layernorm: take(
                    &mut t,
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[d],
                )?,
                gate_proj: take(&mut t, &format!("{p}.mlp.gate_proj.weight"), &[i, d])?,
                up_proj: take(&mut t, &format!("{p}.mlp.up_proj.weight"), &[i, d])?,
                down_proj: take(&mut t, &format!("{p}.mlp.down_proj.weight"), &[d, i])?,
            });
        }
        let norm = take(&mut t, "model.norm.weight", &[d])?;
        let lm_head = match t.remove("lm_head.weight") {
            Some(w) => w,
            None => embed_tokens.clone(),
        };
        Ok(Self {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            dtype,
            device: device.clone(),
        })
    }

    /// cos/sin tables `[S, hd]` for positions `0..seq_len`, computed in f32.
    fn rope_tables(&self, seq_len: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let hd = self.config.head_dim;
        let theta = self.config.rope_theta;
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / (theta as f32).powf(2.0 * i as f32 / hd as f32))
            .collect();
        let inv = Tensor::from_vec(inv_freq, (1, hd / 2), &self.device)?;
        let pos = Tensor::arange(0u32, seq_len as u32, &self.device)?
            .to_dtype(DType::F32)?
            .reshape((seq_len, 1))?;
        let freqs = pos.broadcast_mul(&inv)?;
        let emb = Tensor::cat(&[&freqs, &freqs], 1)?;
        Ok((
            emb.cos()?.to_dtype(self.dtype)?,
            emb.sin()?.to_dtype(self.dtype)?,
        ))
    }

    /// Logits `[B, S, vocab]` for right-padded `input_ids` `[B, S]` under causal attention:
    /// a real token only sees earlier positions, so padding after it cannot change its logits.
    pub fn forward(&self, input_ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s) = input_ids.dims2()?;
        let c = &self.config;
        let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (cos, sin) = self.rope_tables(s)?;
        let mask: Vec<f32> = (0..s)
            .flat_map(|i| (0..s).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, s, s), &self.device)?;
        let mut x = self
            .embed_tokens
            .index_select(&input_ids.flatten_all()?, 0)?
            .reshape((b, s, c.hidden_size))?;
        for layer in &self.layers {
            let r = x.clone();
            let xn = rms_norm(&x, &layer.input_layernorm, c.rms_norm_eps)?;
            let q = linear(&xn, &layer.q_proj)?.reshape((b, s, h, hd))?;
            let k = linear(&xn, &layer.k_proj)?.reshape((b, s, kv, hd))?;
            let v = linear(&xn, &layer.v_proj)?.reshape((b, s, kv, hd))?;
            let q = rms_norm(&q, &layer.q_norm, c.rms_norm_eps)?.transpose(1, 2)?;
            let k = rms_norm(&k, &layer.k_norm, c.rms_norm_eps)?.transpose(1, 2)?;
            let q = rope(&q, &cos, &sin)?;
            let k = rope(&k, &cos, &sin)?;
            let v = v.transpose(1, 2)?;
            let n_rep = h / kv;
            let (k, v) = if n_rep == 1 {
                (k, v)
            } else {
                let rep = |t: Tensor| -> candle_core::Result<Tensor> {
                    t.unsqueeze(2)?
                        .broadcast_as((b, kv, n_rep, s, hd))?
                        .reshape((b, h, s, hd))
                };
                (rep(k)?, rep(v)?)
            };
            let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * (hd as f64).powf(-0.5))?
                .to_dtype(DType::F32)?
                .broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(self.dtype)?;
            let attn = probs
                .matmul(&v.contiguous()?)?
                .transpose(1, 2)?
                .reshape((b, s, h * hd))?;
            x = (r + linear(&attn, &layer.o_proj)?)?;
            let r = x.clone();
            let xn = rms_norm(&x, &layer.post_attention_layernorm, c.rms_norm_eps)?;
            let gate = candle_nn::ops::silu(&linear(&xn, &layer.gate_proj)?)?;
            let up = linear(&xn, &layer.up_proj)?;
            x = (r + linear(&(gate * up)?, &layer.down_proj)?)?;
        }
        let x = rms_norm(&x, &self.norm, c.rms_norm_eps)?;
        linear(&x, &self.lm_head)
    }

    /// `log p(response[i] | prompt ++ response[..i])` under logits divided by `temperature`.
    pub fn score(
        &self,
        prompt_ids: &[u32],
        response_ids: &[u32],
        temperature: f64,
    ) -> candle_core::Result<Vec<f32>> {
        if prompt_ids.is_empty() || response_ids.is_empty() {
            return Err(candle_core::Error::Msg(
                "scoring needs at least one prompt token and one response token".into(),
            ));
        }
        let ids: Vec<u32> = prompt_ids.iter().chain(response_ids).copied().collect();
        let input = Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?;
        let logits = self.forward(&input)?.squeeze(0)?;
        let p = prompt_ids.len();
        let logits = logits
            .narrow(0, p - 1, response_ids.len())?
            .to_dtype(DType::F32)?;
        let logits = (logits / temperature)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let targets = Tensor::new(response_ids, &self.device)?.unsqueeze(1)?;
        logp.gather(&targets, 1)?.squeeze(1)?.to_vec1::<f32>()
    }
}
