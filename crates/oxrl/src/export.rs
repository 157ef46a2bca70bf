//! `oxrl export`: a model for deployment. `--format hf` (the default) writes a plain Hugging Face
//! checkpoint directory, with a PEFT LoRA adapter folded in (`--adapter DIR --merge`:
//! `W + s·B·A` per adapted projection), which anything that loads the base model loads:
//! transformers, vLLM, TensorRT-LLM, `oxrl` itself. `--format gguf` writes one file for
//! llama.cpp; `--format onnx` a directory for onnxruntime (see `oxrl_export`).

use crate::output::say;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use oxrl_export::{gguf, onnx};
use oxrl_models::checkpoint::MAX_SHARD_BYTES;
use oxrl_models::{hub::resolve_model, load_policy};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A Hugging Face checkpoint directory (safetensors).
    Hf,
    /// One GGUF file (llama.cpp, Ollama, LM Studio).
    Gguf,
    /// An ONNX model directory with a KV cache (onnxruntime, optimum); Qwen3-VL adds the vision
    /// tower as `vision.onnx`.
    Onnx,
}

/// The exported weights' precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportDtype {
    F32,
    F16,
    Bf16,
    /// 8-bit blocks of 32 with an f16 scale (GGUF only).
    #[value(name = "q8_0")]
    Q8_0,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// Model directory or Hugging Face hub id (the base model of `--adapter`).
    #[arg(long)]
    model: String,
    /// A PEFT LoRA adapter directory to fold into the weights (needs `--merge`).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Fold the adapter into the weights: the exported model has no adapter.
    #[arg(long)]
    merge: bool,
    /// What to write.
    #[arg(long, value_enum, default_value = "hf")]
    format: Format,
    /// The checkpoint directory (hf, onnx) or file (gguf) to write; replaced atomically if it
    /// exists.
    #[arg(long)]
    output: PathBuf,
    /// The exported weights' dtype; merges are computed in f32. ONNX computes in f32 whatever
    /// the stored dtype.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: ExportDtype,
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
    if args.dtype == ExportDtype::Q8_0 && args.format != Format::Gguf {
        bail!(
            "--dtype q8_0 is a GGUF encoding; --format {:?} takes f32, f16 or bf16",
            args.format
        );
    }
    let dir = resolve_model(&args.model)?;
    if args.format == Format::Hf {
        return write_checkpoint(
            &dir,
            args.adapter.as_deref(),
            &args.output,
            hf_dtype(args.dtype),
        );
    }
    // An adapter is folded into a full-precision checkpoint first, which is then converted.
    let merged = match &args.adapter {
        Some(adapter) => {
            let staging = staging_dir(&args.output)?;
            write_checkpoint(&dir, Some(adapter), &staging, DType::F32)?;
            Some(staging)
        }
        None => None,
    };
    let source = merged.as_deref().unwrap_or(&dir);
    let converted = convert(source, &args);
    if let Some(staging) = &merged {
        let _ = std::fs::remove_dir_all(staging);
    }
    converted
}

fn convert(source: &Path, args: &ExportArgs) -> Result<()> {
    let mut progress = |done: usize, total: usize| {
        eprint!("\r{} {done}/{total}", progress_label(args.format));
        if done == total {
            eprintln!();
        }
    };
    match args.format {
        Format::Gguf => {
            let dtype = match args.dtype {
                ExportDtype::F32 => gguf::GgufDtype::F32,
                ExportDtype::F16 => gguf::GgufDtype::F16,
                ExportDtype::Bf16 => gguf::GgufDtype::BF16,
                ExportDtype::Q8_0 => gguf::GgufDtype::Q8_0,
            };
            let summary = gguf::export(source, &args.output, dtype, &mut progress)
                .with_context(|| format!("exporting {} as GGUF", source.display()))?;
            say!(
                "wrote {} ({} tensors, {:.1} MB)",
                args.output.display(),
                summary.tensors,
                summary.bytes as f64 / 1e6
            )?;
        }
        Format::Onnx => {
            let dtype = match args.dtype {
                ExportDtype::F16 => onnx::WeightDtype::F16,
                ExportDtype::Bf16 => onnx::WeightDtype::BF16,
                _ => onnx::WeightDtype::F32,
            };
            let summary = onnx::export(source, &args.output, dtype, &mut progress)
                .with_context(|| format!("exporting {} as ONNX", source.display()))?;
            let graphs = match summary.vision {
                true => format!("{} and {}", onnx::MODEL_FILE, onnx::VISION_FILE),
                false => onnx::MODEL_FILE.to_string(),
            };
            say!(
                "wrote {} ({graphs}; {} decoder layers, {:.1} MB of weights)",
                args.output.display(),
                summary.layers,
                summary.weight_bytes as f64 / 1e6,
            )?;
        }
        Format::Hf => write_checkpoint(source, None, &args.output, hf_dtype(args.dtype))?,
    }
    Ok(())
}

fn progress_label(format: Format) -> &'static str {
    match format {
        Format::Gguf => "tensors",
        _ => "layers",
    }
}

fn hf_dtype(dtype: ExportDtype) -> DType {
    match dtype {
        ExportDtype::F16 => DType::F16,
        ExportDtype::Bf16 => DType::BF16,
        _ => DType::F32,
    }
}

/// A hidden sibling of `output` for the merged checkpoint that is converted.
fn staging_dir(output: &Path) -> Result<PathBuf> {
    let name = output
        .file_name()
        .with_context(|| format!("--output {}: not a file name", output.display()))?;
    let parent = output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    Ok(parent.join(format!(
        ".{}.merged-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// The model (with `adapter` merged) as a Hugging Face checkpoint directory at `output`.
fn write_checkpoint(dir: &Path, adapter: Option<&Path>, output: &Path, dtype: DType) -> Result<()> {
    let device = candle_core::Device::Cpu;
    let mut model = load_policy(dir, dtype, &device)
        .with_context(|| format!("loading model {}", dir.display()))?;
    if let Some(adapter) = adapter {
        model
            .load_adapter(adapter)
            .with_context(|| format!("loading LoRA adapter {}", adapter.display()))?;
        model.merge_adapters()?;
    }
    model
        .save_with(output, Some(dir), MAX_SHARD_BYTES, &|_| Ok(()))
        .with_context(|| format!("writing {}", output.display()))?;
    say!("wrote {}", output.display())?;
    Ok(())
}
