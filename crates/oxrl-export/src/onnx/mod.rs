//! A Qwen3 checkpoint as an ONNX model directory that onnxruntime runs with a KV cache:
//! `model.onnx` (the graph, see [`decoder_graph`]), `model.onnx.data` (the weights, external so
//! any size loads), and the checkpoint's `config.json`, generation config and tokenizer files,
//! which is the directory optimum's `ORTModelForCausalLM` loads.

mod decoder_graph;
mod graph;
mod proto;

pub use decoder_graph::WeightDtype;

use crate::decoder::Decoder;
use crate::error::{io_err, ExportError, Result};
use crate::tensors::CheckpointTensors;
use crate::write_dir_atomically;
use decoder_graph::DecoderGraph;
use graph::Graph;
use std::path::Path;

/// The graph file and the weights file it names.
pub const MODEL_FILE: &str = "model.onnx";
pub const DATA_FILE: &str = "model.onnx.data";

/// What was written.
#[derive(Debug)]
pub struct OnnxSummary {
    pub layers: usize,
    pub weight_bytes: u64,
}

/// Writes the Qwen3 checkpoint in `dir` as the ONNX model directory `output` (atomically).
/// `progress(done, total)` is called after each decoder layer.
pub fn export(
    dir: &Path,
    output: &Path,
    dtype: WeightDtype,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<OnnxSummary> {
    let decoder = Decoder::read(dir)?;
    if decoder.vision {
        return Err(ExportError::Unsupported(format!(
            "{}: ONNX export writes Qwen3 text checkpoints; Qwen3-VL (its vision tower as a \
             second graph, its decoder taking image embeddings and MRoPE positions) is not \
             exported yet",
            dir.display()
        )));
    }
    decoder.refuse_attention_bias(dir)?;
    let tensors = CheckpointTensors::open(dir)?;
    write_dir_atomically(output, &mut |tmp| {
        let data_path = tmp.join(DATA_FILE);
        let data = std::fs::File::create(&data_path).map_err(io_err(&data_path))?;
        let graph = Graph::new(std::io::BufWriter::new(data), DATA_FILE);
        let graph =
            DecoderGraph::new(graph, &decoder, &tensors, dtype, &data_path).build(progress)?;
        let (model, data) = graph.finish("qwen3_decoder", env!("CARGO_PKG_VERSION"));
        let data = data
            .into_inner()
            .map_err(|e| io_err(&data_path)(e.into_error()))?;
        data.sync_all().map_err(io_err(&data_path))?;
        let weight_bytes = data.metadata().map_err(io_err(&data_path))?.len();
        oxrl_models::checkpoint::write_synced(&tmp.join(MODEL_FILE), &model)?;
        for file in std::iter::once("config.json").chain(oxrl_models::checkpoint::SIDE_FILES) {
            let from = dir.join(file);
            if from.exists() {
                let to = tmp.join(file);
                std::fs::copy(&from, &to).map_err(io_err(&to))?;
            }
        }
        Ok(OnnxSummary {
            layers: decoder.config.num_hidden_layers,
            weight_bytes,
        })
    })
}
