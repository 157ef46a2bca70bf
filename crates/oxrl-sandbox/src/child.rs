//! What runs between `fork` and `exec` of a sandboxed command (Linux only).
//!
//! `std::process::Command` forks; our `pre_exec` hook then runs in that child, which becomes the
//! run's *supervisor*: it starts a new session, drops root to `nobody`, enters new user, mount,
//! network, PID and IPC namespaces, pivots into a new root that holds only `/usr`, `/etc`, the
//! library and binary directories, a few `/dev` nodes and the run directory — all read-only
//! except a size-capped tmpfs scratch directory — marks every inherited descriptor
//! close-on-exec, and forks once more. The grandchild — PID 1 of the new PID namespace — starts
//! its own session, mounts its own `/proc`, applies the rlimits and returns to `std`, which
//! execs the command. The supervisor
//! never returns: it reports the grandchild's pid, waits for it, reports its wait status and CPU
//! time through a pipe and exits. So the command never sees or reaches its real parent
//! (`getppid()` is 0, its process group is its own), and when PID 1 exits or is killed the
//! kernel kills everything else in the namespace: nothing the command started outlives the run.
//!
//! Being PID 1 has one cost: the kernel does not deliver signals to a namespace's init that it
//! has no handler for unless they are SIGKILL or SIGSTOP, so SIGXCPU and SIGXFSZ do nothing (the
//! CPU limit is therefore set with soft = hard, which kills with SIGKILL; a write past the file
//! size limit fails with EFBIG instead of killing).
//!
//! Everything here must be async-signal-safe (the parent may have many threads): no allocation,
//! no locks — every path and string is prepared before the fork.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;

use crate::isolation::Mode;

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const AT_RECURSIVE: libc::c_uint = 0x8000;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// One thing of the new root; `dst` paths are under the new root's mount point.
pub enum RootEntry {
    /// A host directory bound (recursively) at the same path.
    Dir { src: CString, dst: CString },
    /// A host file (a device node) bound at the same path.
    File { src: CString, dst: CString },
    /// A host symlink recreated (`/bin -> usr/bin`).
    Symlink { target: CString, dst: CString },
    /// A directory on the way to the run directory.
    MkDir { dst: CString },
}

/// Everything the child needs, built before the fork.
pub struct ChildSetup {
    pub mode: Mode,
    /// `(uid, gid)` to switch to when running as root.
    pub drop_to: Option<(libc::uid_t, libc::gid_t)>,
    /// `"<id> <id> 1\n"` lines for uid_map / gid_map (the run keeps its outer ids).
    pub uid_map: CString,
    pub gid_map: CString,
    /// The scratch directory: cwd, and the tmpfs mount point in the mount modes (the same path
    /// inside the new root as outside).
    pub scratch: CString,
    /// Where the new root's tmpfs is mounted before `pivot_root` (`<run dir>/.root`).
    pub new_root: CString,
    /// What the new root holds, made in this order.
    pub root_entries: Vec<RootEntry>,
    /// The run directory, and the same path under `new_root` that it is bound to.
    pub run_dir: CString,
    pub run_dir_in_root: CString,
    pub tmpfs_options: CString,
    /// `(resource, soft, hard)`, applied in the grandchild just before exec.
    pub rlimits: Vec<(libc::__rlimit_resource_t, libc::rlim_t, libc::rlim_t)>,
    /// Write end of the status pipe (close-on-exec).
    pub status_fd: RawFd,
}

fn check(r: libc::c_int) -> io::Result<()> {
    match r {
        -1 => Err(io::Error::last_os_error()),
        _ => Ok(()),
    }
}

fn c(s: &'static [u8]) -> *const libc::c_char {
    s.as_ptr().cast()
}

/// Writes `bytes` to the file at `path` (NUL-terminated).
fn write_file(path: *const libc::c_char, bytes: &[u8]) -> io::Result<()> {
    // SAFETY: `path` is NUL-terminated; both outlive the calls.
    unsafe {
        let fd = libc::open(path, libc::O_WRONLY | libc::O_CLOEXEC);
        check(fd)?;
        let n = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
        libc::close(fd);
        match n == bytes.len() as isize {
            true => Ok(()),
            false => Err(io::Error::last_os_error()),
        }
    }
}

impl ChildSetup {
    fn drop_ids(&self) -> io::Result<()> {
        if let Some((uid, gid)) = self.drop_to {
            // SAFETY: plain syscalls on this process's credentials.
            unsafe {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(gid, gid, gid))?;
                check(libc::setresuid(uid, uid, uid))?;
                // Changing ids makes the process non-dumpable, which hands /proc/self to root
                // and would forbid writing our own uid_map.
                check(libc::prctl(libc::PR_SET_DUMPABLE, 1))?;
            }
        }
        Ok(())
    }

    /// A new root holding only what programs need (see [`RootEntry`]) and the run directory,
    /// all read-only and `nosuid`, with the scratch tmpfs as the one writable mount. The host's
    /// `/tmp`, `/run`, `/dev/shm`, `/home`, `/var`… are not in it, so no host Unix socket,
    /// shared-memory file or home directory can be reached by path.
    fn mounts(&self) -> io::Result<()> {
        // SAFETY: every pointer is a NUL-terminated string or a struct that outlives the call.
        unsafe {
            check(libc::mount(
                std::ptr::null(),
                c(b"/\0"),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c(b"tmpfs\0"),
                self.new_root.as_ptr(),
                c(b"tmpfs\0"),
                libc::MS_NOSUID | libc::MS_NODEV,
                c(b"size=1m,mode=0755\0").cast(),
            ))?;
            for e in &self.root_entries {
                match e {
                    RootEntry::Dir { src, dst } => {
                        check(libc::mkdir(dst.as_ptr(), 0o755))?;
                        check(libc::mount(
                            src.as_ptr(),
                            dst.as_ptr(),
                            std::ptr::null(),
                            libc::MS_BIND | libc::MS_REC,
                            std::ptr::null(),
                        ))?;
                    }
                    RootEntry::File { src, dst } => {
                        let fd = libc::open(
                            dst.as_ptr(),
                            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                            0o644,
                        );
                        check(fd)?;
                        libc::close(fd);
                        check(libc::mount(
                            src.as_ptr(),
                            dst.as_ptr(),
                            std::ptr::null(),
                            libc::MS_BIND,
                            std::ptr::null(),
                        ))?;
                    }
                    RootEntry::Symlink { target, dst } => {
                        check(libc::symlink(target.as_ptr(), dst.as_ptr()))?;
                    }
                    RootEntry::MkDir { dst } => {
                        // An ancestor of the run directory may already exist (inside a bind).
                        if libc::mkdir(dst.as_ptr(), 0o755) == -1
                            && *libc::__errno_location() != libc::EEXIST
                        {
                            return Err(io::Error::last_os_error());
                        }
                    }
                }
            }
            check(libc::mount(
                self.run_dir.as_ptr(),
                self.run_dir_in_root.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ))?;
            // pivot_root(".", ".") stacks the old root on the new one; detaching it leaves only
            // the new root in this mount namespace.
            check(libc::chdir(self.new_root.as_ptr()))?;
            check(libc::syscall(libc::SYS_pivot_root, c(b".\0"), c(b".\0")) as libc::c_int)?;
            check(libc::umount2(c(b".\0"), libc::MNT_DETACH))?;
            check(libc::chdir(c(b"/\0")))?;
            let attr = MountAttr {
                attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID,
                attr_clr: 0,
                propagation: 0,
                userns_fd: 0,
            };
            let r = libc::syscall(
                libc::SYS_mount_setattr,
                libc::AT_FDCWD,
                c(b"/\0"),
                AT_RECURSIVE,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            );
            check(r as libc::c_int)?;
            check(libc::mount(
                c(b"tmpfs\0"),
                self.scratch.as_ptr(),
                c(b"tmpfs\0"),
                libc::MS_NOSUID | libc::MS_NODEV,
                self.tmpfs_options.as_ptr().cast(),
            ))?;
        }
        Ok(())
    }

    /// Runs in the forked child (the supervisor-to-be). Returns only in the grandchild, or with
    /// an error that `std` reports to the parent as the spawn's failure.
    pub fn run(&self) -> io::Result<()> {
        // SAFETY: async-signal-safe syscalls on this (single-threaded) child only.
        unsafe {
            check(libc::setsid())?;
            match self.mode {
                Mode::Full | Mode::NamespacesOnly => {
                    self.drop_ids()?;
                    check(libc::unshare(
                        libc::CLONE_NEWUSER
                            | libc::CLONE_NEWNS
                            | libc::CLONE_NEWNET
                            | libc::CLONE_NEWPID
                            | libc::CLONE_NEWIPC,
                    ))?;
                    // Without setgroups denied, an unprivileged process may not write gid_map.
                    write_file(c(b"/proc/self/setgroups\0"), b"deny")?;
                    write_file(c(b"/proc/self/uid_map\0"), self.uid_map.as_bytes())?;
                    write_file(c(b"/proc/self/gid_map\0"), self.gid_map.as_bytes())?;
                }
                Mode::RootNamespaces => {
                    check(libc::unshare(
                        libc::CLONE_NEWNS
                            | libc::CLONE_NEWNET
                            | libc::CLONE_NEWPID
                            | libc::CLONE_NEWIPC,
                    ))?;
                }
                Mode::Minimal => self.drop_ids()?,
            }
            if self.mode.mounts() {
                self.mounts()?;
            }
            check(libc::chdir(self.scratch.as_ptr()))?;
            // No descriptor of the parent (sockets among them) survives the exec.
            check(libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            ) as libc::c_int)?;
            let pid = libc::fork();
            check(pid)?;
            if pid == 0 {
                return self.grandchild();
            }
            self.supervise(pid)
        }
    }

    /// PID 1 of the run's namespace: its own session (so nothing it signals reaches the
    /// supervisor), its own /proc, `nobody` (without a user namespace: proc had to be mounted
    /// as root), dies with the supervisor, and the limits.
    unsafe fn grandchild(&self) -> io::Result<()> {
        check(libc::setsid())?;
        if self.mode == Mode::Full || self.mode == Mode::RootNamespaces {
            check(libc::mount(
                c(b"proc\0"),
                c(b"/proc\0"),
                c(b"proc\0"),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                std::ptr::null(),
            ))?;
        }
        if self.mode == Mode::RootNamespaces {
            self.drop_ids()?;
        }
        // After the id change, which clears the parent-death signal.
        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL))?;
        for &(resource, soft, hard) in &self.rlimits {
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            check(libc::setrlimit(resource, &lim))?;
        }
        Ok(())
    }

    /// The supervisor: reports the grandchild's pid, waits for it, reports its wait status and
    /// CPU time, exits. Never returns.
    unsafe fn supervise(&self, pid: libc::pid_t) -> ! {
        // Keep only the status pipe: the parent's exec-error pipe and the stdio pipes must close
        // when the command's side closes, not when the supervisor exits.
        let fd = self.status_fd as u32;
        if fd > 0 {
            libc::syscall(libc::SYS_close_range, 0u32, fd - 1, 0u32);
        }
        libc::syscall(libc::SYS_close_range, fd + 1, u32::MAX, 0u32);
        let mut report = [0u8; STATUS_BYTES];
        report[..4].copy_from_slice(&pid.to_ne_bytes());
        libc::write(self.status_fd, report.as_ptr().cast(), 4);
        let mut status: libc::c_int = 0;
        let mut usage: libc::rusage = std::mem::zeroed();
        loop {
            let r = libc::wait4(pid, &mut status, 0, &mut usage);
            if r == pid {
                break;
            }
            if r == -1 && *libc::__errno_location() != libc::EINTR {
                libc::_exit(1);
            }
        }
        let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        let cpu = micros(usage.ru_utime) + micros(usage.ru_stime);
        report[..4].copy_from_slice(&status.to_ne_bytes());
        report[4..].copy_from_slice(&cpu.to_ne_bytes());
        libc::write(self.status_fd, report.as_ptr().cast(), STATUS_BYTES);
        libc::_exit(0)
    }
}

/// The supervisor's final report: the wait status (4 bytes) and CPU microseconds (8 bytes),
/// after the grandchild's pid (4 bytes) sent at the start.
pub const STATUS_BYTES: usize = 12;
