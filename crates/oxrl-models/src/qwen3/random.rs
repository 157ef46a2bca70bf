//! Random initialisation as transformers does it, for benchmarks, tests and new tiny policies.

use super::causal_lm::{BODY, LM_HEAD};
use super::config::ModelConfig;
use super::model::{Qwen3Model, EMBED_TOKENS};
use super::Qwen3;
use crate::config::Qwen3Config;
use crate::error::Result;
use crate::vision::VisionConfig;
use crate::weights::Init;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

impl Qwen3 {
    /// A freshly initialised model as transformers makes one: every matrix (and the vision
    /// position table) from N(0, 0.02²) (`initializer_range`), every norm weight 1, every bias
    /// 0. For benchmarks, tests and new tiny policies; Qwen3-VL when the config has a
    /// `vision_config`. A config without `architectures` gets the one it describes, so the
    /// checkpoint it saves loads through [`crate::registry`].
    pub fn random(
        mut config_json: Value,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        let source = Path::new("<random init>");
        let ModelConfig {
            text: config,
            vision,
        } = ModelConfig::from_value(&config_json, source)?;
        if let Some(keys) = config_json.as_object_mut() {
            keys.entry("architectures")
                .or_insert_with(|| serde_json::json!([super::architecture(vision.is_some())]));
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let std = config_json
            .get("initializer_range")
            .and_then(Value::as_f64)
            .unwrap_or(0.02) as f32;
        // The draw order (vision, embedding, LM head, then layer by layer) fixes every seeded
        // model the project ships or benchmarks.
        let mut draw = |shape: &[usize], init: Init| -> Result<Tensor> {
            Ok(match init {
                Init::Normal => {
                    let n: usize = shape.iter().product();
                    // Box–Muller: two uniforms give one standard normal.
                    let v: Vec<f32> = (0..n)
                        .map(|_| {
                            let (u1, u2) = (1.0 - rng.random::<f32>(), rng.random::<f32>());
                            std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
                        })
                        .collect();
                    Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?
                }
                Init::Ones => Tensor::ones(shape, dtype, device)?,
                Init::Zeros => Tensor::zeros(shape, dtype, device)?,
            })
        };
        let mut t = HashMap::new();
        for (name, shape, init) in slots(&config, vision.as_ref().map(|(vc, _)| vc)) {
            t.insert(name, draw(&shape, init)?);
        }
        Self::from_tensors(config_json, source, t, dtype, device)
    }
}

/// Every weight of a checkpoint of this shape: name, shape and initialisation, in the draw order
/// of [`Qwen3::random`] (vision, embedding, LM head, then layer by layer).
fn slots(config: &Qwen3Config, vision: Option<&VisionConfig>) -> Vec<(String, Vec<usize>, Init)> {
    let mut out = Vec::new();
    if let Some(vc) = vision {
        out.extend(crate::vision::parameter_shapes(vc));
    }
    let vocab = vec![config.vocab_size, config.hidden_size];
    out.push((format!("{BODY}{EMBED_TOKENS}"), vocab.clone(), Init::Normal));
    if !config.tie_word_embeddings {
        out.push((LM_HEAD.to_string(), vocab, Init::Normal));
    }
    for (name, slot) in Qwen3Model::layer_slots(config, BODY) {
        out.push((name, slot.shape, slot.init));
    }
    out
}

/// Every weight's name and shape, by checkpoint name.
pub type Shapes = Vec<(String, Vec<usize>)>;

/// The decoder's configuration and every weight's name and shape for a Qwen3 or Qwen3-VL
/// `config.json` (read from `source`, named in errors), without loading any weight: what
/// `oxrl plan` counts.
pub fn parameter_shapes(config_json: &Value, source: &Path) -> Result<(Qwen3Config, Shapes)> {
    let ModelConfig { text, vision } = ModelConfig::from_value(config_json, source)?;
    let shapes = slots(&text, vision.as_ref().map(|(vc, _)| vc))
        .into_iter()
        .map(|(name, shape, _)| (name, shape))
        .collect();
    Ok((text, shapes))
}
