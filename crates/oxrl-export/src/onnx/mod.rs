//! A Qwen3 or Qwen3-VL checkpoint as an ONNX model directory that onnxruntime runs with a KV
//! cache: `model.onnx` (the decoder, see [`decoder_graph`]) and `model.onnx.data` (its weights,
//! external so any size loads); for Qwen3-VL also `vision.onnx` and `vision.onnx.data` (the
//! vision tower over one image, see [`vision_graph`]); and the checkpoint's `config.json`,
//! generation config, tokenizer and image processor files — the directory optimum's
//! `ORTModelForCausalLM` loads for a text model. A text model's directory also holds
//! `genai_config.json` (see [`genai_config`]), so onnxruntime-genai generates from it as is.

mod decoder_graph;
mod genai_config;
mod graph;
mod ops;
mod proto;
mod vision_graph;

pub use genai_config::GENAI_CONFIG_FILE;
pub use ops::WeightDtype;

use crate::decoder::Decoder;
use crate::error::{io_err, ExportError, Result};
use crate::tensors::CheckpointTensors;
use crate::write_dir_atomically;
use decoder_graph::{DecoderGraph, VisualInputs};
use graph::Graph;
use ops::Weights;
use oxrl_models::vision::VisionConfig;
use serde_json::Value;
use std::path::Path;
use vision_graph::VisionGraph;

/// The decoder's graph file and the weights file it names.
pub const MODEL_FILE: &str = "model.onnx";
pub const DATA_FILE: &str = "model.onnx.data";
/// Qwen3-VL's vision tower.
pub const VISION_FILE: &str = "vision.onnx";
pub const VISION_DATA_FILE: &str = "vision.onnx.data";

/// What was written.
#[derive(Debug)]
pub struct OnnxSummary {
    pub layers: usize,
    pub weight_bytes: u64,
    /// Whether `vision.onnx` was written (Qwen3-VL).
    pub vision: bool,
}

/// Writes the checkpoint in `dir` as the ONNX model directory `output` (atomically).
/// `progress(done, total)` is called after each decoder layer (and vision block).
pub fn export(
    dir: &Path,
    output: &Path,
    dtype: WeightDtype,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<OnnxSummary> {
    let decoder = Decoder::read(dir)?;
    decoder.refuse_attention_bias(dir)?;
    let config_path = dir.join("config.json");
    let vision = match decoder.vision {
        true => {
            let v = &decoder.config_json["vision_config"];
            let config = VisionConfig::from_value(v, &config_path)?;
            let id = |key: &str, default: i64| {
                decoder
                    .config_json
                    .get(key)
                    .and_then(Value::as_i64)
                    .unwrap_or(default)
            };
            let inputs = VisualInputs {
                image_token_id: id("image_token_id", 151_655),
                video_token_id: id("video_token_id", 151_656),
                deepstack: config.deepstack_visual_indexes.len(),
            };
            if config.out_hidden_size != decoder.config.hidden_size {
                return Err(ExportError::Checkpoint {
                    path: config_path,
                    message: format!(
                        "vision_config.out_hidden_size {} is not the text hidden size {}",
                        config.out_hidden_size, decoder.config.hidden_size
                    ),
                });
            }
            Some((config, inputs))
        }
        false => None,
    };
    let tensors = CheckpointTensors::open(dir)?;
    write_dir_atomically(output, &mut |tmp| {
        let (mut visual_inputs, vision_config) = match &vision {
            Some((config, inputs)) => (
                Some(VisualInputs {
                    image_token_id: inputs.image_token_id,
                    video_token_id: inputs.video_token_id,
                    deepstack: inputs.deepstack,
                }),
                Some(config),
            ),
            None => (None, None),
        };
        let mut weight_bytes = write_graph(
            tmp,
            MODEL_FILE,
            DATA_FILE,
            "qwen3_decoder",
            &mut |graph, data_path| {
                let weights = Weights {
                    tensors: &tensors,
                    dtype,
                    data_path,
                };
                DecoderGraph::new(graph, &decoder, weights, visual_inputs.take()).build(progress)
            },
        )?;
        if let Some(config) = vision_config {
            weight_bytes += write_graph(
                tmp,
                VISION_FILE,
                VISION_DATA_FILE,
                "qwen3_vl_vision",
                &mut |graph, data_path| {
                    let weights = Weights {
                        tensors: &tensors,
                        dtype,
                        data_path,
                    };
                    VisionGraph::new(graph, config, weights).build(progress)
                },
            )?;
        }
        if vision_config.is_none() {
            let config = genai_config::genai_config(dir, &decoder, MODEL_FILE)?;
            let path = tmp.join(GENAI_CONFIG_FILE);
            let text = serde_json::to_string_pretty(&config).unwrap_or_default();
            oxrl_models::checkpoint::write_synced(&path, text.as_bytes())?;
        }
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
            vision: vision.is_some(),
        })
    })
}

type DataWriter = std::io::BufWriter<std::fs::File>;
/// Fills a graph whose weights go to the data file at the given path.
type BuildGraph<'a> = dyn FnMut(Graph<DataWriter>, &Path) -> Result<Graph<DataWriter>> + 'a;

/// Builds one graph into `dir/model_file`, its weights into `dir/data_file`; returns the
/// weights' bytes.
fn write_graph(
    dir: &Path,
    model_file: &str,
    data_file: &str,
    graph_name: &str,
    build: &mut BuildGraph,
) -> Result<u64> {
    let data_path = dir.join(data_file);
    let data = std::fs::File::create(&data_path).map_err(io_err(&data_path))?;
    let graph = build(
        Graph::new(std::io::BufWriter::new(data), data_file),
        &data_path,
    )?;
    let (model, data) = graph.finish(graph_name, env!("CARGO_PKG_VERSION"));
    let data = data
        .into_inner()
        .map_err(|e| io_err(&data_path)(e.into_error()))?;
    data.sync_all().map_err(io_err(&data_path))?;
    let bytes = data.metadata().map_err(io_err(&data_path))?.len();
    oxrl_models::checkpoint::write_synced(&dir.join(model_file), &model)?;
    Ok(bytes)
}
