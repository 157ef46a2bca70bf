//! A sandbox for running untrusted programs (model-written code) on Linux.
//!
//! Each run gets a fresh directory under the temp dir (deleted after), a wall-clock timeout,
//! rlimits (CPU time, address space, file size, processes, open files, no core dumps), a minimal
//! environment, capped output, and — where the kernel allows it — new user, mount, network, PID
//! and IPC namespaces: no network at all, a read-only file system except a size-capped tmpfs
//! scratch directory, its own `/proc`, and no way to see or signal processes outside the run.
//! Root is dropped to `nobody` first, so the process limit applies and nothing of root's is
//! writable or signalable even where namespaces are refused. On a timeout (or too much output)
//! the run's process group is killed; when the run's first process ends, the kernel kills the
//! rest of its PID namespace, so no process of a run outlives it. See `sandbox/child.rs` for the order of
//! the steps between fork and exec, and [`Sandbox::mode`] for what the kernel allowed.

mod child;

pub use child::Mode;

use child::ChildSetup;
use std::ffi::CString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

/// The `PATH` a sandboxed program sees (and the command's program is looked up in).
pub const SANDBOX_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The uid/gid root is dropped to (`nobody` on Debian and most distributions).
const NOBODY: (libc::uid_t, libc::gid_t) = (65534, 65534);

/// Limits of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Wall clock, from spawn to exit; past it the run's process group is killed.
    pub timeout: Duration,
    /// CPU seconds per process (RLIMIT_CPU, soft = hard: SIGKILL when used up).
    pub cpu_s: u64,
    /// Address space per process in MiB (RLIMIT_AS).
    pub memory_mb: u64,
    /// Largest file a process may write, in MiB (RLIMIT_FSIZE).
    pub file_size_mb: u64,
    /// Processes and threads of the run (RLIMIT_NPROC, counted in the run's user namespace).
    pub max_processes: u64,
    /// Open file descriptors per process (RLIMIT_NOFILE).
    pub max_open_files: u64,
    /// Bytes kept of stdout and of stderr each; more kills the run.
    pub output_bytes: usize,
    /// Size of the writable tmpfs scratch directory in MiB (where mounts are allowed).
    pub scratch_mb: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            cpu_s: 5,
            memory_mb: 1024,
            file_size_mb: 16,
            max_processes: 32,
            max_open_files: 64,
            output_bytes: 1 << 16,
            scratch_mb: 64,
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The program exited with this status.
    Code(i32),
    /// The program was killed by this signal.
    Signal(i32),
    /// It used up its CPU time and was killed.
    CpuLimit,
    /// It ran past the wall-clock timeout and was killed.
    Timeout,
    /// It wrote more than `output_bytes` to stdout or stderr and was killed.
    OutputLimit,
    /// The run's supervisor was killed before it could report (only without a PID namespace).
    Lost,
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub exit: Exit,
    /// At most `output_bytes` of each stream.
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub wall: Duration,
    /// CPU time of the program (and of the children it waited for).
    pub cpu: Duration,
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGSYS => "SIGSYS",
        _ => "signal",
    }
}

impl RunOutcome {
    pub fn success(&self) -> bool {
        self.exit == Exit::Code(0)
    }

    /// Why the run failed, in one line (`None` when it exited with 0): the limit it hit, or the
    /// exit status with the last line of stderr (a Python traceback's exception).
    pub fn failure_reason(&self, limits: &Limits) -> Option<String> {
        let last_line = || {
            let text = String::from_utf8_lossy(&self.stderr);
            let line = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim();
            let mut line = line.to_string();
            if line.len() > 200 {
                let cut = (0..=200).rev().find(|&i| line.is_char_boundary(i));
                line.truncate(cut.unwrap_or(0));
                line.push('…');
            }
            line
        };
        Some(match self.exit {
            Exit::Code(0) => return None,
            Exit::Code(c) => match last_line() {
                l if l.is_empty() => format!("exit status {c}"),
                l => format!("exit status {c}: {l}"),
            },
            Exit::Signal(s) => format!("killed by signal {s} ({})", signal_name(s)),
            Exit::CpuLimit => format!("CPU time limit ({} s)", limits.cpu_s),
            Exit::Timeout => format!(
                "timed out after {:.1} s (wall clock)",
                limits.timeout.as_secs_f64()
            ),
            Exit::OutputLimit => format!("output over {} bytes", limits.output_bytes),
            Exit::Lost => "the run's supervisor was killed".to_string(),
        })
    }
}

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
    #[error("sandbox: cannot start `{program}`: {source}")]
    Spawn { program: String, source: io::Error },
    #[error("sandbox: no isolation mode works on this machine ({0})")]
    Unavailable(String),
}

/// Who the run is: the ids it runs under, and whether root drops to them.
#[derive(Debug, Clone, Copy)]
struct Identity {
    uid: libc::uid_t,
    gid: libc::gid_t,
    drop_from_root: bool,
}

impl Identity {
    fn current() -> Self {
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

/// The run's directory: `<tmp>/oxrl-sandbox-<pid>-<n>/` with the program's files, and
/// `scratch/` (owned by the run's user) as its working directory. Removed on drop.
struct WorkDir {
    path: PathBuf,
    scratch: PathBuf,
}

impl WorkDir {
    fn create(id: &Identity) -> Result<Self, SandboxError> {
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
        std::fs::set_permissions(&dir.scratch, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err("cannot set permissions of", &dir.scratch))?;
        if id.drop_from_root {
            std::os::unix::fs::chown(&dir.scratch, Some(id.uid), Some(id.gid))
                .map_err(io_err("cannot chown", &dir.scratch))?;
        }
        Ok(dir)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> Result<(), SandboxError> {
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && name != "scratch"
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

/// The isolation this machine allows, found once per process by trying the strongest mode
/// first; a weaker one is reported once on stderr with the reason.
fn detect_mode() -> Result<Mode, SandboxError> {
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
            let sandbox = Sandbox {
                limits: Limits::default(),
                mode,
                identity: id,
            };
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
            "{user}no network and its own PID namespace, but the file system is writable wherever its user may write (mounts refused)"
        ),
        Mode::RootNamespaces => format!(
            "{user}no network, a read-only file system, its own PID namespace; the process limit is shared by every process of nobody (no user namespaces)"
        ),
        Mode::Minimal => format!(
            "{user}rlimits and a new session only: the network is reachable, processes can be seen, {}",
            match id.drop_from_root {
                true => "the process limit is shared by every process of nobody",
                false => "and process count is bounded only by the timeout",
            }
        ),
    }
}

/// Runs untrusted commands under [`Limits`] with the strongest isolation the kernel allows.
pub struct Sandbox {
    limits: Limits,
    mode: Mode,
    identity: Identity,
}

impl Sandbox {
    /// Detects the isolation once per process (a few short probe runs).
    pub fn new(limits: Limits) -> Result<Self, SandboxError> {
        Ok(Self {
            limits,
            mode: detect_mode()?,
            identity: Identity::current(),
        })
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    fn child_setup(&self, dir: &WorkDir, status_fd: i32) -> Result<ChildSetup, SandboxError> {
        let l = &self.limits;
        let id = &self.identity;
        let cstr = |s: String| CString::new(s).map_err(|e| SandboxError::FileName(e.to_string()));
        let mb = |m: u64| m.saturating_mul(1 << 20) as libc::rlim_t;
        let mut rlimits = vec![
            (
                libc::RLIMIT_CPU,
                l.cpu_s as libc::rlim_t,
                l.cpu_s as libc::rlim_t,
            ),
            (libc::RLIMIT_AS, mb(l.memory_mb), mb(l.memory_mb)),
            (libc::RLIMIT_FSIZE, mb(l.file_size_mb), mb(l.file_size_mb)),
            (
                libc::RLIMIT_NOFILE,
                l.max_open_files as libc::rlim_t,
                l.max_open_files as libc::rlim_t,
            ),
            (libc::RLIMIT_CORE, 0, 0),
        ];
        // Without a user namespace of its own, a non-root run shares its user's process count
        // with everything else that user runs: a limit would break the run, not bound it.
        if self.mode != Mode::Minimal || id.drop_from_root {
            let n = l.max_processes as libc::rlim_t;
            rlimits.push((libc::RLIMIT_NPROC, n, n));
        }
        Ok(ChildSetup {
            mode: self.mode,
            drop_to: id.drop_from_root.then_some((id.uid, id.gid)),
            uid_map: cstr(format!("{0} {0} 1\n", id.uid))?,
            gid_map: cstr(format!("{0} {0} 1\n", id.gid))?,
            scratch: cstr(dir.scratch.display().to_string())?,
            tmpfs_options: cstr(format!(
                "size={}m,mode=0700,uid={},gid={}",
                l.scratch_mb, id.uid, id.gid
            ))?,
            rlimits,
            status_fd,
        })
    }

    /// Runs `command` (`{dir}` in an argument is replaced by the run directory, where `files`
    /// are written) with `stdin` as its input. Errors are the sandbox's own (a file that
    /// cannot be written, a program that cannot start); whatever the program does is an
    /// [`Exit`].
    pub fn run(
        &self,
        command: &[String],
        files: &[(&str, &[u8])],
        stdin: &[u8],
    ) -> Result<RunOutcome, SandboxError> {
        let (program, args) = command.split_first().ok_or(SandboxError::EmptyCommand)?;
        let dir = WorkDir::create(&self.identity)?;
        for (name, bytes) in files {
            dir.write(name, bytes)?;
        }
        let dir_str = dir.path.display().to_string();
        let subst = |a: &String| a.replace("{dir}", &dir_str);
        let program = resolve_program(&subst(program))?;
        let (status_read, status_write) = status_pipe()?;
        let setup = self.child_setup(&dir, status_write.as_raw_fd())?;
        let scratch = dir.scratch.display().to_string();
        let mut cmd = Command::new(&program);
        cmd.args(args.iter().map(subst))
            .env_clear()
            .env("PATH", SANDBOX_PATH)
            .env("HOME", &scratch)
            .env("TMPDIR", &scratch)
            .env("LANG", "C.UTF-8")
            .current_dir(&dir.scratch)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: `ChildSetup::run` only makes async-signal-safe calls on prepared data.
        unsafe {
            cmd.pre_exec(move || setup.run());
        }
        let start = Instant::now();
        let spawned = cmd.spawn();
        drop(status_write);
        let mut child = spawned.map_err(|source| SandboxError::Spawn {
            program: program.display().to_string(),
            source,
        })?;
        let supervisor = child.id() as libc::pid_t;
        let mut status_read = std::fs::File::from(status_read);
        // The supervisor sends PID 1's (outer) pid as soon as it has forked it.
        let mut pid_bytes = [0u8; 4];
        let target = status_read
            .read_exact(&mut pid_bytes)
            .ok()
            .map(|_| libc::pid_t::from_ne_bytes(pid_bytes));
        let over = Arc::new(AtomicBool::new(false));
        let cap = self.limits.output_bytes;
        let stdout = read_capped(child.stdout.take(), cap, over.clone());
        let stderr = read_capped(child.stderr.take(), cap, over.clone());
        if let Some(mut input) = child.stdin.take() {
            let bytes = stdin.to_vec();
            std::thread::spawn(move || {
                // A program that exits without reading its input closes the pipe: not an error.
                let _ = input.write_all(&bytes);
            });
        }
        let waited = wait_exit(supervisor, start + self.limits.timeout, &over);
        let kill_program = |pid: libc::pid_t| {
            // SAFETY: PID 1 of the run is alive (the supervisor has not reaped it: it reaps
            // only when PID 1 exits, which is what we are waiting for), so the pid and its
            // process group id still name it.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::killpg(pid, libc::SIGKILL);
            }
        };
        match (&waited, target) {
            // Kill PID 1 (its namespace goes with it) so the supervisor can reap it and report.
            (Waited::TimedOut | Waited::OverCap, Some(pid)) => {
                kill_program(pid);
                let grace = Instant::now() + Duration::from_secs(1);
                wait_exit(supervisor, grace, &AtomicBool::new(false));
            }
            // Without a PID namespace, what the program left running is in its process group.
            (Waited::Exited, Some(pid)) if !self.mode.namespaces() => {
                // SAFETY: the group outlives its leader only while members remain.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
            }
            _ => {}
        }
        // SAFETY: the supervisor is our unreaped child, so its pid (= its group id) is ours.
        unsafe {
            libc::killpg(supervisor, libc::SIGKILL);
        }
        let _ = child.wait();
        let wall = start.elapsed();
        let mut report = [0u8; child::STATUS_BYTES];
        let report = status_read.read_exact(&mut report).ok().map(|_| {
            let status = i32::from_ne_bytes([report[0], report[1], report[2], report[3]]);
            let mut cpu = [0u8; 8];
            cpu.copy_from_slice(&report[4..]);
            (status, Duration::from_micros(u64::from_ne_bytes(cpu)))
        });
        // PID 1 of the run is gone, so its namespace is torn down and the pipes close; without
        // a PID namespace a daemonised process could hold them, so the wait is bounded.
        let grace = Duration::from_secs(2);
        let stdout = stdout.recv_timeout(grace).unwrap_or_default();
        let stderr = stderr.recv_timeout(grace).unwrap_or_default();
        let cpu = report.map_or(Duration::ZERO, |r| r.1);
        // The kernel kills at the limit; rusage rounds to scheduler ticks, hence the margin.
        let cpu_limit = Duration::from_secs(self.limits.cpu_s).mul_f64(0.9);
        let exit = match (waited, report) {
            (Waited::OverCap, _) => Exit::OutputLimit,
            (_, _) if over.load(Ordering::SeqCst) => Exit::OutputLimit,
            (Waited::TimedOut, _) => Exit::Timeout,
            (Waited::Exited, Some((s, _))) if libc::WIFEXITED(s) => {
                Exit::Code(libc::WEXITSTATUS(s))
            }
            (Waited::Exited, Some((s, cpu))) if libc::WIFSIGNALED(s) => match libc::WTERMSIG(s) {
                libc::SIGKILL | libc::SIGXCPU if cpu >= cpu_limit => Exit::CpuLimit,
                sig => Exit::Signal(sig),
            },
            _ => Exit::Lost,
        };
        Ok(RunOutcome {
            exit,
            stdout,
            stderr,
            wall,
            cpu,
        })
    }
}

fn status_pipe() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(SandboxError::Io {
            what: "cannot create a pipe",
            path: PathBuf::new(),
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads `stream` on a thread, keeping `cap` bytes; past the cap it flags `over` and stops
/// reading (the writer then gets EPIPE, and the run is killed).
fn read_capped(
    stream: Option<impl Read + Send + 'static>,
    cap: usize,
    over: Arc<AtomicBool>,
) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        if let Some(mut s) = stream {
            let mut buf = [0u8; 8192];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let room = cap.saturating_sub(kept.len());
                        kept.extend_from_slice(&buf[..n.min(room)]);
                        if n > room {
                            over.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        let _ = tx.send(kept);
    });
    rx
}

enum Waited {
    Exited,
    TimedOut,
    OverCap,
}

/// Waits, without reaping, until `pid` exits, the deadline passes or the output cap is hit.
fn wait_exit(pid: libc::pid_t, deadline: Instant, over: &AtomicBool) -> Waited {
    // SAFETY: pidfd_open on our own child; the descriptor is closed below.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as libc::c_int;
    let result = loop {
        if over.load(Ordering::SeqCst) {
            break Waited::OverCap;
        }
        let now = Instant::now();
        if now >= deadline {
            break Waited::TimedOut;
        }
        // Wake at least every 10 ms to notice the output cap.
        let ms = (deadline - now).as_millis().clamp(1, 10) as libc::c_int;
        if pidfd >= 0 {
            let mut p = libc::pollfd {
                fd: pidfd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut p, 1, ms) } > 0 && p.revents & libc::POLLIN != 0 {
                break Waited::Exited;
            }
        } else {
            // SAFETY: a zeroed siginfo_t is a valid out-parameter; WNOWAIT leaves the zombie.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let r = unsafe {
                libc::waitid(
                    libc::P_PID,
                    pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                )
            };
            // SAFETY: waitid filled `info` (or left it zeroed: pid 0 means still running).
            if r == 0 && unsafe { info.si_pid() } == pid {
                break Waited::Exited;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    if pidfd >= 0 {
        // SAFETY: closes the descriptor opened above.
        unsafe { libc::close(pidfd) };
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python(code: &str, stdin: &[u8]) -> RunOutcome {
        let sb = Sandbox::new(Limits::default()).unwrap();
        let cmd = ["python3", "-I", "-B", "{dir}/main.py"].map(String::from);
        sb.run(&cmd, &[("main.py", code.as_bytes())], stdin)
            .unwrap()
    }

    #[test]
    fn stdin_in_stdout_out_and_a_minimal_environment() {
        let o = python(
            "import os, sys\nprint(sys.stdin.read().upper(), end='|')\nprint(sorted(os.environ))",
            b"abc",
        );
        assert_eq!(o.exit, Exit::Code(0), "{o:?}");
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            "ABC|['HOME', 'LANG', 'PATH', 'TMPDIR']\n"
        );
    }

    #[test]
    fn only_the_scratch_directory_is_writable() {
        let o = python(
            "import os\nopen('out.txt', 'w').write('ok')\nprint(open('out.txt').read(), os.getcwd() == os.environ['HOME'])\nopen(os.path.dirname(__file__) + '/x', 'w')",
            b"",
        );
        assert_eq!(String::from_utf8_lossy(&o.stdout), "ok True\n");
        let reason = o.failure_reason(&Limits::default()).unwrap();
        let sb = Sandbox::new(Limits::default()).unwrap();
        let want = match sb.mode() {
            Mode::Full | Mode::RootNamespaces => "Read-only file system",
            _ => "exit status 1",
        };
        assert!(reason.contains(want), "{reason}");
    }

    #[test]
    fn exit_status_and_file_names() {
        let sb = Sandbox::new(Limits::default()).unwrap();
        let o = sb
            .run(&["sh", "-c", "exit 3"].map(String::from), &[], b"")
            .unwrap();
        assert_eq!(o.exit, Exit::Code(3));
        for bad in ["../x", "a/b", "", "scratch"] {
            let e = sb
                .run(&["true".to_string()], &[(bad, b"")], b"")
                .unwrap_err();
            assert!(matches!(e, SandboxError::FileName(_)), "{bad}: {e}");
        }
        let e = sb
            .run(&["no-such-program-oxrl".to_string()], &[], b"")
            .unwrap_err();
        assert!(e.to_string().contains("no-such-program-oxrl"), "{e}");
    }

    #[test]
    fn failure_reasons_name_the_limit_or_the_error() {
        let limits = Limits::default();
        let outcome = |exit, stderr: &str| RunOutcome {
            exit,
            stdout: Vec::new(),
            stderr: stderr.as_bytes().to_vec(),
            wall: Duration::ZERO,
            cpu: Duration::ZERO,
        };
        let reason = |o: RunOutcome| o.failure_reason(&limits);
        assert_eq!(reason(outcome(Exit::Code(0), "warning")), None);
        assert_eq!(
            reason(outcome(
                Exit::Code(1),
                "Traceback\n  x\nValueError: bad\n\n"
            ))
            .unwrap(),
            "exit status 1: ValueError: bad"
        );
        assert_eq!(reason(outcome(Exit::Code(2), "")).unwrap(), "exit status 2");
        assert_eq!(
            reason(outcome(Exit::Timeout, "")).unwrap(),
            "timed out after 5.0 s (wall clock)"
        );
        assert_eq!(
            reason(outcome(Exit::CpuLimit, "")).unwrap(),
            "CPU time limit (5 s)"
        );
        assert_eq!(
            reason(outcome(Exit::Signal(11), "")).unwrap(),
            "killed by signal 11 (SIGSEGV)"
        );
        assert_eq!(
            reason(outcome(Exit::OutputLimit, "")).unwrap(),
            "output over 65536 bytes"
        );
    }

    /// The sandbox's cost per run: `true` sandboxed against `true` spawned plainly.
    #[test]
    fn per_run_overhead_is_a_few_milliseconds() {
        let sb = Sandbox::new(Limits::default()).unwrap();
        let n = 20;
        let time = |f: &dyn Fn()| {
            f();
            let t = Instant::now();
            for _ in 0..n {
                f();
            }
            t.elapsed() / n
        };
        let plain = time(&|| {
            let s = Command::new("true").status().unwrap();
            assert!(s.success());
        });
        let sandboxed = time(&|| {
            let o = sb.run(&["true".to_string()], &[], b"").unwrap();
            assert_eq!(o.exit, Exit::Code(0));
        });
        let py = ["python3", "-I", "-B", "-c", "pass"].map(String::from);
        let plain_py = time(&|| {
            let s = Command::new("/usr/bin/python3")
                .args(&py[1..])
                .status()
                .unwrap();
            assert!(s.success());
        });
        let sandboxed_py = time(&|| {
            let o = sb.run(&py, &[], b"").unwrap();
            assert_eq!(o.exit, Exit::Code(0));
        });
        eprintln!(
            "true: plain {plain:.2?}, sandboxed {sandboxed:.2?}; python3: plain {plain_py:.2?}, sandboxed {sandboxed_py:.2?} ({:?})",
            sb.mode()
        );
        assert!(
            sandboxed < plain + Duration::from_millis(50),
            "sandboxed {sandboxed:?} vs plain {plain:?}"
        );
    }
}
