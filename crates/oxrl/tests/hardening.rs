//! What a user can do to the binary that is not its happy path: close its stdout, fill its
//! output device, point `--output` at links, devices and pipes, stop a run with a signal, or
//! start a second run in a used output directory. None of it may panic, lose a checkpoint, or
//! replace something that is not a regular file.

use oxrl_fixtures::{fixture, temp_dir};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn oxrl() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oxrl"));
    c.current_dir(repo()).env("HF_HUB_OFFLINE", "1");
    c
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A pipe whose reading end is already closed: every write to it fails with EPIPE.
fn closed_pipe() -> std::io::PipeWriter {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer
}

/// The bundled demo's config with absolute paths, `batch` prompts a step, `steps` steps.
fn demo_config(dir: &Path, batch: usize, steps: usize, save_every: usize) -> PathBuf {
    let batch = format!("batch_size = {batch}");
    let steps = format!("max_steps = {steps}");
    let save_every = format!("save_every = {save_every}");
    oxrl_fixtures::demo_config(
        "arithmetic",
        &dir.join("grpo.toml"),
        &[
            ("batch_size = 32", &batch),
            ("max_steps = 200", &steps),
            ("save_every = 20", &save_every),
        ],
    )
}

fn assert_no_panic(what: &str, status: ExitStatus, err: &str) {
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert_ne!(status.code(), Some(101), "{what} panicked: {err}");
}

/// `cmd | head` for every command that prints: a closed stdout ends the command with 141 (as
/// SIGPIPE would) and nothing on stderr; a training run whose output nobody reads finishes its
/// work first.
#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    let dir = temp_dir("epipe");
    let tiny = fixture("qwen3-tiny");
    let cases = fixture("qwen3-tiny/cases.jsonl");
    let config = demo_config(&dir, 2, 2, 100);
    let commands: Vec<Vec<String>> = vec![
        vec!["config".into(), "--explain".into()],
        vec!["config".into(), "--check".into(), s(&config).into()],
        vec![
            "score".into(),
            "--model".into(),
            s(&tiny).into(),
            "--input".into(),
            s(&cases).into(),
        ],
        vec![
            "generate".into(),
            "--model".into(),
            s(&repo().join("examples/arithmetic/policy")).into(),
            "--prompt".into(),
            "1+2=".into(),
            "--max-new-tokens".into(),
            "3".into(),
        ],
    ];
    for args in &commands {
        let out = oxrl().args(args).stdout(closed_pipe()).output().unwrap();
        let err = stderr(&out);
        assert_no_panic(&args.join(" "), out.status, &err);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
        assert!(err.is_empty(), "{args:?}: {err}");
    }
    // `oxrl train 2>&1 | head`: progress and the summary go nowhere, the run still completes.
    let run = dir.join("run");
    let status = oxrl()
        .args(["train", "--config", s(&config), "--output-dir", s(&run)])
        .stdout(closed_pipe())
        .stderr(closed_pipe())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(141), "train: {status:?}");
    assert!(run.join("checkpoint-2/trainer_state.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Output to a full device is an `error:` line naming what failed, and `/dev/full` stays a
/// device (as root, the old code replaced it with a regular file).
#[test]
fn a_full_device_is_an_error_and_stays_a_device() {
    let full = Path::new("/dev/full");
    let out = oxrl()
        .args(["config", "--explain"])
        .stdout(std::fs::OpenOptions::new().write(true).open(full).unwrap())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_no_panic("config > /dev/full", out.status, &err);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: writing to stdout") && err.contains("No space left"),
        "{err}"
    );
    let out = oxrl()
        .args([
            "score",
            "--model",
            s(&fixture("qwen3-tiny")),
            "--input",
            s(&fixture("qwen3-tiny/cases.jsonl")),
            "--output",
            "/dev/full",
        ])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_no_panic("score --output /dev/full", out.status, &err);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("/dev/full") && err.contains("No space left"),
        "{err}"
    );
    let kind = std::fs::metadata(full).unwrap().file_type();
    assert!(kind.is_char_device(), "/dev/full is no longer a device");
}

/// `--output` through a symlink writes the file it names and keeps the link; into a FIFO or
/// `/dev/stdout` it streams; at a directory it is an error.
#[test]
fn output_paths_are_written_where_they_lead_never_replaced() {
    let dir = temp_dir("output-kinds");
    let score = |output: &Path| {
        oxrl()
            .args([
                "score",
                "--model",
                s(&fixture("qwen3-tiny")),
                "--input",
                s(&fixture("qwen3-tiny/cases.jsonl")),
                "--output",
                s(output),
            ])
            .output()
            .unwrap()
    };
    let reference = dir.join("plain.jsonl");
    let r = score(&reference);
    assert!(r.status.success(), "{}", stderr(&r));
    let expected = std::fs::read(&reference).unwrap();
    assert!(!expected.is_empty());

    let target = dir.join("target.jsonl");
    std::fs::write(&target, "old").unwrap();
    let link = dir.join("link.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let r = score(&link);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), expected);

    let fifo = dir.join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let r = score(&fifo);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(reader.join().unwrap(), expected);
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());

    let r = score(Path::new("/dev/stdout"));
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(r.stdout, expected);

    let r = score(&dir);
    let err = stderr(&r);
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("directory"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Waits until `path` has at least `n` lines (a run's progress), or panics after a minute.
fn wait_for_lines(child: &mut Child, path: &Path, n: usize) {
    let start = Instant::now();
    loop {
        let lines = std::fs::read_to_string(path).map_or(0, |t| t.lines().count());
        if lines >= n {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the run ended ({status:?}) before {} had {n} lines",
                path.display()
            );
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn send(child: &Child, signal: &str) {
    let sent = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// SIGINT and SIGTERM stop a run after the step it is in, with a complete checkpoint of that
/// step and the exit status 128 + signal; `--resume` continues from it.
#[test]
fn a_signal_stops_training_at_a_step_with_a_checkpoint() {
    let dir = temp_dir("signals");
    let config = demo_config(&dir, 2, 1000, 1000);
    for (signal, code) in [("-INT", 130), ("-TERM", 143)] {
        let run = dir.join(format!("run{signal}"));
        let mut child = oxrl()
            .args(["train", "--config", s(&config), "--output-dir", s(&run)])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The step-0 validation line, then two training steps.
        wait_for_lines(&mut child, &run.join("metrics.jsonl"), 3);
        send(&child, signal);
        let out = child.wait_with_output().unwrap();
        let (said, err) = (String::from_utf8_lossy(&out.stdout), stderr(&out));
        assert_no_panic(signal, out.status, &err);
        assert_eq!(out.status.code(), Some(code), "{said}{err}");
        assert!(said.contains("--resume"), "{said}");
        let steps = std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count() as u64
            - 1;
        let checkpoint = run.join(format!("checkpoint-{steps}"));
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(checkpoint.join("trainer_state.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(state["step"], steps);
        assert!(checkpoint.join("optimizer.safetensors").exists());
        let more = (steps + 1).to_string();
        let resumed = oxrl()
            .args(["train", "--config", s(&config), "--output-dir", s(&run)])
            .args(["--resume", "--max-steps", &more])
            .output()
            .unwrap();
        assert!(resumed.status.success(), "{}", stderr(&resumed));
        assert!(run.join(format!("checkpoint-{more}")).exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fresh run into a directory that holds another run is refused (naming `--resume`); a
/// second run while the first is writing is refused too.
#[test]
fn a_used_output_directory_is_not_mixed_into() {
    let dir = temp_dir("used-dir");
    let config = demo_config(&dir, 2, 1, 1);
    let run = dir.join("run");
    let train = |extra: &[&str]| {
        oxrl()
            .args(["train", "--config", s(&config), "--output-dir", s(&run)])
            .args(extra)
            .output()
            .unwrap()
    };
    let first = train(&[]);
    assert!(first.status.success(), "{}", stderr(&first));
    let again = train(&[]);
    let err = stderr(&again);
    assert_eq!(again.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("checkpoint-1") && err.contains("--resume"),
        "{err}"
    );
    // While one run holds the directory, another (even with --resume) is turned away.
    let config = demo_config(&dir, 2, 1000, 1000);
    let long = dir.join("long");
    let mut child = oxrl()
        .args(["train", "--config", s(&config), "--output-dir", s(&long)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_lines(&mut child, &long.join("metrics.jsonl"), 1);
    let second = oxrl()
        .args(["train", "--config", s(&config), "--output-dir", s(&long)])
        .arg("--resume")
        .output()
        .unwrap();
    let err = stderr(&second);
    assert_eq!(second.status.code(), Some(1), "{err}");
    assert!(err.contains("another oxrl run"), "{err}");
    child.kill().unwrap();
    assert_eq!(child.wait().unwrap().signal(), Some(9));
    std::fs::remove_dir_all(&dir).unwrap();
}
