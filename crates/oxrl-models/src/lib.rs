//! oxrl-models: the policy models oxrl trains (Qwen3 first), read from and written to
//! Hugging Face checkpoint directories, with their tokenizers and chat templates.

pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod hub;
pub mod image;
pub mod mrope;
mod ops;
pub mod qwen3;
pub mod tokenizer;
pub mod vision;
mod weights;

pub use config::Qwen3Config;
pub use error::{ModelError, Result};
pub use image::{ImageProcessorConfig, ImageSource, ProcessedImage};
pub use mrope::VisionTokens;
pub use qwen3::{
    reward_model, BatchLogprobs, Entropy, ImagePrompting, KvCache, Qwen3, Qwen3RewardModel,
    ScoreRequest, Vision, VocabSlices,
};
pub use tokenizer::{eos_token_ids, Tokenizer};
