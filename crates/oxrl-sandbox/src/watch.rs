//! The parent's side of a run: the status pipe from the supervisor, the capped output readers,
//! and the wait that neither reaps nor blocks past the deadline.

use crate::SandboxError;
use std::io::{self, Read};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The pipe the supervisor reports through: PID 1's pid, then its wait status and CPU time.
pub(crate) fn status_pipe() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(SandboxError::StatusPipe(io::Error::last_os_error()));
    }
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads `stream` on a thread, keeping `cap` bytes; past the cap it flags `over` and stops
/// reading (the writer then gets EPIPE, and the run is killed).
pub(crate) fn read_capped(
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

/// Why [`wait_exit`] returned.
pub(crate) enum Waited {
    Exited,
    TimedOut,
    OverCap,
    OverMemory,
}

/// The memory of a whole run: the proportional set size of every process in its PID namespace,
/// summed. RLIMIT_AS bounds each process; this bounds their sum.
pub(crate) struct MemoryWatch {
    /// `/proc/<pid>/ns/pid` of the run's PID 1, e.g. `pid:[4026532301]`.
    namespace: std::path::PathBuf,
    limit_bytes: u64,
    page_bytes: u64,
    next: Instant,
}

/// How often [`MemoryWatch`] sums the run's memory.
pub(crate) const MEMORY_POLL: Duration = Duration::from_millis(20);

impl MemoryWatch {
    /// `None` when the run's namespace cannot be read (it has already exited).
    pub(crate) fn new(pid1: libc::pid_t, limit_mb: u64) -> Option<Self> {
        let namespace = std::fs::read_link(format!("/proc/{pid1}/ns/pid")).ok()?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        Some(Self {
            namespace,
            limit_bytes: limit_mb.saturating_mul(1 << 20),
            page_bytes: u64::try_from(page).unwrap_or(4096),
            next: Instant::now(),
        })
    }

    /// Resident bytes of the run's processes now.
    pub(crate) fn resident(&self) -> u64 {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return 0;
        };
        let mut total = 0;
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.as_encoded_bytes().iter().all(u8::is_ascii_digit) {
                continue;
            }
            let dir = e.path();
            if std::fs::read_link(dir.join("ns/pid")).ok().as_ref() != Some(&self.namespace) {
                continue;
            }
            // The proportional set size shares pages copied on write by a fork between the
            // processes that share them; statm's resident count (in pages) is the fallback.
            let pss_kb = std::fs::read_to_string(dir.join("smaps_rollup"))
                .ok()
                .and_then(|s| {
                    let line = s.lines().find(|l| l.starts_with("Pss:"))?;
                    line.split_whitespace().nth(1)?.parse::<u64>().ok()
                });
            total += match pss_kb {
                Some(kb) => kb * 1024,
                None => {
                    let pages = std::fs::read_to_string(dir.join("statm"))
                        .ok()
                        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
                        .unwrap_or(0);
                    pages * self.page_bytes
                }
            };
        }
        total
    }

    /// Whether the run is over its limit; sums at most every [`MEMORY_POLL`], and less often
    /// when a large `/proc` makes a sum slow (at most 5% of the time spent summing).
    fn over(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        let over = self.resident() > self.limit_bytes;
        self.next = now + MEMORY_POLL.max(now.elapsed() * 20);
        over
    }
}

/// Waits, without reaping, until `pid` exits, the deadline passes, the output cap is hit or the
/// run's processes together hold more memory than allowed.
pub(crate) fn wait_exit(
    pid: libc::pid_t,
    deadline: Instant,
    over: &AtomicBool,
    mut memory: Option<&mut MemoryWatch>,
) -> Waited {
    // SAFETY: pidfd_open on our own child; the descriptor is closed below.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as libc::c_int;
    let result = loop {
        if over.load(Ordering::SeqCst) {
            break Waited::OverCap;
        }
        if memory.as_mut().is_some_and(|m| m.over()) {
            break Waited::OverMemory;
        }
        let now = Instant::now();
        if now >= deadline {
            break Waited::TimedOut;
        }
        // Wake at least every 10 ms to notice the output cap and the memory.
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
            // SAFETY: siginfo_t is plain data, for which all zeroes is a valid value.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `info` is a valid out-parameter; WNOWAIT leaves the zombie for `wait`.
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
