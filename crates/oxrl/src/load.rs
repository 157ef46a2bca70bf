//! Loading what a command needs from a model reference: the weights in the chosen compute dtype,
//! the tokenizer when the checkpoint has one, and the ids that end generation.

use anyhow::{Context, Result};
use candle_core::DType;
use oxrl_models::{
    eos_token_ids, hub::resolve_model, load_policy, DeviceSpec, PolicyModel, Tokenizer,
};
use std::path::PathBuf;
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

/// The model a command runs: `--model`, and `--adapter` on top of it.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// Model directory or Hugging Face hub id.
    #[arg(long)]
    pub model: String,
    /// A PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`) to
    /// apply to the model, unmerged.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
}

/// Loads the model `args` names, with its PEFT LoRA adapter (if any) applied unmerged: the
/// adapter's product runs beside each frozen weight's.
pub fn load(args: &ModelArgs, dtype: DTypeArg, device: DeviceSpec) -> Result<Loaded> {
    let (reference, adapter) = (&args.model, args.adapter.as_deref());
    let dir = resolve_model(reference)?;
    let device = device.open()?;
    let mut model = load_policy(&dir, dtype.dtype(), &device)
        .with_context(|| format!("loading model {}", dir.display()))?;
    if let Some(adapter) = adapter {
        model
            .load_adapter(adapter)
            .with_context(|| format!("loading LoRA adapter {}", adapter.display()))?;
    }
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
