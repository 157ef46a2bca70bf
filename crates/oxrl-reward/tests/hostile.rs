//! The hostile suite: snippets that attack the machine or cheat the code reward. Each must be
//! scored 0 and contained — the run ended (killed, non-zero exit, or no harness token), no
//! process of it alive afterwards, nothing written outside its scratch directory, the test
//! process, a bystander process and the servers it tries to reach untouched, no secret of the
//! parent's environment or files in its output — whatever else runs: the suite runs alone, twice
//! at once, and beside a CPU- and process-heavy load of the runs' own user. The verdict is the
//! containment, never which error text a run died with (that depends on the machine's load);
//! reasons are printed, not asserted.
//!
//! The three tests take one lock, so "alone" is alone and the secret is set in this process's
//! environment (once, to a constant) while no other thread spawns anything.

use oxrl_reward::code::{CodeReward, CodeSpec, Scoring};
use oxrl_reward::sandbox::{Limits, Mode};
use oxrl_reward::RewardInput;
use serde_json::{json, Value};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

const SECRET_VAR: &str = "OXRL_HOSTILE_SECRET";
const SECRET: &str = "s3cr3t-oxrl-hostile-env";
/// What the secret file outside the run holds.
const FILE_SECRET: &str = "s3cr3t-oxrl-hostile-file";
/// Snippets in the suite (README.md lists each).
const CASES: usize = 29;
const TIMEOUT: Duration = Duration::from_secs(2);

/// Serialises the tests of this file and sets the secret before the first spawns anything.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    static SECRET_SET: Once = Once::new();
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    SECRET_SET.call_once(|| std::env::set_var(SECRET_VAR, SECRET));
    guard
}

fn input(code: &str, tests: Value) -> RewardInput {
    let mut row = serde_json::Map::new();
    row.insert("tests".into(), tests);
    RewardInput {
        prompt: "Write add(a, b).".into(),
        response: format!("Here it is:\n```python\n{code}\n```\n"),
        row,
        response_tokens: 0,
    }
}

fn reward() -> CodeReward {
    let mut spec = CodeSpec::for_language("python");
    spec.scoring = Scoring::All;
    spec.limits = Limits {
        timeout: TIMEOUT,
        cpu_s: 1,
        memory_mb: 256,
        ..Limits::default()
    };
    let reward = CodeReward::new(spec).unwrap();
    assert_eq!(
        reward.sandbox().mode(),
        Mode::Full,
        "this suite checks the full isolation (CI runs on a kernel that allows it)"
    );
    reward
}

fn parent_of(pid: &str) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid …; comm may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1).map(str::to_string)
}

/// Processes in another PID namespace than ours that descend from this test process: only our
/// sandboxed runs make those (an orphan inside a run is adopted by the run's PID 1, which is
/// ours, so a survivor cannot leave the tree).
fn our_foreign_processes() -> Vec<String> {
    let ours = std::fs::read_link("/proc/self/ns/pid").unwrap();
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        match std::fs::read_link(e.path().join("ns/pid")) {
            Ok(ns) if ns != ours => {}
            _ => continue,
        }
        let mut p = name.clone();
        for _ in 0..64 {
            match parent_of(&p) {
                Some(pp) if pp == me => {
                    let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                    found.push(format!("{name}: {}", String::from_utf8_lossy(&cmd)));
                    break;
                }
                Some(pp) if pp != "0" && pp != "1" => p = pp,
                _ => break,
            }
        }
    }
    found
}

/// Waits up to two seconds for killed runs' namespaces to finish tearing down.
fn assert_no_survivors(case: &str) {
    let start = Instant::now();
    loop {
        let left = our_foreign_processes();
        if left.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{case}: processes survived the run: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_dirs() -> Vec<PathBuf> {
    let prefix = format!("oxrl-sandbox-{}-", std::process::id());
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

/// What one suite pass needs outside the runs: the targets the snippets attack.
struct Targets {
    bystander: Child,
    server: std::net::TcpListener,
    unix_path: PathBuf,
    unix_server: std::os::unix::net::UnixListener,
    abstract_name: String,
    abstract_server: std::os::unix::net::UnixListener,
    secret_file: PathBuf,
    outside: Vec<PathBuf>,
}

impl Targets {
    fn new(tag: &str) -> Self {
        let tag = format!("{}-{tag}", std::process::id());
        let bystander = Command::new("sleep").arg("60").spawn().unwrap();
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        server.set_nonblocking(true).unwrap();
        let unix_path = std::env::temp_dir().join(format!("oxrl-hostile-sock-{tag}"));
        let _ = std::fs::remove_file(&unix_path);
        let unix_server = std::os::unix::net::UnixListener::bind(&unix_path).unwrap();
        unix_server.set_nonblocking(true).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let open = std::fs::Permissions::from_mode(0o777);
        std::fs::set_permissions(&unix_path, open).unwrap();
        let abstract_name = format!("oxrl-hostile-{tag}");
        let addr = <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            abstract_name.as_bytes(),
        )
        .unwrap();
        let abstract_server = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        abstract_server.set_nonblocking(true).unwrap();
        let secret_file = std::env::temp_dir().join(format!("oxrl-hostile-secret-{tag}"));
        std::fs::write(&secret_file, FILE_SECRET).unwrap();
        std::fs::set_permissions(&secret_file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let outside = [
            std::env::temp_dir(),
            PathBuf::from("/dev/shm"),
            PathBuf::from("/run"),
            PathBuf::from("/var/tmp"),
            PathBuf::from(env!("CARGO_MANIFEST_DIR")),
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())),
        ]
        .iter()
        .map(|d| d.join(format!("oxrl-hostile-{tag}")))
        .collect();
        Targets {
            bystander,
            server,
            unix_path,
            unix_server,
            abstract_name,
            abstract_server,
            secret_file,
            outside,
        }
    }

    /// Nothing outside the run was touched.
    fn check(&mut self, case: &str) {
        for p in &self.outside {
            assert!(!p.exists(), "{case} wrote {}", p.display());
        }
        assert!(
            self.bystander.try_wait().unwrap().is_none(),
            "{case} killed a bystander process"
        );
        assert!(
            self.server.accept().is_err(),
            "{case} reached a TCP server on localhost"
        );
        assert!(
            self.unix_server.accept().is_err() && self.abstract_server.accept().is_err(),
            "{case} reached a Unix socket of the host"
        );
        assert_eq!(
            std::fs::read_to_string(&self.secret_file).unwrap(),
            FILE_SECRET,
            "{case} changed a file outside"
        );
    }
}

impl Drop for Targets {
    fn drop(&mut self) {
        let _ = self.bystander.kill();
        let _ = self.bystander.wait();
        let _ = std::fs::remove_file(&self.unix_path);
        let _ = std::fs::remove_file(&self.secret_file);
    }
}

/// `(name, snippet, tests)`: every snippet must score 0.
fn cases(t: &Targets) -> Vec<(&'static str, String, Value)> {
    let add = json!(["assert add(2, 3) == 5"]);
    let quoted = |p: &Path| format!("{:?}", p.display().to_string());
    let outside = t.outside.iter().map(|p| quoted(p)).collect::<Vec<_>>();
    let outside = outside.join(", ");
    let write_all = |paths: &str| {
        format!(
            "errors = []\nfor p in [{paths}]:\n    try:\n        with open(p, 'w') as f:\n            f.write('escaped')\n    except OSError as e:\n        errors.append(e)\nif errors:\n    raise errors[0]"
        )
    };
    let port = t.server.local_addr().unwrap().port();
    let bystander = t.bystander.id();
    let secret_file = quoted(&t.secret_file);
    let unix_path = quoted(&t.unix_path);
    let abstract_name = &t.abstract_name;
    let add_then = |code: &str| format!("{code}\ndef add(a, b):\n    return a + b");
    vec![
        // Resources.
        ("infinite loop", "while True:\n    pass".into(), add.clone()),
        ("fork bomb", "import os\nwhile True:\n    os.fork()".into(), add.clone()),
        (
            "memory bomb",
            "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))".into(),
            add.clone(),
        ),
        (
            "memory across processes (8 x 128 MiB under 256 MiB)",
            add_then("import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        b = bytearray(128 << 20)\n        time.sleep(10)\n        os._exit(0)\ntime.sleep(10)"),
            add.clone(),
        ),
        (
            "many threads burning CPU",
            // Three threads and the main one: each thread's malloc arena reserves 64 MiB of the
            // 256 MiB address space, so more would not start.
            add_then("import hashlib, threading\nthreading.stack_size(1 << 16)\ndata = b'x' * (1 << 20)\ndef burn():\n    while True:\n        hashlib.sha256(data).digest()\nfor _ in range(3):\n    threading.Thread(target=burn, daemon=True).start()\nburn()"),
            add.clone(),
        ),
        (
            "huge output",
            "while True:\n    print('x' * 4096)".into(),
            add.clone(),
        ),
        (
            "huge stderr only",
            add_then("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)"),
            add.clone(),
        ),
        (
            "filling the scratch",
            "import os\nn = 0\ntry:\n    while True:\n        with open(f'fill{n}', 'wb') as f:\n            f.write(b'x' * (8 << 20))\n        n += 1\nexcept OSError:\n    pass\nprint('unbounded' if n * 8 > 64 else 'bounded')".into(),
            json!([{"input": "", "output": "unbounded"}]),
        ),
        ("sleeping past the timeout", "import time\ntime.sleep(60)".into(), add.clone()),
        (
            "ignoring SIGTERM",
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    time.sleep(1)".into(),
            add.clone(),
        ),
        // Escapes.
        ("writing outside the directory", write_all(&outside), add.clone()),
        (
            "writing /dev/shm and other tmpfs",
            write_all("'/dev/shm/oxrl', '/run/oxrl', '/run/user/0/oxrl', '/tmp/oxrl', '/var/tmp/oxrl', '/dev/mqueue/oxrl'"),
            add.clone(),
        ),
        (
            "opening a socket",
            format!("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"),
            add.clone(),
        ),
        (
            "a host Unix socket by path and abstract name",
            format!("import socket\nfor a in [{unix_path}, '\\0{abstract_name}']:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(a)\n        s.send(b'hi')\n        print('reached')\n    except OSError:\n        pass"),
            json!([{"input": "", "output": "reached\nreached"}]),
        ),
        (
            "killing the parent",
            format!(
                "import os, signal\nkilled = []\ntargets = [os.getppid(), {bystander}] + [int(p) for p in os.listdir('/proc') if p.isdigit()]\nfor pid in targets:\n    if pid in (0, os.getpid()):\n        continue\n    try:\n        os.kill(pid, signal.SIGKILL)\n        killed.append(pid)\n    except OSError:\n        pass\nprint('killed', killed if killed else 'nothing')"
            ),
            json!([{"input": "", "output": "killed a process outside"}]),
        ),
        (
            "kill(-1, SIGKILL)",
            "import os, signal, time\nfor _ in range(2):\n    if os.fork() == 0:\n        time.sleep(60)\nos.kill(-1, signal.SIGKILL)\nprint('done')".into(),
            json!([{"input": "", "output": "killed everything"}]),
        ),
        (
            "reading environment secrets",
            format!(
                "import os\nfound = os.environ.get('{SECRET_VAR}', '')\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n    try:\n        env = open(f'/proc/{{pid}}/environ', 'rb').read()\n    except OSError:\n        continue\n    for kv in env.split(b'\\0'):\n        if kv.startswith(b'{SECRET_VAR}='):\n            found = kv.split(b'=', 1)[1].decode()\nprint(found)"
            ),
            json!([{"input": "", "output": SECRET}]),
        ),
        (
            "reading the parent's files through /proc",
            format!(
                "import os\nfound = ''\npaths = [{secret_file}]\nfor pid in ['self', '1', str(os.getppid())] + [p for p in os.listdir('/proc') if p.isdigit()]:\n    for link in ['root', 'cwd']:\n        paths.append(f'/proc/{{pid}}/{{link}}' + {secret_file})\n        paths.append(f'/proc/{{pid}}/{{link}}/../../../..' + {secret_file})\nfor p in paths:\n    try:\n        found = open(p).read()\n        break\n    except OSError:\n        pass\nprint(found)"
            ),
            json!([{"input": "", "output": FILE_SECRET}]),
        ),
        (
            "a daemon outliving its parent",
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)".into(),
            add.clone(),
        ),
        (
            "double fork and setsid",
            "import os, signal, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        signal.signal(signal.SIGHUP, signal.SIG_IGN)\n        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n        for fd in (0, 1, 2):\n            os.close(fd)\n        time.sleep(60)\n    os._exit(0)\nos.wait()\nprint('detached')".into(),
            json!([{"input": "", "output": "survived"}]),
        ),
        // Cheats on the code reward: each would score 1 without the harness.
        (
            "cheat: early os._exit(0)",
            "import os\nos._exit(0)".into(),
            add.clone(),
        ),
        (
            "cheat: sys.exit replaced, SystemExit(0)",
            "import sys\nsys.exit = lambda *a: None\nraise SystemExit(0)".into(),
            add.clone(),
        ),
        (
            "cheat: builtins replaced",
            "import builtins\nclass Never(Exception):\n    pass\nbuiltins.AssertionError = Never\nbuiltins.isinstance = lambda *a: True\nbuiltins.len = lambda x: 5\ndef add(a, b):\n    return 0".into(),
            add.clone(),
        ),
        (
            "cheat: atexit",
            "import atexit, os, sys\natexit.register(lambda: os._exit(0))\nsys.excepthook = lambda *a: os._exit(0)\ndef add(a, b):\n    return 0".into(),
            add.clone(),
        ),
        (
            "cheat: __eq__ always True",
            "class Anything:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\ndef add(a, b):\n    return Anything()".into(),
            add.clone(),
        ),
        (
            "cheat: int subclass with __eq__",
            "class Five(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\ndef add(a, b):\n    return Five(0)".into(),
            add.clone(),
        ),
        (
            "cheat: reading its own file for the tests",
            "import re, sys\nsrc = ''\nfor p in [sys.argv[0], '/proc/self/fd/0', '/dev/stdin']:\n    try:\n        src += open(p).read()\n    except OSError:\n        pass\ntable = {(int(a), int(b)): int(c) for a, b, c in re.findall(r'add\\((\\d+), (\\d+)\\) == (\\d+)', src)}\ndef add(a, b):\n    return table[(a, b)]".into(),
            add.clone(),
        ),
        (
            "cheat: walking up the frames for the token",
            "import os, sys\ndef add(a, b):\n    f = sys._getframe()\n    while f:\n        for v in list(f.f_locals.values()):\n            if isinstance(v, bytes) and len(v) == 34:\n                os.write(1, v)\n                os._exit(0)\n        f = f.f_back\n    return 0".into(),
            add.clone(),
        ),
        (
            "cheat: printing a guessed token",
            "import os, sys\nfor guess in ['0' * 32, 'f' * 32, 'ok', 'PASS']:\n    print(guess)\nsys.stdout.flush()\nos._exit(0)".into(),
            add.clone(),
        ),
    ]
}

/// One pass of the suite; `alone` when no other run of ours is alive (then survivors are
/// checked after each case, else by the caller once every pass has ended).
fn suite(tag: &str, alone: bool) -> Duration {
    let reward = reward();
    let mut targets = Targets::new(tag);
    let cases = cases(&targets);
    assert_eq!(cases.len(), CASES, "README.md lists {CASES} snippets");
    let start = Instant::now();
    for (name, code, tests) in &cases {
        let t = Instant::now();
        let v = reward.evaluate(&input(code, tests.clone())).unwrap();
        let took = t.elapsed();
        let reason = v.tests[0].reason.clone().unwrap_or_default();
        eprintln!("[{tag}] {name:<46} {took:>9.2?}  {reason}");
        assert_eq!(v.score, 0.0, "[{tag}] {name}: {v:?}");
        assert!(v.tests[0].reason.is_some(), "[{tag}] {name}: no reason");
        assert!(
            took < TIMEOUT + Duration::from_secs(6),
            "[{tag}] {name} took {took:?} with a {TIMEOUT:?} timeout"
        );
        // The reason shows what the program printed after "got" (before it, what was expected).
        let printed = reason.rsplit(", got ").next().unwrap_or_default();
        assert!(
            !printed.contains(SECRET) && !printed.contains(FILE_SECRET),
            "[{tag}] {name} leaked a secret: {reason}"
        );
        if alone {
            assert_no_survivors(name);
        }
        targets.check(name);
    }
    // The same sandbox still passes a correct solution.
    let ok = reward
        .evaluate(&input(
            "def add(a, b):\n    return a + b",
            json!(["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]),
        ))
        .unwrap();
    assert_eq!(ok.score, 1.0, "[{tag}] control: {ok:?}");
    let took = start.elapsed();
    eprintln!("[{tag}] hostile suite: {took:.2?}");
    took
}

/// After every pass: nothing of any run alive, no run directory left.
fn assert_clean() {
    assert_no_survivors("the suite");
    assert!(run_dirs().is_empty(), "left behind: {:?}", run_dirs());
}

#[test]
fn hostile_snippets_are_contained_and_scored_as_failures() {
    let _lock = exclusive();
    // The survivors check is not vacuous: it sees both processes of a live run.
    let reward = reward();
    let code = "import os, time\nos.fork()\ntime.sleep(1)";
    let live = std::thread::spawn(move || reward.evaluate(&input(code, json!("pass"))).unwrap());
    let start = Instant::now();
    let mut seen = Vec::new();
    while seen.len() < 2 && start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(20));
        seen = our_foreign_processes();
    }
    live.join().unwrap();
    assert!(
        seen.len() >= 2,
        "the survivors check missed a live run: {seen:?}"
    );
    assert_clean();
    suite("alone", true);
    assert_clean();
}

#[test]
fn two_hostile_suites_at_once_give_the_same_verdicts() {
    let _lock = exclusive();
    let passes: Vec<_> = ["A", "B"]
        .map(|tag| std::thread::spawn(move || suite(tag, false)))
        .into_iter()
        .collect();
    for p in passes {
        p.join().unwrap();
    }
    assert_clean();
}

/// A load of the runs' own user (`nobody` when the tests run as root): CPU burners, a loop of
/// short-lived processes, and forty sleeping processes holding process slots.
struct Load(Vec<Child>);

impl Load {
    fn start() -> Self {
        // Root's runs are `nobody`, so the load is too.
        let root = std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
        let spawn = |script: &str| {
            let mut c = Command::new("sh");
            c.args(["-c", script]).process_group(0);
            if root {
                c.uid(65534).gid(65534);
            }
            c.spawn().unwrap()
        };
        let mut children = Vec::new();
        for _ in 0..2 {
            children.push(spawn("while :; do :; done"));
        }
        children.push(spawn(
            "while :; do for i in 1 2 3 4 5 6 7 8; do /bin/true & done; wait; done",
        ));
        children.push(spawn("for i in $(seq 40); do sleep 60 & done; wait"));
        Load(children)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // Each load script leads its own process group: end the group, then reap.
            let _ = Command::new("sh")
                .args(["-c", &format!("kill -9 -{}", c.id())])
                .status();
            let _ = c.wait();
        }
    }
}

#[test]
fn the_hostile_suite_under_load_gives_the_same_verdicts() {
    let _lock = exclusive();
    let load = Load::start();
    // Let the load take its processes and CPU before the first run.
    std::thread::sleep(Duration::from_millis(300));
    suite("loaded", false);
    drop(load);
    assert_clean();
}
