//! oxrl-models: the policy models oxrl trains (Qwen3 first), read from and written to
//! Hugging Face checkpoint directories, with their tokenizers and chat templates.
//!
//! The rest of the workspace talks to models through [`PolicyModel`] and
//! [`SequenceClassifier`], loaded by [`registry`] from `config.json`'s `architectures`.

pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
pub mod hub;
pub mod image;
pub mod model_traits;
pub mod mrope;
mod ops;
pub mod qwen3;
pub mod registry;
pub mod tokenizer;
mod tower_checkpoints;
pub mod vision;
mod weights;

pub use config::Qwen3Config;
pub use device::{DeviceError, DeviceSpec, HOST};
pub use error::{ModelError, Result};
pub use image::{ImageProcessorConfig, ImageSource, ProcessedImage};
pub use model_traits::{PolicyModel, SequenceClassifier};
pub use mrope::VisionTokens;
pub use qwen3::{
    reward_model, BatchLogprobs, CacheKind, Entropy, ImagePrompting, KvCache, LoraConfig, LoraInit,
    Qwen3, Qwen3RewardModel, Qwen3ValueModel, ScoreRequest, Vision, VocabSlices, LORA_TARGETS,
};
pub use registry::{load_policy, load_sequence_classifier};
pub use tokenizer::{eos_token_ids, Tokenizer};
