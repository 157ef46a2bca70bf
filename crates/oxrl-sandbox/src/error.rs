//! The sandbox's own failures. What the program does (exit, crash, hit a limit) is never an
//! error: it is an [`crate::Exit`].

use crate::SANDBOX_PATH;
use std::ffi::NulError;
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox: the command is empty")]
    EmptyCommand,
    #[error("sandbox: `{0}` is not a plain file name")]
    FileName(String),
    #[error("sandbox: `{program}` not found on {SANDBOX_PATH}")]
    NotFound { program: String },
    #[error("sandbox: {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("sandbox: cannot create the status pipe: {0}")]
    StatusPipe(#[source] io::Error),
    /// A path or option handed to the syscalls between fork and exec has a NUL byte.
    #[error("sandbox: {what} has a NUL byte")]
    NulByte {
        what: &'static str,
        source: NulError,
    },
    #[error("sandbox: cannot start `{program}`: {source}")]
    Spawn { program: String, source: io::Error },
    /// Every mode's probe run failed; the reasons are joined in one line because the verdict is
    /// found once per process and shared by every later [`crate::Sandbox::new`].
    #[error("sandbox: no isolation mode works on this machine ({0})")]
    Unavailable(String),
}
