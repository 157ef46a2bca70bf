//! Crash and disk-full safety, proven on the bundled demo: a run killed with SIGKILL at many
//! points (during steps and during checkpoint writes) and resumed each time ends with weights,
//! optimizer state and metrics byte-equal to an uninterrupted run's; a checkpoint write that
//! runs out of space is a clear error that leaves the previous checkpoint intact and no half
//! checkpoint for `--resume` to pick.

use oxrl_fixtures::temp_dir;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const STEPS: u64 = 6;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The bundled demo, 2 prompts a step, a checkpoint after every step.
fn demo_config(dir: &Path) -> PathBuf {
    let steps = format!("max_steps = {STEPS}");
    oxrl_fixtures::demo_config(
        "arithmetic",
        &dir.join("grpo.toml"),
        &[
            ("batch_size = 32", "batch_size = 2"),
            ("max_steps = 200", &steps),
            ("save_every = 20", "save_every = 1"),
            ("eval_every = 20", "eval_every = 2"),
        ],
    )
}

fn train(config: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oxrl"));
    c.args(["train", "--config", s(config), "--output-dir", s(out)])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The files that make a checkpoint complete.
const CHECKPOINT_FILES: [&str; 4] = [
    "model.safetensors",
    "optimizer.safetensors",
    "trainer_state.json",
    "config.json",
];

fn checkpoints(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("checkpoint-"))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// Every directory named `checkpoint-N` holds a whole checkpoint of step N.
fn assert_checkpoints_complete(dir: &Path, after: &str) {
    for c in checkpoints(dir) {
        for f in CHECKPOINT_FILES {
            assert!(c.join(f).exists(), "{after}: {} lacks {f}", c.display());
        }
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(c.join("trainer_state.json")).unwrap()).unwrap();
        let name = c.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(format!("checkpoint-{}", state["step"]), name, "{after}");
    }
}

/// True for the metrics measured by the wall clock (phase times, latencies, throughputs),
/// which no two runs share.
fn is_wall_clock(key: &str) -> bool {
    key.starts_with("time/") || key.contains("latency_s") || key.contains("tokens_per_s")
}

/// `metrics.jsonl` without the wall-clock measurements.
fn metrics_without_times(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(l).unwrap();
            v.retain(|k, _| !is_wall_clock(k));
            serde_json::Value::Object(v).to_string()
        })
        .collect()
}

fn assert_same_run(a: &Path, b: &Path, last: u64) {
    let (ca, cb) = (
        a.join(format!("checkpoint-{last}")),
        b.join(format!("checkpoint-{last}")),
    );
    for f in CHECKPOINT_FILES {
        assert!(
            std::fs::read(ca.join(f)).unwrap() == std::fs::read(cb.join(f)).unwrap(),
            "{f} differs between {} and {}",
            ca.display(),
            cb.display()
        );
    }
    assert_eq!(metrics_without_times(a), metrics_without_times(b));
}

/// Names in `dir` that a finished write never leaves behind.
fn partials(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp") || n.contains(".old-"))
        .collect()
}

/// When to kill the run.
#[derive(Debug, Clone, Copy)]
enum KillAt {
    /// While the `n`-th checkpoint this process writes is half-written.
    CheckpointWrite(usize),
    /// As soon as a new metrics line appears (between a step's log and its checkpoint).
    AfterStepLog,
    /// After this long, wherever the run is.
    Elapsed(Duration),
}

fn temp_checkpoints(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".checkpoint-") && n.contains(".tmp-"))
                .collect()
        })
        .unwrap_or_default()
}

fn metrics_lines(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count())
}

/// Runs until `at`, then SIGKILLs; returns true if the run finished by itself first.
fn run_and_kill(mut child: Child, out: &Path, at: KillAt) -> bool {
    let start = Instant::now();
    let lines_at_start = metrics_lines(out);
    let mut seen_temp: Vec<String> = Vec::new();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let err = child
                .stderr
                .take()
                .map(|mut e| {
                    let mut s = String::new();
                    std::io::Read::read_to_string(&mut e, &mut s).unwrap();
                    s
                })
                .unwrap_or_default();
            assert!(status.success(), "{at:?}: the run failed: {err}");
            return true;
        }
        let due = match at {
            KillAt::CheckpointWrite(n) => {
                for t in temp_checkpoints(out) {
                    if !seen_temp.contains(&t) {
                        seen_temp.push(t);
                    }
                }
                seen_temp.len() >= n && !temp_checkpoints(out).is_empty()
            }
            KillAt::AfterStepLog => metrics_lines(out) > lines_at_start.max(1),
            KillAt::Elapsed(d) => start.elapsed() >= d,
        };
        if due {
            child.kill().unwrap();
            child.wait().unwrap();
            return false;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{at:?}: hung");
        std::thread::sleep(Duration::from_micros(500));
    }
}

#[test]
fn sigkill_anywhere_then_resume_equals_an_uninterrupted_run() {
    let dir = temp_dir("crash");
    let config = demo_config(&dir);
    let whole = dir.join("whole");
    ok(&train(&config, &whole, &[]).output().unwrap());

    let crashed = dir.join("crashed");
    let plan = [
        KillAt::CheckpointWrite(1),
        KillAt::AfterStepLog,
        KillAt::CheckpointWrite(2),
        KillAt::Elapsed(Duration::from_millis(150)),
        KillAt::CheckpointWrite(2),
        KillAt::AfterStepLog,
        KillAt::Elapsed(Duration::from_millis(400)),
        KillAt::CheckpointWrite(2),
    ];
    let mut kills = 0;
    let mut log = Vec::new();
    let mut finished = false;
    for (i, &at) in plan.iter().cycle().take(40).enumerate() {
        let child = train(&config, &crashed, &["--resume"]).spawn().unwrap();
        if run_and_kill(child, &crashed, at) {
            finished = true;
            break;
        }
        kills += 1;
        let newest = checkpoints(&crashed).last().cloned();
        log.push(format!("{at:?} -> newest {newest:?}"));
        assert_checkpoints_complete(&crashed, &format!("kill {i} ({at:?})"));
    }
    eprintln!("kills:\n{}", log.join("\n"));
    assert!(finished, "the run never finished after {kills} kills");
    assert!(
        kills >= 5,
        "only {kills} kills landed: the schedule missed the run"
    );
    assert_same_run(&whole, &crashed, STEPS);
    assert!(partials(&crashed).is_empty(), "{:?}", partials(&crashed));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `ulimit -f` makes the optimizer state (the checkpoint's largest file, ~1.4 MB) fail to write
/// with EFBIG, as a full disk fails with ENOSPC, half-way through checkpoint 3.
#[test]
fn a_checkpoint_write_that_runs_out_of_space_keeps_the_previous_one() {
    let dir = temp_dir("disk-full");
    let config = demo_config(&dir);
    let whole = dir.join("whole");
    ok(&train(&config, &whole, &["--max-steps", "4"])
        .output()
        .unwrap());
    let run = dir.join("run");
    ok(&train(&config, &run, &["--max-steps", "2"])
        .output()
        .unwrap());
    let before: Vec<Vec<u8>> = CHECKPOINT_FILES
        .iter()
        .map(|f| std::fs::read(run.join("checkpoint-2").join(f)).unwrap())
        .collect();
    let limited = format!(
        "trap '' XFSZ; ulimit -f 1000; exec \"{}\" train --config \"{}\" --output-dir \"{}\" \
         --resume --max-steps 4",
        env!("CARGO_BIN_EXE_oxrl"),
        s(&config),
        s(&run)
    );
    let out = Command::new("bash")
        .args(["-c", &limited])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ")
            && last.contains("optimizer.safetensors")
            && last.contains("File too large"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!run.join("checkpoint-3").exists());
    assert!(partials(&run).is_empty(), "{:?}", partials(&run));
    for (f, bytes) in CHECKPOINT_FILES.iter().zip(&before) {
        assert!(
            &std::fs::read(run.join("checkpoint-2").join(f)).unwrap() == bytes,
            "checkpoint-2/{f} changed"
        );
    }
    ok(&train(&config, &run, &["--resume", "--max-steps", "4"])
        .output()
        .unwrap());
    assert_same_run(&whole, &run, 4);
    std::fs::remove_dir_all(&dir).unwrap();
}
