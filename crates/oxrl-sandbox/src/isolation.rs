//! How strongly a run is isolated: the modes, who the run is, and the detection that picks the
//! strongest mode the kernel allows, once per process.

use crate::{resolve_program, Limits, Sandbox, SandboxError};
use std::sync::OnceLock;

/// Which isolation the kernel allowed ([`crate::Sandbox::new`] picks the strongest that works).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// New user, mount, network, PID and IPC namespaces; a read-only root of its own, tmpfs
    /// scratch, own /proc.
    Full,
    /// The namespaces without the read-only root, scratch tmpfs and own /proc (mounts refused).
    NamespacesOnly,
    /// Root without user namespaces: the other namespaces and mounts made as root, then `nobody`.
    RootNamespaces,
    /// No namespaces: a supervisor, a new session, rlimits and (for root) `nobody`.
    Minimal,
}

impl Mode {
    pub fn namespaces(self) -> bool {
        self != Mode::Minimal
    }
    pub fn mounts(self) -> bool {
        matches!(self, Mode::Full | Mode::RootNamespaces)
    }
}

/// The uid/gid root is dropped to (`nobody` on Debian and most distributions).
const NOBODY: (libc::uid_t, libc::gid_t) = (65534, 65534);

/// Who the run is: the ids it runs under, and whether root drops to them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Identity {
    pub(crate) uid: libc::uid_t,
    pub(crate) gid: libc::gid_t,
    pub(crate) drop_from_root: bool,
}

impl Identity {
    pub(crate) fn current() -> Self {
        // SAFETY: id getters have no preconditions.
        let (euid, uid, gid) = unsafe { (libc::geteuid(), libc::getuid(), libc::getgid()) };
        match euid {
            0 => Identity {
                uid: NOBODY.0,
                gid: NOBODY.1,
                drop_from_root: true,
            },
            _ => Identity {
                uid,
                gid,
                drop_from_root: false,
            },
        }
    }
}

/// The isolation this machine allows, found once per process by trying the strongest mode
/// first; a weaker one is reported once on stderr with the reason.
pub(crate) fn detect_mode() -> Result<Mode, SandboxError> {
    static MODE: OnceLock<Result<Mode, String>> = OnceLock::new();
    MODE.get_or_init(|| {
        let id = Identity::current();
        let mut candidates = vec![Mode::Full, Mode::NamespacesOnly];
        if id.drop_from_root {
            candidates.push(Mode::RootNamespaces);
        }
        candidates.push(Mode::Minimal);
        let probe = resolve_program("true").map_err(|e| e.to_string())?;
        let command = [probe.display().to_string()];
        let mut refused = Vec::new();
        for mode in candidates {
            let sandbox = Sandbox::with_mode(Limits::default(), mode, id);
            match sandbox.run(&command, &[], b"") {
                Ok(o) if o.success() => {
                    if mode != Mode::Full {
                        eprintln!(
                            "sandbox: full isolation is not available ({}); code runs with {}",
                            refused.join("; "),
                            describe(mode, &id)
                        );
                    }
                    return Ok(mode);
                }
                Ok(o) => refused.push(format!("{mode:?}: {:?}", o.exit)),
                Err(e) => refused.push(format!("{mode:?}: {e}")),
            }
        }
        Err(refused.join("; "))
    })
    .clone()
    .map_err(SandboxError::Unavailable)
}

/// What a mode guarantees, for the log.
fn describe(mode: Mode, id: &Identity) -> String {
    let user = match id.drop_from_root {
        true => "as nobody, ",
        false => "",
    };
    match mode {
        Mode::Full => format!("{user}no network, a read-only file system, its own PID namespace"),
        Mode::NamespacesOnly => format!(
            "{user}no network and its own PID namespace, but the file system (host Unix sockets among it) is reachable and writable wherever its user may (mounts refused)"
        ),
        Mode::RootNamespaces => format!(
            "{user}no network, a read-only file system, its own PID namespace; the process limit is shared by every process of nobody (no user namespaces)"
        ),
        Mode::Minimal => format!(
            "{user}rlimits and a new session only: the network is reachable, processes can be seen, memory is limited per process only, {}",
            match id.drop_from_root {
                true => "the process limit is shared by every process of nobody",
                false => "and process count is bounded only by the timeout",
            }
        ),
    }
}
