//! The hostile suite: ten snippets that attack the machine through the code reward. Each must be
//! contained, scored 0 with a reason, and leave the machine as it was: no process of a run
//! alive afterwards, no file written outside the run directory, no run directory left behind,
//! the test process and a bystander process alive, nothing received by a local server, no
//! secret of the parent's environment in the output. (One `#[test]`, so setting the secret in
//! this process's environment races with no other test.)

use oxrl_reward::code::{CodeReward, CodeSpec, Scoring};
use oxrl_reward::sandbox::{Limits, Mode};
use oxrl_reward::RewardInput;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SECRET_VAR: &str = "OXRL_HOSTILE_SECRET";

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

/// Processes in another PID namespace than ours: only a sandboxed run makes those here.
fn foreign_processes() -> Vec<String> {
    let ours = std::fs::read_link("/proc/self/ns/pid").unwrap();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(ns) = std::fs::read_link(e.path().join("ns/pid")) {
            if ns != ours {
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                found.push(format!("{name}: {}", String::from_utf8_lossy(&cmd)));
            }
        }
    }
    found
}

/// Waits up to a second for a killed run's namespace to finish tearing down.
fn assert_no_survivors(case: &str) {
    let start = Instant::now();
    loop {
        let left = foreign_processes();
        if left.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(1),
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

#[test]
fn hostile_snippets_are_contained_and_scored_as_failures() {
    let secret = format!("s3cr3t-{}", std::process::id());
    std::env::set_var(SECRET_VAR, &secret);
    let mut spec = CodeSpec::for_language("python");
    spec.scoring = Scoring::All;
    spec.limits = Limits {
        timeout: Duration::from_secs(2),
        cpu_s: 1,
        memory_mb: 256,
        ..Limits::default()
    };
    let reward = CodeReward::new(spec).unwrap();
    let mode = reward.sandbox().mode();
    assert_eq!(
        mode,
        Mode::Full,
        "this suite checks the full isolation (CI runs on a kernel that allows it)"
    );

    // Bystanders: a process of ours the snippets try to kill, a server they try to reach.
    let mut bystander = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    server.set_nonblocking(true).unwrap();
    let port = server.local_addr().unwrap().port();
    let outside: Vec<PathBuf> = [
        std::env::temp_dir(),
        PathBuf::from("/dev/shm"),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())),
    ]
    .iter()
    .map(|d| d.join(format!("oxrl-hostile-{}", std::process::id())))
    .collect();
    let targets = outside
        .iter()
        .map(|p| format!("{:?}", p.display().to_string()))
        .collect::<Vec<_>>()
        .join(", ");

    let add = json!(["assert add(2, 3) == 5"]);
    let cases: Vec<(&str, String, Value, &[&str])> = vec![
        (
            "infinite loop",
            "while True:\n    pass".into(),
            add.clone(),
            &["CPU time limit"],
        ),
        (
            "fork bomb",
            "import os\nwhile True:\n    os.fork()".into(),
            add.clone(),
            // Which error the bomb dies of depends on the machine's load (EAGAIN, the CPU
            // limit, or a traceback cut short): the containment checks below are the verdict.
            &["BlockingIOError", "CPU time limit", "exit status"],
        ),
        (
            "memory bomb",
            "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))".into(),
            add.clone(),
            &["MemoryError"],
        ),
        (
            "huge output",
            "while True:\n    print('x' * 4096)".into(),
            add.clone(),
            &["output over"],
        ),
        (
            "writing outside the directory",
            format!(
                "errors = []\nfor p in [{targets}]:\n    try:\n        with open(p, 'w') as f:\n            f.write('escaped')\n    except OSError as e:\n        errors.append(e)\nif errors:\n    raise errors[0]"
            ),
            add.clone(),
            &["Read-only file system"],
        ),
        (
            "opening a socket",
            format!("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"),
            add.clone(),
            &["Network is unreachable"],
        ),
        (
            "sleeping past the timeout",
            "import time\ntime.sleep(60)".into(),
            add.clone(),
            &["timed out"],
        ),
        (
            "killing the parent",
            format!(
                "import os, signal\nkilled = []\ntargets = [os.getppid(), -1, {}] + [int(p) for p in os.listdir('/proc') if p.isdigit()]\nfor pid in targets:\n    if pid in (0, os.getpid()):\n        continue\n    try:\n        os.kill(pid, signal.SIGKILL)\n        killed.append(pid)\n    except OSError:\n        pass\nprint('killed', killed if killed else 'nothing')",
                bystander.id()
            ),
            json!([{"input": "", "output": "killed a process outside"}]),
            &["wrong output", "killed nothing"],
        ),
        (
            "reading environment secrets",
            format!(
                "import os\nfound = os.environ.get('{SECRET_VAR}', '')\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n    try:\n        env = open(f'/proc/{{pid}}/environ', 'rb').read()\n    except OSError:\n        continue\n    for kv in env.split(b'\\0'):\n        if kv.startswith(b'{SECRET_VAR}='):\n            found = kv.split(b'=', 1)[1].decode()\nprint(found)"
            ),
            json!([{"input": "", "output": secret}]),
            &["wrong output"],
        ),
        (
            "a daemon outliving its parent",
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)".into(),
            add.clone(),
            &["NameError"],
        ),
    ];
    assert_eq!(cases.len(), 10, "README and ARCHITECTURE list ten snippets");

    let suite = Instant::now();
    for (name, code, tests, reasons) in &cases {
        let start = Instant::now();
        let v = reward.evaluate(&input(code, tests.clone())).unwrap();
        let took = start.elapsed();
        let reason = v.tests[0].reason.clone().unwrap_or_default();
        eprintln!("{name:<32} {took:>10.2?}  {reason}");
        assert_eq!(v.score, 0.0, "{name}: {v:?}");
        assert!(
            reasons.iter().any(|r| reason.contains(r)),
            "{name}: reason `{reason}` is none of {reasons:?}"
        );
        assert!(
            took < Duration::from_secs(4),
            "{name} took {took:?} with a 2 s timeout"
        );
        // The reason shows what the program printed after "got" (before it, what was expected).
        let printed = reason.rsplit(", got ").next().unwrap_or_default();
        assert!(!printed.contains(&secret), "{name} leaked the secret");
        assert_no_survivors(name);
        for p in &outside {
            assert!(!p.exists(), "{name} wrote {}", p.display());
        }
        assert!(
            bystander.try_wait().unwrap().is_none(),
            "{name} killed a bystander process"
        );
        assert!(
            server.accept().is_err(),
            "{name} reached a server on localhost"
        );
    }
    eprintln!("hostile suite: {:.2?}", suite.elapsed());
    assert!(run_dirs().is_empty(), "left behind: {:?}", run_dirs());

    // The same sandbox still passes a correct solution.
    let ok = reward
        .evaluate(&input("def add(a, b):\n    return a + b", add))
        .unwrap();
    assert_eq!(ok.score, 1.0, "{ok:?}");
    let _ = bystander.kill();
    let _ = bystander.wait();
    assert!(Path::new("/proc/self").exists());
}
