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
}

/// Waits, without reaping, until `pid` exits, the deadline passes or the output cap is hit.
pub(crate) fn wait_exit(pid: libc::pid_t, deadline: Instant, over: &AtomicBool) -> Waited {
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
