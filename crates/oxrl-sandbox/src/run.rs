//! One sandboxed run: the command is spawned with a `pre_exec` hook ([`ChildSetup`]) that
//! isolates it, then watched from the parent until it exits, times out or writes too much.

use crate::child::{ChildSetup, RootEntry, STATUS_BYTES};
use crate::isolation::{detect_mode, Identity, Mode};
use crate::watch::{read_capped, status_pipe, wait_exit, MemoryWatch, Waited};
use crate::workdir::WorkDir;
use crate::{resolve_program, Exit, Limits, RunOutcome, SandboxError, SANDBOX_PATH};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The top-level host paths a run's root holds: programs, their libraries and `/etc`. `/proc` is
/// bound only so the run may mount its own over it (the kernel wants a visible one first).
const ROOT_PATHS: [&str; 9] = [
    "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc",
];

/// The device nodes a run's `/dev` holds, and its standard links.
const DEV_NODES: [&str; 5] = ["null", "zero", "full", "random", "urandom"];
const DEV_LINKS: [(&str, &str); 4] = [
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
];

/// `p` without its leading `/`.
fn rel(p: &Path) -> &Path {
    p.strip_prefix("/").unwrap_or(p)
}

/// The entries of a run's root under `new_root`: [`ROOT_PATHS`] as they are on the host
/// (bound or, for symlinks, recreated), `/dev`, and the directories on the way to `run_dir`.
fn root_entries(new_root: &Path, run_dir: &Path) -> Result<Vec<RootEntry>, SandboxError> {
    let cstr = |what, p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|source| SandboxError::NulByte { what, source })
    };
    let mut entries = Vec::new();
    for name in ROOT_PATHS {
        let host = Path::new("/").join(name);
        let dst = cstr("a root path", &new_root.join(name))?;
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(&host).map_err(|source| SandboxError::Io {
                    what: "cannot read the link",
                    path: host.clone(),
                    source,
                })?;
                entries.push(RootEntry::Symlink {
                    target: cstr("a root link", &target)?,
                    dst,
                });
            }
            Ok(m) if m.is_dir() => entries.push(RootEntry::Dir {
                src: cstr("a root path", &host)?,
                dst,
            }),
            _ => {}
        }
    }
    let dev = new_root.join("dev");
    entries.push(RootEntry::MkDir {
        dst: cstr("/dev", &dev)?,
    });
    for name in DEV_NODES {
        let host = Path::new("/dev").join(name);
        if host.exists() {
            entries.push(RootEntry::File {
                src: cstr("a device", &host)?,
                dst: cstr("a device", &dev.join(name))?,
            });
        }
    }
    for (name, target) in DEV_LINKS {
        entries.push(RootEntry::Symlink {
            target: cstr("a device link", Path::new(target))?,
            dst: cstr("a device link", &dev.join(name))?,
        });
    }
    let ancestors: Vec<&Path> = run_dir.ancestors().skip(1).collect();
    for a in ancestors.into_iter().rev() {
        if a != Path::new("/") {
            entries.push(RootEntry::MkDir {
                dst: cstr("the run directory", &new_root.join(rel(a)))?,
            });
        }
    }
    entries.push(RootEntry::MkDir {
        dst: cstr("the run directory", &new_root.join(rel(run_dir)))?,
    });
    Ok(entries)
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

    /// A sandbox with a given mode, for the probe runs that find the mode.
    pub(crate) fn with_mode(limits: Limits, mode: Mode, identity: Identity) -> Self {
        Self {
            limits,
            mode,
            identity,
        }
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
        let cstr = |what, s: String| {
            CString::new(s).map_err(|source| SandboxError::NulByte { what, source })
        };
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
            uid_map: cstr("the uid map", format!("{0} {0} 1\n", id.uid))?,
            gid_map: cstr("the gid map", format!("{0} {0} 1\n", id.gid))?,
            scratch: cstr("the scratch path", dir.scratch.display().to_string())?,
            new_root: cstr("the new root", dir.new_root().display().to_string())?,
            root_entries: root_entries(&dir.new_root(), &dir.path)?,
            run_dir: cstr("the run directory", dir.path.display().to_string())?,
            run_dir_in_root: cstr(
                "the run directory",
                dir.new_root().join(rel(&dir.path)).display().to_string(),
            )?,
            tmpfs_options: cstr(
                "the tmpfs options",
                format!(
                    "size={}m,mode=0700,uid={},gid={}",
                    l.scratch_mb, id.uid, id.gid
                ),
            )?,
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
        // With a PID namespace, the run's processes are found by it and their memory summed.
        let mut memory = target
            .filter(|_| self.mode.namespaces())
            .and_then(|pid| MemoryWatch::new(pid, self.limits.memory_mb));
        let waited = wait_exit(
            supervisor,
            start + self.limits.timeout,
            &over,
            memory.as_mut(),
        );
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
            (Waited::TimedOut | Waited::OverCap | Waited::OverMemory, Some(pid)) => {
                kill_program(pid);
                let grace = Instant::now() + Duration::from_secs(1);
                wait_exit(supervisor, grace, &AtomicBool::new(false), None);
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
        let mut report = [0u8; STATUS_BYTES];
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
            (Waited::OverMemory, _) => Exit::MemoryLimit,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

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

    fn python_with(limits: Limits, code: &str) -> RunOutcome {
        let sb = Sandbox::new(limits).unwrap();
        let cmd = ["python3", "-I", "-B", "{dir}/main.py"].map(String::from);
        sb.run(&cmd, &[("main.py", code.as_bytes())], b"").unwrap()
    }

    /// Forks `n` children that sleep, prints how many forks succeeded.
    fn forks(n: usize) -> String {
        format!(
            "import os, time\npids = []\nfor _ in range({n}):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n        time.sleep(1.5)\n        os._exit(0)\n    pids.append(pid)\nprint(len(pids))\nfor p in pids:\n    os.waitpid(p, 0)"
        )
    }

    #[test]
    fn the_process_limit_is_per_run_not_per_user() {
        let limits = Limits {
            max_processes: 16,
            ..Limits::default()
        };
        // Two runs at once, each forking 12 (13 processes of 16): neither eats the other's quota.
        let runs: Vec<_> = (0..2)
            .map(|_| {
                let limits = limits.clone();
                std::thread::spawn(move || python_with(limits, &forks(12)))
            })
            .collect();
        for r in runs {
            let o = r.join().unwrap();
            assert_eq!(String::from_utf8_lossy(&o.stdout), "12\n", "{o:?}");
        }
        // Forty processes of the run's user on the host do not count against the run either.
        let mut host = Command::new("sleep");
        host.arg("5");
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            host.uid(65534).gid(65534);
        }
        let mut load: Vec<_> = (0..40).map(|_| host.spawn().unwrap()).collect();
        let o = python_with(limits.clone(), &forks(12));
        // Past the limit, forks fail inside the run and the run goes on.
        let capped = python_with(limits, &forks(30));
        for c in &mut load {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert_eq!(String::from_utf8_lossy(&o.stdout), "12\n", "{o:?}");
        let n: usize = String::from_utf8_lossy(&capped.stdout)
            .trim()
            .parse()
            .unwrap();
        assert!((10..16).contains(&n), "{capped:?}");
    }

    #[test]
    fn memory_is_limited_per_run_not_per_process() {
        let limits = Limits {
            memory_mb: 256,
            timeout: Duration::from_secs(5),
            ..Limits::default()
        };
        // Eight processes of 128 MiB each: each is under RLIMIT_AS, together four times over.
        let code = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        b = bytearray(128 << 20)\n        time.sleep(4)\n        os._exit(0)\nfor _ in range(8):\n    os.wait()";
        let start = Instant::now();
        let o = python_with(limits.clone(), code);
        assert_eq!(o.exit, Exit::MemoryLimit, "{o:?}");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        // One process of 128 MiB is fine.
        let o = python_with(limits, "b = bytearray(128 << 20)\nprint(len(b) >> 20)");
        assert_eq!(String::from_utf8_lossy(&o.stdout), "128\n", "{o:?}");
    }

    #[test]
    fn host_sockets_and_directories_are_out_of_reach() {
        let id = std::process::id();
        let path = std::env::temp_dir().join(format!("oxrl-sock-{id}"));
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let abstract_name = format!("oxrl-abstract-{id}");
        let addr = <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(abstract_name.as_bytes())
            .unwrap();
        let abstract_listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        abstract_listener.set_nonblocking(true).unwrap();
        let code = format!(
            "import os, socket\nfor a in [{path:?}, '\\0{abstract_name}']:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(a)\n        print('reached', repr(a))\n    except OSError as e:\n        print(type(e).__name__)\nprint(sorted(os.listdir('/')))\nprint(os.path.exists('/dev/shm'), os.path.exists('/run'), os.path.exists('/home'))",
            path = path.display().to_string()
        );
        let o = python_with(Limits::default(), &code);
        let _ = std::fs::remove_file(&path);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!out.contains("reached"), "{out}");
        assert!(listener.accept().is_err() && abstract_listener.accept().is_err());
        let sb = Sandbox::new(Limits::default()).unwrap();
        if sb.mode() == Mode::Full {
            assert!(out.ends_with("False False False\n"), "{out}");
            assert!(!out.contains("'home'") && !out.contains("'run'"), "{out}");
        }
    }

    /// Every mode this machine allows runs a program, and the mount modes show it only the
    /// run's own root (the fallbacks must not break where only they work).
    #[test]
    fn every_mode_runs_a_program_in_its_layout() {
        let id = Identity::current();
        let mut modes = vec![Mode::Full, Mode::NamespacesOnly, Mode::Minimal];
        if id.drop_from_root {
            modes.push(Mode::RootNamespaces);
        }
        let code =
            "import os\nprint(os.path.exists('/tmp/oxrl-sandbox-probe'), os.path.exists('/home'))";
        let cmd = ["python3", "-I", "-B", "-c", code].map(String::from);
        std::fs::write("/tmp/oxrl-sandbox-probe", b"").ok();
        for mode in modes {
            let sb = Sandbox::with_mode(Limits::default(), mode, id);
            let o = sb
                .run(&cmd, &[], b"")
                .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            let out = String::from_utf8_lossy(&o.stdout);
            assert_eq!(o.exit, Exit::Code(0), "{mode:?}: {o:?}");
            if mode.mounts() {
                assert_eq!(out, "False False\n", "{mode:?}");
            }
        }
        std::fs::remove_file("/tmp/oxrl-sandbox-probe").ok();
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
