//! oxrl-sandbox: running untrusted programs (model-written code) on Linux, contained.
//!
//! [`Sandbox::run`] gives each run a fresh directory under the temp dir (removed after), a
//! wall-clock timeout, rlimits (CPU time, address space, file size, processes, open files, no
//! core dumps), a cleared environment ([`SANDBOX_PATH`], `HOME` and `TMPDIR` in the scratch
//! directory, `LANG`), capped output, and — where the kernel allows it — new user, mount,
//! network, PID and IPC namespaces. Whatever the program does is an [`Exit`]; a
//! [`SandboxError`] is only the sandbox's own failure.
//!
//! With full isolation ([`Mode::Full`]) a run is guaranteed:
//! - no network interface but a down loopback (abstract Unix sockets are per network
//!   namespace, so none of the host's either);
//! - a root of its own holding only `/usr`, `/etc`, the binary and library directories, a few
//!   `/dev` nodes and its run directory: no host `/tmp`, `/run`, `/dev/shm`, `/home` or `/var`,
//!   so no host Unix socket by path;
//! - no writable path outside its scratch directory, a size-capped tmpfs that vanishes with it;
//! - no process outside the run visible or signalable (`getppid()` is 0);
//! - no process of the run alive after it: it runs as PID 1 of its own PID namespace, which
//!   the kernel tears down when PID 1 exits, and PID 1 dies with its supervisor;
//! - a process limit counted per run (its own user namespace: the kernel counts processes per
//!   user namespace and uid, so concurrent runs and the host's processes of the same user do not
//!   share it);
//! - memory bounded per run: RLIMIT_AS per process, and the proportional set sizes of all its
//!   processes summed by the parent every 20 ms, the run killed when over `memory_mb`;
//! - no environment variable and no open descriptor of the parent.
//!
//! Not covered: CPU shared with the caller beyond the per-process CPU limit (no cgroups), memory
//! a run allocates within one 20 ms poll, the kernel's attack surface (no seccomp). Where the
//! kernel refuses part of this, [`Sandbox::new`] falls back to the strongest [`Mode`] that works
//! and says so once on stderr.
//!
//! Full isolation needs unprivileged user namespaces (for root running as `nobody` too),
//! mounting inside them (`mount_setattr`, Linux 5.12+; tmpfs, bind mounts and `pivot_root`;
//! proc for a PID namespace it owns) and `pidfd_open` (else the parent polls every
//! millisecond). The cost is two forks of the caller and a few syscalls: 2–4 ms per run with a
//! small caller.
//!
//! `child` holds the steps between fork and exec, `isolation` the modes and their detection,
//! `run` the parent's side of one run.

// The sandbox is made of syscalls std does not wrap (namespaces, mounts, credentials, rlimits,
// pidfds, async-signal-safe code between fork and exec), so this is the one crate of the
// workspace that allows `unsafe`; every block says why it is sound.
#![allow(unsafe_code)]

mod child;
mod error;
mod isolation;
mod limits;
mod outcome;
mod program;
mod run;
mod watch;
mod workdir;

pub use error::SandboxError;
pub use isolation::Mode;
pub use limits::Limits;
pub use outcome::{Exit, RunOutcome};
pub use program::{resolve_program, SANDBOX_PATH};
pub use run::Sandbox;
