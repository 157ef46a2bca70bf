//! The LM head and log-probs of a training batch in chunks of response rows: the `[R, vocab]`
//! logits (151,936 columns for Qwen3) are never held for every response token at once, neither
//! in the forward nor in the backward, which recomputes each chunk's logits.
//!
//! The forward computes the log-probs (and entropies) chunk by chunk without a graph and hands
//! them out as leaves, so the loss's `backward()` stops at them; [`ChunkedHead::backward`] then
//! takes each chunk through lm_head and the log-prob kernel again with its graph, collects the
//! gradient of the rows, and sends it into the decoder in one backward from the rows.

use super::checkpointing::merge_into;
use crate::ops::linear;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var, D};

/// Whether entropies come out of the chunked head, and with a gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChunkEntropy {
    None,
    Value,
    Differentiable,
}

/// A batch's chunked head, ready for its backward.
pub struct ChunkedHead {
    /// The final hidden states of the response positions `[R, D]`, with their graph.
    rows: Tensor,
    lm_head: Tensor,
    targets: Vec<u32>,
    temps: Vec<f32>,
    chunk: usize,
    /// The log-probs `[R]` handed out, a leaf.
    logprobs: Var,
    /// The differentiable entropies `[R]` handed out, a leaf.
    entropy: Option<Var>,
}

/// `lm_head(rows) / T` per row, in f32.
pub(crate) fn scaled_logits(
    rows: &Tensor,
    lm_head: &Tensor,
    temps: &[f32],
) -> candle_core::Result<Tensor> {
    let logits = linear(rows, lm_head)?.to_dtype(DType::F32)?;
    if temps.iter().all(|&t| t == 1.0) {
        return Ok(logits);
    }
    let t = Tensor::from_slice(temps, (temps.len(), 1), rows.device())?;
    logits.broadcast_div(&t)
}

/// Entropy of each row's softmax, with a gradient: `−Σ p log p`.
pub(crate) fn differentiable_entropy(logits: &Tensor) -> candle_core::Result<Tensor> {
    let logp_all = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()
}

impl ChunkedHead {
    /// Log-probs of `targets` (and entropies as asked) from `rows` in chunks of `chunk` rows.
    /// Returns the log-probs, the entropies and the head for the backward.
    pub(crate) fn forward(
        rows: Tensor,
        lm_head: &Tensor,
        targets: Vec<u32>,
        temps: Vec<f32>,
        chunk: usize,
        entropy: ChunkEntropy,
    ) -> candle_core::Result<(Tensor, Option<Tensor>, ChunkedHead)> {
        let (plain_rows, plain_head) = (rows.detach(), lm_head.detach());
        let (mut logprobs, mut entropies) = (Vec::new(), Vec::new());
        for (start, n) in spans(targets.len(), chunk) {
            let logits = scaled_logits(
                &plain_rows.narrow(0, start, n)?,
                &plain_head,
                &temps[start..start + n],
            )?;
            let targets = &targets[start..start + n];
            match entropy {
                ChunkEntropy::None => logprobs.push(oxrl_nn::target_logprobs(&logits, targets)?),
                ChunkEntropy::Value | ChunkEntropy::Differentiable => {
                    let (lp, h) = oxrl_nn::logprob_entropy(&logits, targets, true)?;
                    let device = logits.device();
                    logprobs.push(Tensor::from_vec(lp, n, device)?);
                    entropies.push(Tensor::from_vec(h, n, device)?);
                }
            }
        }
        let logprobs = Var::from_tensor(&Tensor::cat(&logprobs, 0)?)?;
        let entropies = match entropies.is_empty() {
            true => None,
            false => Some(Tensor::cat(&entropies, 0)?),
        };
        let (entropy_out, entropy_leaf) = match (entropy, entropies) {
            (ChunkEntropy::Differentiable, Some(h)) => {
                let leaf = Var::from_tensor(&h)?;
                (Some(leaf.as_tensor().clone()), Some(leaf))
            }
            (_, h) => (h, None),
        };
        let head = ChunkedHead {
            rows,
            lm_head: lm_head.clone(),
            targets,
            temps,
            chunk,
            logprobs: logprobs.clone(),
            entropy: entropy_leaf,
        };
        Ok((logprobs.as_tensor().clone(), entropy_out, head))
    }

    /// Continues a backward that `loss.backward()` began at the log-prob (and entropy)
    /// leaves: recomputes each chunk's logits with their graph, adds lm_head's gradient to
    /// `grads`, and backpropagates the rows' gradient into the decoder.
    pub fn backward(&self, grads: &mut GradStore) -> candle_core::Result<()> {
        let g_logprobs = grads.remove(self.logprobs.as_tensor());
        let g_entropy = self
            .entropy
            .as_ref()
            .and_then(|h| grads.remove(h.as_tensor()));
        if g_logprobs.is_none() && g_entropy.is_none() {
            return Ok(());
        }
        let plain_rows = self.rows.detach();
        let head_id = self.lm_head.id();
        let mut row_grads = Vec::new();
        for (start, n) in spans(self.targets.len(), self.chunk) {
            let leaf = Var::from_tensor(&plain_rows.narrow(0, start, n)?)?;
            let logits = scaled_logits(
                leaf.as_tensor(),
                &self.lm_head,
                &self.temps[start..start + n],
            )?;
            let mut terms = Vec::new();
            if let Some(g) = &g_logprobs {
                let lp = oxrl_nn::target_logprobs(&logits, &self.targets[start..start + n])?;
                terms.push((lp * g.narrow(0, start, n)?)?.sum_all()?);
            }
            if let Some(g) = &g_entropy {
                let h = differentiable_entropy(&logits)?;
                terms.push((h * g.narrow(0, start, n)?)?.sum_all()?);
            }
            let mut s = terms.remove(0);
            for t in terms {
                s = (s + t)?;
            }
            let step = s.backward()?;
            row_grads.push(match step.get(leaf.as_tensor()) {
                Some(g) => g.clone(),
                None => leaf.as_tensor().zeros_like()?,
            });
            merge_into(grads, step, |id| *id == head_id)?;
        }
        let g_rows = Tensor::cat(&row_grads, 0)?;
        let into_decoder = (&self.rows * g_rows)?.sum_all()?.backward()?;
        grads.extend(into_decoder)
    }
}

/// `(start, len)` of consecutive chunks of at most `chunk` rows over `total` rows.
fn spans(total: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..total)
        .step_by(chunk)
        .map(move |start| (start, chunk.min(total - start)))
}
