//! The one table from `config.json`'s `architectures` to a loader. Adding an architecture is one
//! line in [`ARCHITECTURES`] plus its loader; everything that loads a model by directory goes
//! through [`load_policy`] or [`load_sequence_classifier`].

use crate::error::{ModelError, Result};
use crate::model_traits::{PolicyModel, SequenceClassifier};
use crate::qwen3::{self, reward_model, Qwen3, Qwen3RewardModel};
use candle_core::{DType, Device};
use serde_json::Value;
use std::path::Path;

/// Loads a checkpoint directory in a compute dtype onto a device.
pub type Load<T> = fn(&Path, DType, &Device) -> Result<Box<T>>;

/// What an architecture loads as.
#[derive(Clone, Copy)]
pub enum Loader {
    /// A causal LM the trainer and engine drive.
    Policy(Load<dyn PolicyModel>),
    /// A sequence classifier (a reward model).
    SequenceClassifier(Load<dyn SequenceClassifier>),
}

/// One known architecture: its `architectures` entry and its loader.
pub struct Architecture {
    pub name: &'static str,
    pub loader: Loader,
}

/// Every architecture oxrl loads.
pub const ARCHITECTURES: &[Architecture] = &[
    Architecture {
        name: qwen3::CAUSAL_LM,
        loader: Loader::Policy(qwen3_policy),
    },
    Architecture {
        name: qwen3::VISION_LANGUAGE,
        loader: Loader::Policy(qwen3_policy),
    },
    Architecture {
        name: reward_model::ARCHITECTURE,
        loader: Loader::SequenceClassifier(qwen3_classifier),
    },
];

/// Qwen3 and Qwen3-VL are one type: `config.json`'s `vision_config` says which it is.
fn qwen3_policy(dir: &Path, dtype: DType, device: &Device) -> Result<Box<dyn PolicyModel>> {
    Ok(Box::new(Qwen3::load(dir, dtype, device)?))
}

fn qwen3_classifier(
    dir: &Path,
    dtype: DType,
    device: &Device,
) -> Result<Box<dyn SequenceClassifier>> {
    Ok(Box::new(Qwen3RewardModel::load(dir, dtype, device)?))
}

/// The known architecture `config` (read from `path`) names: the first entry of its
/// `architectures` list found in [`ARCHITECTURES`].
pub fn architecture(config: &Value, path: &Path) -> Result<&'static Architecture> {
    let known = || ARCHITECTURES.iter().map(|a| a.name).collect::<Vec<_>>();
    let found = match config.get("architectures") {
        None | Some(Value::Null) => {
            return Err(ModelError::MissingArchitecture {
                path: path.to_path_buf(),
                known: known(),
            })
        }
        Some(found) => found,
    };
    found
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .find_map(|name| ARCHITECTURES.iter().find(|a| a.name == name))
        .ok_or_else(|| ModelError::UnknownArchitecture {
            path: path.to_path_buf(),
            found: found.to_string(),
            known: known(),
        })
}

/// The architecture of the checkpoint in `dir`, read from its `config.json`.
fn architecture_in(dir: &Path) -> Result<(&'static Architecture, std::path::PathBuf)> {
    let path = dir.join("config.json");
    let config = crate::config::read_json(&path)?;
    Ok((architecture(&config, &path)?, path))
}

/// Names the checkpoint in an error about a tensor that is missing or of the wrong shape.
fn in_checkpoint(dir: &Path) -> impl FnOnce(ModelError) -> ModelError + '_ {
    move |e| match e {
        ModelError::TensorShape { .. } | ModelError::MissingTensor(_) => {
            ModelError::WeightsMismatch {
                dir: dir.to_path_buf(),
                source: Box::new(e),
            }
        }
        e => e,
    }
}

/// Loads the policy (causal LM) in `dir`; a checkpoint of another kind is an error naming it.
pub fn load_policy(dir: &Path, dtype: DType, device: &Device) -> Result<Box<dyn PolicyModel>> {
    match architecture_in(dir)? {
        (
            Architecture {
                loader: Loader::Policy(load),
                ..
            },
            _,
        ) => load(dir, dtype, device).map_err(in_checkpoint(dir)),
        (a, path) => Err(ModelError::WrongModelKind {
            path,
            architecture: a.name,
            wanted: "a causal language model (a policy)",
        }),
    }
}

/// Loads the sequence classifier (reward model) in `dir`; a checkpoint of another kind is an
/// error naming it.
pub fn load_sequence_classifier(
    dir: &Path,
    dtype: DType,
    device: &Device,
) -> Result<Box<dyn SequenceClassifier>> {
    match architecture_in(dir)? {
        (
            Architecture {
                loader: Loader::SequenceClassifier(load),
                ..
            },
            _,
        ) => load(dir, dtype, device).map_err(in_checkpoint(dir)),
        (a, path) => Err(ModelError::WrongModelKind {
            path,
            architecture: a.name,
            wanted: "a sequence classifier (a reward model)",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxrl_fixtures::{fixture, temp_dir};
    use serde_json::json;

    fn tiny_config() -> Value {
        json!({"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "max_position_embeddings": 64, "tie_word_embeddings": true,
            "num_labels": 1})
    }

    #[test]
    fn every_architecture_dispatches_to_its_loader() {
        let cpu = &Device::Cpu;
        let text = load_policy(&fixture("qwen3-tiny"), DType::F32, cpu).unwrap();
        assert_eq!(text.architecture(), qwen3::CAUSAL_LM);
        let vl = load_policy(&fixture("qwen3-vl-tiny"), DType::F32, cpu).unwrap();
        assert_eq!(vl.architecture(), qwen3::VISION_LANGUAGE);
        assert!(vl.image_prompting().is_some());
        let dir = temp_dir("registry-classifier").join("rm");
        Qwen3RewardModel::random(tiny_config(), 1, DType::F32, cpu)
            .unwrap()
            .save(&dir, None)
            .unwrap();
        let rm = load_sequence_classifier(&dir, DType::F32, cpu).unwrap();
        assert_eq!(
            (rm.architecture(), rm.num_labels()),
            (reward_model::ARCHITECTURE, 1)
        );
        let e = load_policy(&dir, DType::F32, cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(reward_model::ARCHITECTURE) && e.contains("policy"),
            "{e}"
        );
        let e = load_sequence_classifier(&fixture("qwen3-tiny"), DType::F32, cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(qwen3::CAUSAL_LM) && e.contains("reward model"),
            "{e}"
        );
    }

    #[test]
    fn a_random_policy_names_its_architecture() {
        let model = Qwen3::random(tiny_config(), 1, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            model.config_json["architectures"],
            json!([qwen3::CAUSAL_LM])
        );
    }

    #[test]
    fn an_unknown_or_missing_architecture_names_the_file_the_value_and_the_known_ones() {
        let path = Path::new("ckpt/config.json");
        let e = architecture(&json!({"architectures": ["LlamaForCausalLM"]}), path)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("ckpt/config.json") && e.contains("LlamaForCausalLM"),
            "{e}"
        );
        for a in ARCHITECTURES {
            assert!(e.contains(a.name), "{e}");
        }
        let e = architecture(&json!({"model_type": "qwen3"}), path)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("ckpt/config.json") && e.contains("architectures"),
            "{e}"
        );
        assert!(e.contains(qwen3::CAUSAL_LM), "{e}");
        let picked = architecture(
            &json!({"architectures": ["SomethingElse", reward_model::ARCHITECTURE]}),
            path,
        )
        .unwrap();
        assert_eq!(picked.name, reward_model::ARCHITECTURE);
    }
}
