//! Test support shared by the workspace's integration tests: the reference fixtures in
//! `../shared/fixtures/` (beside the repository) and small JSON helpers. Never a runtime dependency.

use serde_json::Value;
use std::path::PathBuf;

/// `../shared/fixtures/<rel>` beside the repository; fails with the path when it is absent.
pub fn fixture(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures")
        .join(rel);
    assert!(
        p.exists(),
        "fixture {} is absent: the tests need ../shared/fixtures beside the repository",
        p.display()
    );
    p
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("a list of numbers")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

pub fn jsonl(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("readable fixture")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

/// A fresh empty directory under the system temp dir, unique to this test.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxrl-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A bundled demo's `grpo.toml` (`examples/<demo>/`) written to `path` with its policy and data
/// paths made absolute and each `(from, to)` of `edits` replaced in its text (e.g.
/// `("batch_size = 32", "batch_size = 2")`); returns `path`.
pub fn demo_config(demo: &str, path: &std::path::Path, edits: &[(&str, &str)]) -> PathBuf {
    let example = repo().join("examples").join(demo);
    let absolute = |rel: &str| example.join(rel).display().to_string();
    let mut text = std::fs::read_to_string(example.join("grpo.toml"))
        .expect("the demo's grpo.toml")
        .replace(
            "path = \"policy\"",
            &format!("path = \"{}\"", absolute("policy")),
        )
        .replace(
            "\"data/prompts.jsonl\"",
            &format!("\"{}\"", absolute("data/prompts.jsonl")),
        );
    for (from, to) in edits {
        assert!(
            text.contains(from),
            "examples/{demo}/grpo.toml has no `{from}`"
        );
        text = text.replace(from, to);
    }
    std::fs::write(path, text).expect("writing the config");
    path.to_path_buf()
}

/// The pinned venv's python (`.venv/bin/python`), made by `.ci/python-env` when absent. A
/// machine that cannot make it fails the calling test: peer tests never skip.
pub fn peer_python() -> PathBuf {
    let made = std::process::Command::new("bash")
        .arg(repo().join(".ci/python-env"))
        .status()
        .expect("bash runs .ci/python-env");
    assert!(
        made.success(),
        ".ci/python-env could not install the pinned Python peers; it needs python3 and the \
         package registry"
    );
    repo().join(".venv/bin/python")
}

/// Reads one HTTP/1.1 request from `stream` (request line, headers, `Content-Length` body), for
/// the small test servers that stand in for remote peers; returns the path and the body.
pub fn read_http_request(stream: &std::net::TcpStream) -> Option<(String, Vec<u8>)> {
    use std::io::{BufRead, Read};
    let mut reader = std::io::BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_string();
    let mut length = 0;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).ok()?;
        if header.trim().is_empty() {
            break;
        }
        if let Some(v) = header.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((path, body))
}

/// Writes a whole HTTP/1.1 answer with a JSON body and closes the exchange.
pub fn write_http_json(mut stream: &std::net::TcpStream, status: &str, body: &str) {
    use std::io::Write;
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// An `oxrl serve` process on a free port, killed when dropped.
pub struct ServeProcess {
    child: std::process::Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
}

impl ServeProcess {
    /// Runs `binary serve --port 0 <args>` and waits for the line that names its address.
    pub fn start(binary: &std::path::Path, args: &[&str]) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(binary)
            .arg("serve")
            .args(["--port", "0"])
            .args(args)
            .env("HF_HUB_OFFLINE", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("oxrl serve starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut first = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut first)
            .expect("reading oxrl serve's first line");
        let url = first
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("oxrl serve did not say where it listens: {first:?}"))
            .to_string();
        Self { child, url }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("polling oxrl serve").is_none()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A vLLM server (the CPU build in the pinned venv) on a free port, its process group killed
/// when dropped.
pub struct VllmProcess {
    child: std::process::Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
}

impl VllmProcess {
    /// Starts `python -m vllm.entrypoints.openai.api_server` on `model` in dev mode with the
    /// token route and processed log-probs, float32 and eager (`extra` adds flags), logging to
    /// `log`; waits until `/health` answers. A server that exits or is not ready in 400 s fails
    /// the test with the log's tail.
    pub fn start(
        python: &std::path::Path,
        model: &std::path::Path,
        log: &std::path::Path,
        extra: &[&str],
    ) -> Self {
        use std::process::{Command, Stdio};
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log_file = std::fs::File::create(log).expect("creating the vLLM log");
        let child = Command::new("setsid")
            .arg(python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args([
                "--enforce-eager",
                "--dtype",
                "float32",
                "--max-num-seqs",
                "32",
            ])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--enable-scale-out",
                "--logprobs-mode",
                "processed_logprobs",
            ])
            .args(extra)
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("OMP_NUM_THREADS", "1")
            .env("HF_HUB_OFFLINE", "1")
            .stdout(log_file.try_clone().expect("the vLLM log"))
            .stderr(log_file)
            .stdin(Stdio::null())
            .spawn()
            .expect("setsid starts vLLM");
        let mut server = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let start = std::time::Instant::now();
        loop {
            let up = Command::new("curl")
                .args(["-sf", "-m", "2", &format!("{}/health", server.url)])
                .status()
                .is_ok_and(|s| s.success());
            if up {
                return server;
            }
            if let Some(status) = server.child.try_wait().expect("polling vLLM") {
                panic!(
                    "vLLM exited ({status:?}) before it was ready:\n{}",
                    tail(log)
                );
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(400),
                "vLLM was not ready after 400 s:\n{}",
                tail(log)
            );
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

impl Drop for VllmProcess {
    /// SIGTERM to the server's process group, then SIGKILL to what is left of it after 10 s:
    /// the engine-core and worker processes catch SIGTERM and, once the API server is gone,
    /// can linger as orphans holding ~3 GB and pinned OpenMP threads for the rest of the run.
    ///
    /// The group goes after `--`: procps-ng 4.0.2's `kill -TERM -125` reads `-125` as options
    /// and signals *every* process the caller may signal (seen: a server whose group id started
    /// with 1 ended the whole test run, CI included; `kill -TERM -- -125` signals the group).
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let signal = |sig: &str| {
            std::process::Command::new("kill")
                .args([sig, "--", &group])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        signal("-TERM");
        let _ = self.child.wait();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // Signal 0 reaches the group while any of its processes is alive.
        while signal("-0") && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        signal("-KILL");
    }
}

/// The last 40 lines of a log file, for a failure message.
pub fn tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Fails the test with the process's stdout and stderr unless it exited successfully.
pub fn assert_success(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A path as the `&str` a command line takes (test paths are UTF-8).
pub fn path_str(p: &std::path::Path) -> &str {
    p.to_str().expect("a UTF-8 test path")
}
