//! Scoring responses on the training path: per-token log-probs (and entropies) of right-padded
//! batches, without gradient for old / reference log-probs and metrics, or as one
//! differentiable tensor for the policy loss.

use super::checkpointing::LayerCheckpoints;
use super::chunked_head::{differentiable_entropy, scaled_logits, ChunkEntropy, ChunkedHead};
use super::visual::{VisualInjection, NOT_PROMPT};
use super::Qwen3;
use crate::error::{ModelError, Result};
use crate::image::ProcessedImage;
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use std::sync::Arc;

/// One sequence to score: `log p(response[i] | prompt ++ response[..i])` at a temperature.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreRequest {
    /// Prompt ids, each image already expanded to its run of image tokens.
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    pub temperature: f64,
    /// The prompt's images, in the order their tokens appear (Qwen3-VL only).
    pub images: Vec<Arc<ProcessedImage>>,
}

impl ScoreRequest {
    /// A text-only request.
    pub fn text(prompt_ids: Vec<u32>, response_ids: Vec<u32>, temperature: f64) -> Self {
        Self {
            prompt_ids,
            response_ids,
            temperature,
            images: Vec::new(),
        }
    }
}

/// Response log-probs of a batch: `[R]` f32 over every response token, request after request.
pub struct BatchLogprobs {
    pub logprobs: Tensor,
    /// Per-token entropy `[R]`, when asked for.
    pub entropy: Option<Tensor>,
    /// Response length of each request.
    pub lens: Vec<usize>,
    /// With the head chunked over the response rows, its part of the backward.
    pub head: Option<ChunkedHead>,
    /// With gradient checkpointing, the layers' part of the backward.
    pub checkpoints: Option<LayerCheckpoints>,
}

impl BatchLogprobs {
    /// The gradients of `loss` (built from these log-probs and entropies) for every weight,
    /// through the recomputed layers when the forward was checkpointed.
    pub fn backward(&self, loss: &Tensor) -> candle_core::Result<GradStore> {
        self.backward_with(loss, |_, _| Ok(()))
    }

    /// [`BatchLogprobs::backward`], calling `layer_done(l, grads)` as soon as decoder layer
    /// `l`'s weight gradients are complete — with checkpointing, from the last layer to the
    /// first while the backward goes on, so they can be reduce-scattered and dropped; without,
    /// never (the caller handles every gradient at the end).
    pub fn backward_with(
        &self,
        loss: &Tensor,
        layer_done: impl FnMut(usize, &mut GradStore) -> candle_core::Result<()>,
    ) -> candle_core::Result<GradStore> {
        let mut grads = loss.backward()?;
        if let Some(h) = &self.head {
            h.backward(&mut grads)?;
        }
        if let Some(c) = &self.checkpoints {
            c.backward_with(&mut grads, layer_done)?;
        }
        Ok(grads)
    }
}

/// Per request: response log-probs, and entropies (empty when not asked for).
pub type LogprobsAndEntropy = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Which per-token entropies [`Qwen3::response_logprobs`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entropy {
    None,
    /// Values only (a metric): one extra fused pass, no gradient.
    Value,
    /// With a gradient (an entropy bonus in the loss): the slower differentiable path.
    Differentiable,
}

/// The final hidden states of a batch's response positions `[R, D]`, with their target ids,
/// temperatures and, when checkpointed, the layers' backward.
struct ResponseRows {
    rows: Tensor,
    targets: Vec<u32>,
    temps: Vec<f32>,
    checkpoints: Option<LayerCheckpoints>,
}

/// Padded tokens (batch × longest sequence) per training-path forward while scoring.
const SCORE_BATCH_TOKENS: usize = 8192;

/// Logit elements materialised at once while scoring without gradient (512 MB in f32).
const SCORE_LOGIT_ELEMENTS: usize = 1 << 27;

impl Qwen3 {
    /// Per-token log-probabilities of each request's response, in request order. Requests are
    /// batched (right-padded) through the training path, so these are the numbers training sees.
    pub fn score_batch(&self, requests: &[ScoreRequest]) -> Result<Vec<Vec<f32>>> {
        Ok(self.score_batch_inner(requests, false)?.0)
    }

    /// [`Qwen3::score_batch`] plus the entropy of the temperature-scaled distribution at every
    /// response position, from the same pass over the vocabulary.
    pub fn score_batch_with_entropy(
        &self,
        requests: &[ScoreRequest],
    ) -> Result<LogprobsAndEntropy> {
        self.score_batch_inner(requests, true)
    }

    fn score_batch_inner(
        &self,
        requests: &[ScoreRequest],
        with_entropy: bool,
    ) -> Result<LogprobsAndEntropy> {
        for (i, r) in requests.iter().enumerate() {
            if r.prompt_ids.is_empty() || r.response_ids.is_empty() {
                return Err(ModelError::InvalidInput(format!(
                    "request {i}: scoring needs at least one prompt token and one response token"
                )));
            }
            if !(r.temperature > 0.0 && r.temperature.is_finite()) {
                return Err(ModelError::InvalidInput(format!(
                    "request {i}: temperature must be a positive number, got {}",
                    r.temperature
                )));
            }
            let ids: Vec<u32> = r
                .prompt_ids
                .iter()
                .chain(&r.response_ids)
                .copied()
                .collect();
            self.validate_ids(&ids, &format!("request {i}"))?;
            self.validate_images(&r.prompt_ids, &r.images, &format!("request {i}"))?;
        }
        let (mut out, mut entropies) = (Vec::with_capacity(requests.len()), Vec::new());
        let mut start = 0;
        while start < requests.len() {
            let len = |r: &ScoreRequest| r.prompt_ids.len() + r.response_ids.len();
            let mut end = start + 1;
            let mut longest = len(&requests[start]);
            while end < requests.len() {
                let l = longest.max(len(&requests[end]));
                if l * (end - start + 1) > SCORE_BATCH_TOKENS {
                    break;
                }
                longest = l;
                end += 1;
            }
            let (lp, h) = self.score_padded(&requests[start..end], longest, with_entropy)?;
            out.extend(lp);
            entropies.extend(h);
            start = end;
        }
        Ok((out, entropies))
    }

    /// Log-probs (and entropies, when asked, else none) of one padded batch.
    fn score_padded(
        &self,
        batch: &[ScoreRequest],
        longest: usize,
        with_entropy: bool,
    ) -> Result<LogprobsAndEntropy> {
        let ResponseRows {
            rows,
            targets,
            temps,
            ..
        } = self.response_hidden(batch, longest, false)?;
        let chunk = (SCORE_LOGIT_ELEMENTS / self.config.vocab_size).max(1);
        let (mut flat, mut flat_h) = (Vec::with_capacity(targets.len()), Vec::new());
        let mut start = 0;
        while start < targets.len() {
            let n = chunk.min(targets.len() - start);
            let logits = scaled_logits(
                &rows.narrow(0, start, n)?,
                &self.lm_head,
                &temps[start..start + n],
            )?;
            let (lp, h) =
                oxrl_nn::logprob_entropy(&logits, &targets[start..start + n], with_entropy)?;
            flat.extend(lp);
            flat_h.extend(h);
            start += n;
        }
        let (mut out, mut entropies) = (Vec::with_capacity(batch.len()), Vec::new());
        let mut at = 0;
        for r in batch {
            let n = r.response_ids.len();
            out.push(flat[at..at + n].to_vec());
            if with_entropy {
                entropies.push(flat_h[at..at + n].to_vec());
            }
            at += n;
        }
        Ok((out, entropies))
    }

    /// The final hidden state each response token is chosen from — the position before it —
    /// for every response token of the batch, request after request: `[R, D]` on the training
    /// path (gradients reach the weights). What a value head reads (verl's critic takes
    /// `values[:, -len-1:-1]`).
    pub fn response_states(&self, batch: &[ScoreRequest]) -> Result<Tensor> {
        let longest = batch
            .iter()
            .map(|r| r.prompt_ids.len() + r.response_ids.len())
            .max()
            .unwrap_or(0);
        Ok(self.response_hidden(batch, longest, false)?.rows)
    }

    /// Final hidden states of every response position of the batch, gathered into `[R, D]`
    /// (R = all response tokens, request after request), with the target ids and each row's
    /// temperature. One right-padded forward over the batch; with `checkpoint`, one that keeps
    /// only the layer boundaries, and what its backward needs.
    fn response_hidden(
        &self,
        batch: &[ScoreRequest],
        longest: usize,
        checkpoint: bool,
    ) -> Result<ResponseRows> {
        let mut ids = Vec::with_capacity(batch.len() * longest);
        for r in batch {
            if r.prompt_ids.is_empty() || r.response_ids.is_empty() {
                return Err(ModelError::InvalidInput(
                    "scoring needs at least one prompt token and one response token".into(),
                ));
            }
            ids.extend(&r.prompt_ids);
            ids.extend(&r.response_ids);
            ids.resize(
                ids.len() + longest - r.prompt_ids.len() - r.response_ids.len(),
                0,
            );
        }
        let (hidden, checkpoints) = match self
            .vision
            .as_ref()
            .filter(|_| batch.iter().any(|r| !r.images.is_empty()))
        {
            None => {
                let input = Tensor::from_vec(ids, (batch.len(), longest), &self.device)?;
                self.training_hidden(&input, None, None, checkpoint)?
            }
            Some(vision) => {
                let mut positions = Vec::with_capacity(ids.len());
                let mut locate = Vec::with_capacity(ids.len());
                for (b, r) in batch.iter().enumerate() {
                    let grids: Vec<[usize; 3]> = r.images.iter().map(|i| i.grid_thw).collect();
                    positions.extend(vision.tokens.sequence_positions(
                        &r.prompt_ids,
                        r.response_ids.len(),
                        &grids,
                    )?);
                    positions.resize((b + 1) * longest, [0; 3]);
                    locate.extend(&r.prompt_ids);
                    locate.resize((b + 1) * longest, NOT_PROMPT);
                }
                let images: Vec<&ProcessedImage> = batch
                    .iter()
                    .flat_map(|r| r.images.iter().map(|i| &**i))
                    .collect();
                let visual =
                    VisualInjection::new(vision, &locate, &images, &self.device, checkpoint)?;
                let input = Tensor::from_vec(ids, (batch.len(), longest), &self.device)?;
                self.training_hidden(&input, Some(&positions), Some(&visual), checkpoint)?
            }
        };
        let mut rows = Vec::with_capacity(batch.len());
        let (mut targets, mut temps) = (Vec::new(), Vec::new());
        for (b, r) in batch.iter().enumerate() {
            rows.push(
                hidden
                    .get(b)?
                    .narrow(0, r.prompt_ids.len() - 1, r.response_ids.len())?,
            );
            targets.extend(&r.response_ids);
            temps.extend(std::iter::repeat_n(
                r.temperature as f32,
                r.response_ids.len(),
            ));
        }
        Ok(ResponseRows {
            rows: Tensor::cat(&rows, 0)?,
            targets,
            temps,
            checkpoints,
        })
    }

    /// [`Qwen3::forward_hidden_with`], checkpointed per layer when asked.
    fn training_hidden(
        &self,
        input: &Tensor,
        positions: Option<&[[u32; 3]]>,
        visual: Option<&VisualInjection>,
        checkpoint: bool,
    ) -> candle_core::Result<(Tensor, Option<LayerCheckpoints>)> {
        if !checkpoint {
            return Ok((self.forward_hidden_with(input, positions, visual)?, None));
        }
        let weights = self
            .named_parameters()
            .iter()
            .chain(&self.adapter_parameters())
            .map(|(_, t)| t.id())
            .chain([self.lm_head.id()])
            .collect();
        let (hidden, checkpoints) =
            self.model
                .forward_checkpointed(&self.config, input, positions, visual, weights)?;
        Ok((hidden, Some(checkpoints)))
    }

    /// Response log-probs of the whole batch as one differentiable `[R]` tensor (the training
    /// path: gradients reach every weight), requests one after another, through the fused
    /// vocabulary kernel; plus per-token entropies of the temperature-scaled distribution as
    /// `entropy` asks.
    pub fn response_logprobs(
        &self,
        batch: &[ScoreRequest],
        entropy: Entropy,
    ) -> Result<BatchLogprobs> {
        let longest = batch
            .iter()
            .map(|r| r.prompt_ids.len() + r.response_ids.len())
            .max()
            .unwrap_or(0);
        // LoRA dropout draws this forward's masks (a checkpointed backward replays them).
        let dropout = self.begin_dropout_pass();
        let masks_on = dropout.as_ref().map(|d| d.apply());
        let ResponseRows {
            rows,
            targets,
            temps,
            mut checkpoints,
        } = self.response_hidden(batch, longest, self.gradient_checkpointing)?;
        drop(masks_on);
        if let Some(c) = &mut checkpoints {
            c.dropout = dropout;
        }
        let lens = batch.iter().map(|r| r.response_ids.len()).collect();
        let chunk = (self.logit_chunk_elements / self.config.vocab_size).max(1);
        if targets.len() > chunk {
            let mode = match entropy {
                Entropy::None => ChunkEntropy::None,
                Entropy::Value => ChunkEntropy::Value,
                Entropy::Differentiable => ChunkEntropy::Differentiable,
            };
            let (logprobs, entropy, head) =
                ChunkedHead::forward(rows, &self.lm_head, targets, temps, chunk, mode)?;
            return Ok(BatchLogprobs {
                logprobs,
                entropy,
                lens,
                head: Some(head),
                checkpoints,
            });
        }
        let logits = scaled_logits(&rows, &self.lm_head, &temps)?;
        let logprobs = oxrl_nn::target_logprobs(&logits, &targets)?;
        let entropy = match entropy {
            Entropy::None => None,
            Entropy::Value => {
                let h = oxrl_nn::logprob_entropy(&logits.detach(), &targets, true)?.1;
                Some(Tensor::from_vec(h, targets.len(), &self.device)?)
            }
            Entropy::Differentiable => Some(differentiable_entropy(&logits)?),
        };
        Ok(BatchLogprobs {
            logprobs,
            entropy,
            lens,
            head: None,
            checkpoints,
        })
    }
}
