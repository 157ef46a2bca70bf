//! oxrl-train: turning trajectories into a better policy. The update step (advantages, old and
//! reference log-probs, policy loss with KL and entropy terms over micro-batches, clipping,
//! AdamW, schedules), the trajectory format, and the optimizer state.

pub mod config;
mod config_file;
pub mod config_keys;
pub mod critic;
pub mod data;
pub mod episodes;
pub mod error;
pub mod eval;
pub mod grpo;
pub mod interrupt;
pub mod loss;
pub mod observe;
mod one_step;
pub mod optim;
pub mod overrides;
pub mod parallel;
pub mod plan;
pub mod reward_config;
pub mod run_dir;
mod sampling;
pub mod sft;
mod shares;
pub mod state;
pub mod trajectory;
pub mod update;
pub mod zero;

pub use config::{ConfigError, RunConfig};
pub use grpo::{advantages, learn, replay, replay_parallel, GrpoRun, Learned, RunSummary};
pub use interrupt::Interrupt;
pub use observe::PhaseTimes;
pub use optim::{AdamW, AdamWConfig, LrSchedule, Optimizer, TensorAdamW};
pub use parallel::DataParallel;
pub use trajectory::{read_trajectories, Trajectory};
pub use update::{
    AlgorithmConfig, OldLogprobs, OldPolicy, PolicyTrainer, TrainError, UpdateConfig, UpdateReport,
};
