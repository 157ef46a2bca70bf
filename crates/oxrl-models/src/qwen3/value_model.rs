//! PPO's critic: the Qwen3 (or Qwen3-VL) decoder plus a bias-free `score` head `[1, hidden]`
//! read at every response position. `V_t` is read at the hidden state *before* response token
//! `t` — the state the token is chosen from — as verl's critic takes `values[:, -len-1:-1]`.
//!
//! Saved as transformers' `Qwen3ForTokenClassification` with one label, the class verl loads
//! critics as; loading the policy's checkpoint instead starts a fresh head.

use super::Qwen3;
use crate::checkpoint::{load_tensors, save_checkpoint, MAX_SHARD_BYTES};
use crate::error::{ModelError, Result};
use crate::ScoreRequest;
use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;
use std::path::Path;

pub const ARCHITECTURE: &str = "Qwen3ForTokenClassification";

/// The head's checkpoint name.
pub const HEAD: &str = "score.weight";

pub struct Qwen3ValueModel {
    pub model: Qwen3,
    /// `[1, hidden]`.
    pub head: Tensor,
}

impl Qwen3ValueModel {
    /// A value model from `dir`: a saved one (with `score.weight`) as it is, or any Qwen3 /
    /// Qwen3-VL checkpoint — the policy's, usually — with a head drawn from `seed` as
    /// transformers initialises a new `score` layer (N(0, initializer_range²)). A language
    /// model's `lm_head` is not loaded: a critic never reads logits.
    pub fn load(dir: &Path, dtype: DType, device: &Device, seed: u64) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config_json: Value = crate::config::read_json(&config_path)?;
        let mut tensors = load_tensors(dir, dtype, device)?;
        // Without it the decoder takes the embedding as its (unused) head.
        tensors.remove(super::causal_lm::LM_HEAD);
        let head = tensors.remove(HEAD);
        let model = Qwen3::from_tensors(config_json, &config_path, tensors, dtype, device)?;
        let head = match head {
            Some(h) => h,
            None => fresh_head(&model, seed, dtype, device)?,
        };
        let want = [1, model.config.hidden_size];
        if head.dims() != want {
            return Err(ModelError::TensorShape {
                name: format!("{} {HEAD}", dir.display()),
                got: head.dims().to_vec(),
                expected: want.to_vec(),
            });
        }
        Ok(Self { model, head })
    }

    /// Turns the decoder's weights and the head into `Var`s a backward reaches; returns them by
    /// checkpoint name (the head last).
    pub fn make_trainable(&mut self) -> Result<Vec<(String, Var)>> {
        let mut vars = self.model.make_trainable()?;
        let head = Var::from_tensor(&self.head)?;
        self.head = head.as_tensor().clone();
        vars.push((HEAD.to_string(), head));
        Ok(vars)
    }

    /// `V_t` of every response token of the batch, request after request, as one f32 `[R]`
    /// tensor on the training path (differentiable).
    pub fn values(&self, batch: &[ScoreRequest]) -> Result<Tensor> {
        let states = self.model.response_states(batch)?;
        Ok(states
            .matmul(&self.head.t()?)?
            .squeeze(1)?
            .to_dtype(DType::F32)?)
    }

    /// Writes a `Qwen3ForTokenClassification` checkpoint directory (one label) atomically.
    pub fn save(&self, out: &Path) -> Result<()> {
        let mut config = self.model.config_json.clone();
        config["architectures"] = serde_json::json!([ARCHITECTURE]);
        config["num_labels"] = 1.into();
        config["tie_word_embeddings"] = true.into();
        let mut tensors: Vec<(String, Tensor)> = self
            .model
            .named_parameters()
            .into_iter()
            .filter(|(name, _)| name != super::causal_lm::LM_HEAD)
            .collect();
        tensors.push((HEAD.into(), self.head.clone()));
        save_checkpoint(out, &tensors, &config, None, MAX_SHARD_BYTES, &|_| Ok(()))
    }
}

/// A `[1, hidden]` head from N(0, initializer_range²) (0.02 by default), drawn from `seed`: a
/// decoder without layers whose one-token embedding is the head.
fn fresh_head(model: &Qwen3, seed: u64, dtype: DType, device: &Device) -> Result<Tensor> {
    let range = model
        .config_json
        .get("initializer_range")
        .and_then(Value::as_f64)
        .unwrap_or(0.02);
    let head = Qwen3::random(
        serde_json::json!({
            "vocab_size": 1, "hidden_size": model.config.hidden_size,
            "intermediate_size": 1, "num_hidden_layers": 0, "num_attention_heads": 1,
            "tie_word_embeddings": true, "initializer_range": range,
        }),
        seed ^ 0xc417,
        dtype,
        device,
    )?;
    Ok(head.model.embed_tokens.contiguous()?)
}
