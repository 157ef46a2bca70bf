//! oxrl-models: the policy models oxrl trains (Qwen3 first), read from and written to
//! Hugging Face checkpoint directories, with their tokenizers and chat templates.

pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
pub mod hub;
pub mod image;
pub mod kv_cache;
pub mod mrope;
pub mod qwen3;
pub mod reward_model;
pub mod tokenizer;
pub mod vision;

pub use config::Qwen3Config;
pub use device::{DeviceError, DeviceSpec, HOST};
pub use error::{ModelError, Result};
pub use image::{ImageProcessorConfig, ImageSource, ProcessedImage};
pub use kv_cache::{KvCache, VocabSlices};
pub use mrope::VisionTokens;
pub use qwen3::{BatchLogprobs, Entropy, ImagePrompting, Qwen3, ScoreRequest, Vision};
pub use reward_model::Qwen3RewardModel;
pub use tokenizer::{eos_token_ids, Tokenizer};
