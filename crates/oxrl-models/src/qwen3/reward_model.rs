//! `Qwen3ForSequenceClassification` as a reward model: the Qwen3 decoder plus a bias-free
//! `score` head (`score.weight [num_labels, hidden]`) read at one token per sequence — the
//! rightmost token whose id is not `pad_token_id` (transformers' rule; the last token when the
//! config has no `pad_token_id`). Scoring runs the training path's forward on plain tensors, so
//! no autograd graph is built.

use super::Qwen3;
use crate::checkpoint::{load_tensors, save_checkpoint, MAX_SHARD_BYTES};
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::path::Path;

pub const ARCHITECTURE: &str = "Qwen3ForSequenceClassification";

pub struct Qwen3RewardModel {
    pub model: Qwen3,
    /// `[num_labels, hidden]`.
    pub score: Tensor,
    pub num_labels: usize,
    pub pad_token_id: Option<u32>,
}

/// `num_labels` as transformers reads it: the key, else the size of `id2label`, else 2.
fn num_labels(config: &Value) -> usize {
    config
        .get("num_labels")
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .or_else(|| {
            config
                .get("id2label")
                .and_then(Value::as_object)
                .map(|m| m.len())
        })
        .unwrap_or(2)
}

impl Qwen3RewardModel {
    /// Loads a sequence-classification checkpoint; a checkpoint whose `architectures` names
    /// another model, or without `score.weight`, is an error naming the file.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config_json: Value = crate::config::read_json(&config_path)?;
        if let Some(archs) = config_json.get("architectures").and_then(Value::as_array) {
            if !archs.iter().any(|a| a.as_str() == Some(ARCHITECTURE)) {
                return Err(ModelError::ConfigKey {
                    path: config_path,
                    key: "architectures".into(),
                    expected: format!("{ARCHITECTURE} for a reward model, got {archs:?}"),
                });
            }
        }
        let mut tensors = load_tensors(dir, dtype, device)?;
        let score = tensors
            .remove("score.weight")
            .ok_or_else(|| ModelError::MissingTensor("score.weight".into()))?;
        let model = Qwen3::from_tensors(config_json, &config_path, tensors, dtype, device)?;
        Self::new(model, score)
    }

    /// A model and its head; `num_labels` and `pad_token_id` come from the model's config.
    pub fn new(model: Qwen3, score: Tensor) -> Result<Self> {
        let num_labels = num_labels(&model.config_json);
        let want = [num_labels, model.config.hidden_size];
        if score.dims() != want {
            return Err(ModelError::TensorShape {
                name: "score.weight".into(),
                got: score.dims().to_vec(),
                expected: want.to_vec(),
            });
        }
        let pad_token_id = model
            .config_json
            .get("pad_token_id")
            .and_then(Value::as_u64)
            .map(|p| p as u32);
        Ok(Self {
            model,
            score,
            num_labels,
            pad_token_id,
        })
    }

    /// Writes a Hugging Face checkpoint directory (atomically, via the project's save path):
    /// the decoder's weights, `score.weight`, and the config with `architectures` set.
    pub fn save(&self, out: &Path, copy_from: Option<&Path>) -> Result<()> {
        let mut config = self.model.config_json.clone();
        config["architectures"] = serde_json::json!([ARCHITECTURE]);
        config["num_labels"] = self.num_labels.into();
        config["tie_word_embeddings"] = self.model.tied.into();
        let mut tensors: Vec<(String, Tensor)> = self
            .model
            .named_parameters()
            .into_iter()
            .filter(|(name, _)| name != "lm_head.weight")
            .collect();
        tensors.push(("score.weight".into(), self.score.clone()));
        save_checkpoint(out, &tensors, &config, copy_from, MAX_SHARD_BYTES, &|_| {
            Ok(())
        })
    }

    /// The index transformers reads the head at in a (right-)padded row: the rightmost token
    /// that is not the pad token (0 when every token is), or `len - 1` without a pad token.
    pub fn pooled_index(&self, row: &[u32], len: usize) -> usize {
        match self.pad_token_id {
            Some(pad) => row.iter().rposition(|&t| t != pad).unwrap_or(0),
            None => len.saturating_sub(1),
        }
    }

    /// Scores `[num_labels]` of each sequence, in one right-padded forward.
    pub fn score_batch(&self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        if sequences.is_empty() {
            return Ok(Vec::new());
        }
        let max_positions = self.model.config.max_position_embeddings;
        for (i, s) in sequences.iter().enumerate() {
            if s.is_empty() {
                return Err(ModelError::InvalidInput(format!("sequence {i} is empty")));
            }
            if s.len() > max_positions {
                return Err(ModelError::InvalidInput(format!(
                    "sequence {i} has {} tokens, more than the reward model's {max_positions} positions",
                    s.len()
                )));
            }
            self.model.validate_vocab(s, "reward model input")?;
        }
        let width = sequences.iter().map(Vec::len).max().unwrap_or(0);
        let fill = self.pad_token_id.unwrap_or(0);
        let rows: Vec<Vec<u32>> = sequences
            .iter()
            .map(|s| {
                let mut r = s.clone();
                r.resize(width, fill);
                r
            })
            .collect();
        let flat: Vec<u32> = rows.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (rows.len(), width), &self.model.device)?;
        let hidden = self.model.forward_hidden(&ids)?;
        let picked = rows
            .iter()
            .zip(sequences)
            .enumerate()
            .map(|(b, (row, s))| hidden.get(b)?.get(self.pooled_index(row, s.len())))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let pooled = Tensor::stack(&picked, 0)?;
        let logits = pooled.matmul(&self.score.t()?)?.to_dtype(DType::F32)?;
        Ok(logits.to_vec2::<f32>()?)
    }

    /// A random model as transformers initialises one (decoder and head from N(0, 0.02²)).
    /// The config gets `architectures` = [`ARCHITECTURE`] when it names none, so the decoder
    /// saved on its own is still a (headless) classifier checkpoint.
    pub fn random(
        mut config_json: Value,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if let Some(keys) = config_json.as_object_mut() {
            keys.entry("architectures")
                .or_insert_with(|| serde_json::json!([ARCHITECTURE]));
        }
        let model = Qwen3::random(config_json, seed, dtype, device)?;
        let labels = num_labels(&model.config_json);
        // A decoder without layers whose embedding is [labels, hidden]: the same seeded
        // N(0, 0.02²) initialisation as every other matrix.
        let head = Qwen3::random(
            serde_json::json!({
                "vocab_size": labels, "hidden_size": model.config.hidden_size,
                "intermediate_size": 1, "num_hidden_layers": 0, "num_attention_heads": 1,
                "tie_word_embeddings": true,
            }),
            seed ^ 0x5c0e,
            dtype,
            device,
        )?;
        let score = head.model.embed_tokens.contiguous()?;
        Self::new(model, score)
    }

    /// The head applied to one hidden state `[hidden]` → `[num_labels]` (for checks).
    pub fn head(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        Ok(hidden
            .unsqueeze(0)?
            .matmul(&self.score.t()?)?
            .squeeze(0)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?)
    }
}
