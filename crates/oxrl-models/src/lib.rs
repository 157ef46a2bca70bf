//! oxrl-models: the policy models oxrl trains (Qwen3 first), read from and written to
//! Hugging Face checkpoint directories.

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod qwen3;

pub use config::Qwen3Config;
pub use error::{ModelError, Result};
pub use qwen3::Qwen3;
