//! oxrl-nn: tensor kernels the training and inference paths share where candle's generic ops
//! are too slow: a vectorized `exp`, and the log-probability (and entropy) of target tokens
//! over a whole vocabulary row in one pass, with a backward.

pub mod exp;
pub mod logprob;
#[cfg(feature = "cuda")]
mod logprob_cuda;

pub use logprob::{logprob_entropy, target_logprobs};
