//! `oxrl export`: a plain Hugging Face checkpoint directory from a model, with a PEFT LoRA
//! adapter folded in (`--adapter DIR --merge`: `W + s·B·A` per adapted projection), which
//! anything that loads the base model loads: transformers, vLLM, `oxrl` itself.

use crate::load::DTypeArg;
use crate::output::say;
use anyhow::{bail, Context, Result};
use oxrl_models::checkpoint::MAX_SHARD_BYTES;
use oxrl_models::{hub::resolve_model, load_policy};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ExportArgs {
    /// Model directory or Hugging Face hub id (the base model of `--adapter`).
    #[arg(long)]
    model: String,
    /// A PEFT LoRA adapter directory to fold into the weights (needs `--merge`).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Fold the adapter into the weights: the exported checkpoint has no adapter.
    #[arg(long)]
    merge: bool,
    /// The checkpoint directory to write (replaced atomically if it exists).
    #[arg(long)]
    output: PathBuf,
    /// The exported weights' dtype; the merge itself is computed in f32.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
}

pub fn run(args: ExportArgs) -> Result<()> {
    match (&args.adapter, args.merge) {
        (Some(_), false) => bail!(
            "--adapter needs --merge: a plain checkpoint has no place for an adapter (the \
             adapter directory itself is already in PEFT's format)"
        ),
        (None, true) => bail!("--merge needs --adapter DIR: the adapter to fold in"),
        _ => {}
    }
    let dir = resolve_model(&args.model)?;
    let device = candle_core::Device::Cpu;
    let mut model = load_policy(&dir, args.dtype.dtype(), &device)
        .with_context(|| format!("loading model {}", dir.display()))?;
    if let Some(adapter) = &args.adapter {
        model
            .load_adapter(adapter)
            .with_context(|| format!("loading LoRA adapter {}", adapter.display()))?;
        model.merge_adapters()?;
    }
    model
        .save_with(&args.output, Some(&dir), MAX_SHARD_BYTES, &|_| Ok(()))
        .with_context(|| format!("writing {}", args.output.display()))?;
    say!("wrote {}", args.output.display())?;
    Ok(())
}
