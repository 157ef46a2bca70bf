//! Loading what a command needs from a model reference: the weights in the chosen compute dtype,
//! the tokenizer when the checkpoint has one, and the ids that end generation.

use anyhow::{Context, Result};
use candle_core::DType;
use oxrl_models::{
    eos_token_ids, hub::resolve_model, load_policy, DeviceSpec, PolicyModel, Tokenizer,
};
use std::sync::Arc;

/// Compute dtype of the model's forward pass (stored weights are converted on load).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
    F16,
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::F16 => DType::F16,
        }
    }
}

pub struct Loaded {
    pub model: Arc<dyn PolicyModel>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub eos_token_ids: Vec<u32>,
}

pub fn load(reference: &str, dtype: DTypeArg, device: DeviceSpec) -> Result<Loaded> {
    let dir = resolve_model(reference)?;
    let device = device.open()?;
    let model = load_policy(&dir, dtype.dtype(), &device)
        .with_context(|| format!("loading model {}", dir.display()))?;
    let tokenizer = match dir.join("tokenizer.json").exists() {
        true => Some(Arc::new(Tokenizer::from_dir(&dir)?)),
        false => None,
    };
    let eos_token_ids = eos_token_ids(&dir, tokenizer.as_deref())?;
    Ok(Loaded {
        model: Arc::from(model),
        tokenizer,
        eos_token_ids,
    })
}
