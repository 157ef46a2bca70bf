//! What can go wrong while exporting: every error names the file and what was expected.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] oxrl_models::ModelError),
    /// A file of the checkpoint is not what its format says it is.
    #[error("{path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    /// The checkpoint is valid but the format cannot express it (yet).
    #[error("{0}")]
    Unsupported(String),
}

pub type Result<T> = std::result::Result<T, ExportError>;

/// Maps an IO error on `path` to [`ExportError::Io`].
pub(crate) fn io_err(path: &std::path::Path) -> impl Fn(std::io::Error) -> ExportError + '_ {
    move |source| ExportError::Io {
        path: path.to_path_buf(),
        source,
    }
}
