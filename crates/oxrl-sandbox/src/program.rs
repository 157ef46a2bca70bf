//! Where the program comes from: the sandbox's `PATH` and the lookup on it.

use crate::SandboxError;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The `PATH` a sandboxed program sees (and the command's program is looked up in).
pub const SANDBOX_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// `program` as an absolute path: itself when it has a `/`, else the first executable file of
/// that name on [`SANDBOX_PATH`].
pub fn resolve_program(program: &str) -> Result<PathBuf, SandboxError> {
    let not_found = || SandboxError::NotFound {
        program: program.to_string(),
    };
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return executable(&p).then_some(p).ok_or_else(not_found);
    }
    SANDBOX_PATH
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| executable(p))
        .ok_or_else(not_found)
}
