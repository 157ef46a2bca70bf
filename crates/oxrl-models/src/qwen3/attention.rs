//! `Qwen3Attention`: grouped-query attention with per-head RMSNorm on queries and keys before
//! the rotary embedding.

use super::lora::{project, Adapter};
use crate::config::Qwen3Config;
use crate::ops::{rms_norm, rope};
use crate::weights::{Init, Module, Slot};
use candle_core::{DType, Tensor, D};

pub struct Attention {
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    /// LoRA adapters of q, k, v and o ([`super::lora`]).
    pub lora: [Option<Adapter>; 4],
}

impl Module<6> for Attention {
    type Config = Qwen3Config;

    fn slots(c: &Qwen3Config) -> [Slot; 6] {
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (h, kv) = (c.num_attention_heads, c.num_key_value_heads);
        [
            Slot::new("q_proj.weight", &[h * hd, d], Init::Normal),
            Slot::new("k_proj.weight", &[kv * hd, d], Init::Normal),
            Slot::new("v_proj.weight", &[kv * hd, d], Init::Normal),
            Slot::new("o_proj.weight", &[d, h * hd], Init::Normal),
            Slot::new("q_norm.weight", &[hd], Init::Ones),
            Slot::new("k_norm.weight", &[hd], Init::Ones),
        ]
    }

    fn from_weights([q_proj, k_proj, v_proj, o_proj, q_norm, k_norm]: [Tensor; 6]) -> Self {
        Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            lora: Default::default(),
        }
    }

    fn weights(&self) -> [&Tensor; 6] {
        [
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.q_norm,
            &self.k_norm,
        ]
    }
}

impl Attention {
    /// Q, K (normed and rotated) and V for rows `xn [.., S, D]` → `[.., S, heads, hd]`; the
    /// inference path attends over them with its KV cache.
    pub(crate) fn qkv(
        &self,
        c: &Qwen3Config,
        xn: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let mut shape = xn.dims().to_vec();
        shape.pop();
        let split = |t: Tensor, heads: usize| {
            let mut s = shape.clone();
            s.extend([heads, hd]);
            t.reshape(s)
        };
        let [q_lora, k_lora, v_lora, _] = &self.lora;
        let q = split(project(xn, &self.q_proj, q_lora.as_ref())?, h)?;
        let k = split(project(xn, &self.k_proj, k_lora.as_ref())?, kv)?;
        let v = split(project(xn, &self.v_proj, v_lora.as_ref())?, kv)?;
        // cos/sin are [S, hd]; heads sit between S and hd.
        let (cos, sin) = (cos.unsqueeze(D::Minus2)?, sin.unsqueeze(D::Minus2)?);
        let q = rope(&rms_norm(&q, &self.q_norm, c.rms_norm_eps)?, &cos, &sin)?;
        let k = rope(&rms_norm(&k, &self.k_norm, c.rms_norm_eps)?, &cos, &sin)?;
        Ok((q, k, v))
    }

    /// The output projection of attended rows `[.., heads·hd]`.
    pub(crate) fn project_out(&self, attn: &Tensor) -> candle_core::Result<Tensor> {
        project(attn, &self.o_proj, self.lora[3].as_ref())
    }

    /// The training path: attention of normed rows `xn [B, S, D]` under the additive `mask`
    /// `[1, 1, S, S]`, scores and softmax in f32, projected out → `[B, S, D]`.
    pub(crate) fn forward(
        &self,
        c: &Qwen3Config,
        xn: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (b, s, _) = xn.dims3()?;
        let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (q, k, v) = self.qkv(c, xn, cos, sin)?;
        let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
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
            .broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(xn.dtype())?;
        let attn = probs
            .matmul(&v.contiguous()?)?
            .transpose(1, 2)?
            .reshape((b, s, h * hd))?;
        self.project_out(&attn)
    }
}
