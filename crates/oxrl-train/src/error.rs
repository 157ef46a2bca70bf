//! The errors of oxrl-train, in one module that depends on no other module of the crate, so the
//! config, data, trajectory and update modules can all return them without importing each other.

use std::path::PathBuf;

/// A dataset that cannot be read or a row that cannot be used; the message names `file:line`.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `at` is `file:line` (JSONL), `file:row N` (Parquet) or the file.
    #[error("{at}: {message}")]
    Row { at: String, message: String },
}

impl DataError {
    pub fn row(at: impl Into<String>, message: impl std::fmt::Display) -> Self {
        DataError::Row {
            at: at.into(),
            message: message.to_string(),
        }
    }
}

/// A rollout file that cannot be read, or a line of it that is not a usable trajectory.
#[derive(Debug, thiserror::Error)]
pub enum TrajectoryError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Line {
        path: String,
        line: usize,
        message: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A request the run cannot honour (a bad combination of settings or inputs); the message
    /// says which and what was expected.
    #[error("{0}")]
    Invalid(String),
    /// Trajectories sampled under other weights than the trainer's, beyond what the run allows.
    #[error("{0}")]
    StaleWeights(String),
    #[error(transparent)]
    Model(#[from] oxrl_models::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Engine(#[from] oxrl_rollout::EngineError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Trajectory(#[from] TrajectoryError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The process group failed: a rank exited, timed out or disagreed.
    #[error(transparent)]
    Dist(#[from] oxrl_dist::DistError),
}

pub type Result<T> = std::result::Result<T, TrainError>;
