//! A Qwen3 checkpoint as one GGUF file that llama.cpp (and everything built on it: Ollama,
//! LM Studio, llama-cpp-python) runs: the `qwen3` architecture's metadata, the tokenizer and
//! chat template, and the weights under llama.cpp's tensor names in f32, f16, bf16 or Q8_0.
//! Norm weights stay f32 and a matrix whose rows are not whole Q8_0 blocks falls back to f16,
//! as llama.cpp's own converter does.

mod format;
mod quant;
mod vocab;

pub use format::GgmlType;

use crate::decoder::Decoder;
use crate::error::{io_err, ExportError, Result};
use crate::tensors::CheckpointTensors;
use crate::write_file_atomically;
use format::{pad_to_alignment, write_head, MetaValue, TensorInfo};
use std::io::Write;
use std::path::Path;

/// The file's weight encoding (`general.file_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufDtype {
    F32,
    F16,
    BF16,
    Q8_0,
}

impl GgufDtype {
    /// llama.cpp's `llama_ftype`.
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q8_0 => 7,
            Self::BF16 => 32,
        }
    }

    /// The encoding of a tensor with PyTorch shape `shape`.
    fn tensor_type(self, shape: &[usize]) -> GgmlType {
        let row = shape.last().copied().unwrap_or(0);
        match (self, shape.len()) {
            (_, 1) | (Self::F32, _) => GgmlType::F32,
            (Self::F16, _) => GgmlType::F16,
            (Self::BF16, _) => GgmlType::BF16,
            (Self::Q8_0, _) if row % quant::Q8_0_BLOCK == 0 => GgmlType::Q8_0,
            (Self::Q8_0, _) => GgmlType::F16,
        }
    }
}

/// What was written.
#[derive(Debug)]
pub struct GgufSummary {
    pub tensors: usize,
    pub bytes: u64,
}

/// One tensor to write: its GGUF name, its checkpoint name and PyTorch shape.
struct Planned {
    gguf: String,
    hf: String,
    shape: Vec<usize>,
}

/// Writes the Qwen3 checkpoint in `dir` as the GGUF file `output` (atomically: a crash leaves no
/// file under that name). `progress(done, total)` is called after each tensor.
pub fn export(
    dir: &Path,
    output: &Path,
    dtype: GgufDtype,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<GgufSummary> {
    let decoder = Decoder::read(dir)?;
    if decoder.vision {
        return Err(ExportError::Unsupported(format!(
            "{}: GGUF export writes Qwen3 text checkpoints; this is Qwen3-VL (llama.cpp runs its \
             vision tower from a separate mmproj file, which oxrl does not write yet). Export it \
             with --format onnx.",
            dir.display()
        )));
    }
    decoder.refuse_attention_bias(dir)?;
    let tensors = CheckpointTensors::open(dir)?;
    let plan = plan(&decoder, &tensors)?;
    let mut infos = Vec::with_capacity(plan.len());
    let mut offset = 0u64;
    for t in &plan {
        let ggml_type = dtype.tensor_type(&t.shape);
        infos.push(TensorInfo {
            name: t.gguf.clone(),
            dims: t.shape.iter().rev().map(|d| *d as u64).collect(),
            ggml_type,
            offset,
        });
        offset = pad_to_alignment(offset + ggml_type.bytes(t.shape.iter().product()) as u64);
    }
    let mut metadata = architecture_metadata(&decoder, dir, dtype);
    metadata.extend(vocab::metadata(dir, decoder.config.vocab_size)?);

    let bytes = write_file_atomically(output, &mut |file| {
        let mut w = std::io::BufWriter::new(file);
        let err = io_err(output);
        let mut written = write_head(&mut w, &metadata, &infos).map_err(&err)?;
        for (i, (t, info)) in plan.iter().zip(&infos).enumerate() {
            let data = quant::encode(&tensors.read_f32(&t.hf)?, info.ggml_type);
            w.write_all(&data).map_err(&err)?;
            let padded = pad_to_alignment(data.len() as u64);
            w.write_all(&vec![0u8; (padded - data.len() as u64) as usize])
                .map_err(&err)?;
            written += padded;
            progress(i + 1, plan.len());
        }
        w.flush().map_err(&err)?;
        Ok(written)
    })?;
    Ok(GgufSummary {
        tensors: plan.len(),
        bytes,
    })
}

/// Every weight under its llama.cpp name, shapes checked against the config.
fn plan(decoder: &Decoder, tensors: &CheckpointTensors) -> Result<Vec<Planned>> {
    let c = &decoder.config;
    let mut plan = Vec::new();
    let mut add = |gguf: String, hf: String, shape: Vec<usize>| -> Result<()> {
        tensors.shape_of(&hf, &shape)?;
        plan.push(Planned { gguf, hf, shape });
        Ok(())
    };
    let vocab = [c.vocab_size, c.hidden_size];
    add(
        "token_embd.weight".into(),
        decoder.embed_tokens(),
        vocab.to_vec(),
    )?;
    for layer in 0..c.num_hidden_layers {
        for (part, shape) in decoder.layer_parts() {
            let gguf = format!("blk.{layer}.{}.weight", gguf_layer_name(part));
            add(gguf, decoder.layer(layer, part), shape)?;
        }
    }
    add(
        "output_norm.weight".into(),
        decoder.final_norm(),
        vec![c.hidden_size],
    )?;
    if !c.tie_word_embeddings {
        add("output.weight".into(), decoder.lm_head(), vocab.to_vec())?;
    }
    Ok(plan)
}

/// llama.cpp's name (`LLM_TENSOR_NAMES`) of a Qwen3 layer weight.
fn gguf_layer_name(part: &str) -> &'static str {
    match part {
        "input_layernorm.weight" => "attn_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        "self_attn.q_norm.weight" => "attn_q_norm",
        "self_attn.k_norm.weight" => "attn_k_norm",
        "post_attention_layernorm.weight" => "ffn_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        _ => "ffn_down",
    }
}

/// `general.*` and `qwen3.*` keys, as `convert_hf_to_gguf.py` writes them for Qwen3.
fn architecture_metadata(
    decoder: &Decoder,
    dir: &Path,
    dtype: GgufDtype,
) -> Vec<(String, MetaValue)> {
    let c = &decoder.config;
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    let u32_of = |n: usize| MetaValue::U32(n as u32);
    let mut meta = vec![
        ("general.architecture", MetaValue::Str("qwen3".into())),
        ("general.name", MetaValue::Str(name)),
        ("general.file_type", MetaValue::U32(dtype.file_type())),
        ("qwen3.context_length", u32_of(c.max_position_embeddings)),
        ("qwen3.embedding_length", u32_of(c.hidden_size)),
        ("qwen3.feed_forward_length", u32_of(c.intermediate_size)),
        ("qwen3.block_count", u32_of(c.num_hidden_layers)),
        ("qwen3.attention.head_count", u32_of(c.num_attention_heads)),
        (
            "qwen3.attention.head_count_kv",
            u32_of(c.num_key_value_heads),
        ),
        ("qwen3.attention.key_length", u32_of(c.head_dim)),
        ("qwen3.attention.value_length", u32_of(c.head_dim)),
        ("qwen3.rope.freq_base", MetaValue::F32(c.rope_theta as f32)),
        (
            "qwen3.attention.layer_norm_rms_epsilon",
            MetaValue::F32(c.rms_norm_eps as f32),
        ),
    ];
    if dtype == GgufDtype::Q8_0 {
        meta.push(("general.quantization_version", MetaValue::U32(2)));
    }
    meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}
