//! The run's directory on the host: the program's files, and the scratch directory that is its
//! working directory (and, with mounts, a size-capped tmpfs).

use crate::isolation::Identity;
use crate::SandboxError;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The run's directory: `<tmp>/oxrl-sandbox-<pid>-<n>/` with the program's files, and
/// `scratch/` (owned by the run's user) as its working directory, and `.root/` where the run's
/// root is assembled. Removed on drop.
pub(crate) struct WorkDir {
    pub(crate) path: PathBuf,
    pub(crate) scratch: PathBuf,
}

impl WorkDir {
    pub(crate) fn create(id: &Identity) -> Result<Self, SandboxError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir();
        let io_err = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| SandboxError::Io { what, path, source }
        };
        let path = loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let p = base.join(format!("oxrl-sandbox-{}-{n}", std::process::id()));
            match std::fs::create_dir(&p) {
                Ok(()) => break p,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err("cannot create", &p)(e)),
            }
        };
        let dir = WorkDir {
            scratch: path.join("scratch"),
            path,
        };
        std::fs::set_permissions(&dir.path, std::fs::Permissions::from_mode(0o755))
            .map_err(io_err("cannot set permissions of", &dir.path))?;
        std::fs::create_dir(&dir.scratch).map_err(io_err("cannot create", &dir.scratch))?;
        std::fs::create_dir(dir.new_root()).map_err(io_err("cannot create", &dir.new_root()))?;
        std::fs::set_permissions(&dir.scratch, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err("cannot set permissions of", &dir.scratch))?;
        if id.drop_from_root {
            std::os::unix::fs::chown(&dir.scratch, Some(id.uid), Some(id.gid))
                .map_err(io_err("cannot chown", &dir.scratch))?;
        }
        Ok(dir)
    }

    /// The mount point of the run's new root (an empty directory on the host).
    pub(crate) fn new_root(&self) -> PathBuf {
        self.path.join(".root")
    }

    pub(crate) fn write(&self, name: &str, bytes: &[u8]) -> Result<(), SandboxError> {
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && name != "scratch"
            && name != ".root"
            && !name.contains('/')
            && !name.contains('\0');
        if !plain {
            return Err(SandboxError::FileName(name.to_string()));
        }
        let p = self.path.join(name);
        std::fs::write(&p, bytes).map_err(|source| SandboxError::Io {
            what: "cannot write",
            path: p.clone(),
            source,
        })?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).map_err(|source| {
            SandboxError::Io {
                what: "cannot set permissions of",
                path: p,
                source,
            }
        })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if std::fs::remove_dir_all(&self.path).is_err() {
            // The program may have left directories without write permission (only possible
            // without the scratch tmpfs): open everything up, then remove again.
            fn open_up(p: &Path) {
                let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700));
                if let Ok(entries) = std::fs::read_dir(p) {
                    for e in entries.flatten() {
                        if e.file_type().is_ok_and(|t| t.is_dir()) {
                            open_up(&e.path());
                        }
                    }
                }
            }
            open_up(&self.path);
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}
