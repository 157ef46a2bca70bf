//! The Python package (`python/oxrl`) with the pinned venv's Python: `Trainer(config).train()`
//! against the command line, its errors, and `oxrl.ray` on a local Ray cluster — two ranks
//! placed by a placement group, and a restart from the last checkpoint after a rank is killed.

use oxrl_fixtures::{assert_success as ok, path_str as s, repo, temp_dir};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

/// Runs `script` with the venv's Python, the package importable and the test's binary found.
fn python(script: &str, args: &[&str]) -> Output {
    Command::new(oxrl_fixtures::peer_python())
        .arg("-c")
        .arg(script)
        .args(args)
        .env("PYTHONPATH", repo().join("python"))
        .env("OXRL_BINARY", env!("CARGO_BIN_EXE_oxrl"))
        .env("RAY_AUTH_MODE", "disabled")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .current_dir(repo())
        .output()
        .expect("python runs")
}

fn metrics(dir: &Path) -> Vec<Value> {
    oxrl_fixtures::jsonl(&dir.join("metrics.jsonl"))
}

/// The same steps logged the same numbers (wall times, throughputs and reward latencies
/// aside; `rollout_logprob_diff` to 1e-6, as the engine's log-probs vary in the last bits with
/// the batch's composition, and `grad_norm` to 1e-12).
fn same_metrics(a: &[Value], b: &[Value]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        for (key, v) in x.as_object().unwrap() {
            if key.starts_with("time/") || key.contains("per_s") || key.contains("latency") {
                continue;
            }
            let (p, q) = (v.as_f64().unwrap(), y[key].as_f64().unwrap());
            // ZeRO-2 sums each parameter's squared gradient norm from the ranks' parts: the f64
            // grad_norm may differ in its last bits (docs/distributed.md).
            let tol = match key.as_str() {
                "rollout_logprob_diff" => 1e-6,
                "grad_norm" => 1e-12 * p.abs(),
                _ => 0.0,
            };
            assert!((p - q).abs() <= tol, "step {}: {key} {p} vs {q}", x["step"]);
        }
    }
}

/// The arithmetic demo, 4 steps, 2 ranks' worth of micro-batches (bit-exact on 1 or 2 ranks).
fn demo_toml(dir: &Path) -> std::path::PathBuf {
    oxrl_fixtures::demo_config(
        "arithmetic",
        &dir.join("grpo.toml"),
        &[
            ("max_steps = 200", "max_steps = 4"),
            ("micro_batch_size = 256", "micro_batch_size = 128"),
            ("save_every = 20", "save_every = 1"),
            ("eval_every = 20", "eval_every = 2"),
        ],
    )
}

const DICT_RUN: &str = r#"
import json, sys, oxrl
example = "examples/arithmetic"
trainer = oxrl.Trainer({
    "policy_model": example + "/policy",
    "batch_size": 32,
    "data": {"train_files": example + "/data/prompts.jsonl",
             "val_files": example + "/data/prompts.jsonl",
             "prompt_key": "prompt", "answer_key": "answer"},
    "rollout": {"n_samples_per_prompt": 8, "max_new_tokens": 4, "temperature": 1.0},
    "reward": {"functions": [{"type": "math_answer", "name": "correct"}]},
    "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "clip_low": 0.2,
                  "clip_high": 0.28, "kl_coef": 0.0},
    "trainer": {"micro_batch_size": 128, "max_steps": 4, "lr": 1e-3, "weight_decay": 0.0,
                "seed": 1, "save_every": 1, "eval_every": 2},
}, output_dir=sys.argv[1])
final = trainer.train()
print(json.dumps({"step": final["step"], "reward_mean": final["reward_mean"]}))
"#;

#[test]
fn trainer_from_a_dict_reproduces_the_command_line_run() {
    let dir = temp_dir("py-trainer");
    let config = demo_toml(&dir);
    let cli = dir.join("cli");
    let out = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["train", "--config", s(&config), "--output-dir", s(&cli)])
        .env_remove("RANK")
        .output()
        .unwrap();
    ok(&out);
    let py = dir.join("py");
    let out = python(DICT_RUN, &[s(&py)]);
    ok(&out);
    same_metrics(&metrics(&cli), &metrics(&py));
    let last: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(last["step"], 4);
    assert_eq!(last["reward_mean"], metrics(&cli)[4]["reward_mean"]);
    // The binary's progress reached the caller's stderr.
    assert!(String::from_utf8_lossy(&out.stderr).contains("step 4/4"));
    std::fs::remove_dir_all(&dir).unwrap();
}

const ERRORS: &str = r#"
import sys, oxrl
try:
    oxrl.Trainer({"policy_model": "examples/arithmetic/policy",
                  "algorithm": {"advantage": "no_such_estimator"}},
                 output_dir=sys.argv[1], quiet=True).train()
    print("no error")
except oxrl.OxrlError as e:
    print("OxrlError", e.returncode, e)
try:
    oxrl.Trainer("no/such.toml").train()
except oxrl.OxrlError as e:
    print("OxrlError", e.returncode, e)
"#;

#[test]
fn a_failed_run_raises_the_binarys_message() {
    let dir = temp_dir("py-errors");
    let out = python(ERRORS, &[s(&dir.join("out"))]);
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("OxrlError 1 ") && lines[0].contains("no_such_estimator"),
        "{stdout}"
    );
    assert!(lines[1].contains("no/such.toml"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

const RAY_RUN: &str = r#"
import json, os, signal, sys, threading, time
import ray, oxrl
import tomllib
config, out, kill = sys.argv[1], sys.argv[2], sys.argv[3] == "kill"
ray.init(num_cpus=2, include_dashboard=False)
# The run as a dict (the demo's TOML read back; its paths are absolute).
with open(config, "rb") as f:
    as_dict = tomllib.load(f)
trainer = oxrl.Trainer(as_dict, output_dir=out, num_workers=2, use_gpu=False, max_restarts=1)

def kill_rank_1():
    # Once step 1's checkpoint exists, kill the process whose environment says RANK=1.
    while not os.path.exists(os.path.join(out, "checkpoint-1")):
        time.sleep(0.05)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"RANK=1" in env and out.encode() in cmd:
            os.kill(int(pid), signal.SIGKILL)
            print("killed rank 1", flush=True)
            return

if kill:
    threading.Thread(target=kill_rank_1, daemon=True).start()
final = trainer.train()
print(json.dumps({"step": final["step"]}))
"#;

#[test]
fn ray_runs_two_ranks_and_restarts_the_group_after_a_rank_dies() {
    let dir = temp_dir("py-ray");
    let config = demo_toml(&dir);
    let cli = dir.join("cli");
    ok(&Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["train", "--config", s(&config), "--output-dir", s(&cli)])
        .env_remove("RANK")
        .output()
        .unwrap());

    // Two ranks placed by Ray give the single process's metrics.
    let two = dir.join("ray");
    let out = python(RAY_RUN, &[s(&config), s(&two), "no"]);
    ok(&out);
    same_metrics(&metrics(&cli), &metrics(&two));

    // Rank 1 killed after step 1: the group restarts with --resume from the newest checkpoint
    // and finishes; resuming is exact, so every step's numbers are the CLI's.
    let killed = dir.join("killed");
    let out = python(RAY_RUN, &[s(&config), s(&killed), "kill"]);
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("killed rank 1"), "{stdout}");
    assert!(
        stderr.contains("restarting the group from its last checkpoint"),
        "{stderr}"
    );
    // Ray may forward the actors' last lines after the driver's own.
    assert!(stdout.lines().any(|l| l == "{\"step\": 4}"), "{stdout}");
    same_metrics(&metrics(&cli), &metrics(&killed));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `pip install ./python` (the in-tree backend: no network, no setuptools) installs a package
/// that runs the binary `OXRL_BINARY` names; a wheel built with `OXRL_WHEEL_BINARY` carries the
/// binary and finds it with nothing else set.
#[test]
fn pip_installs_the_package_and_a_wheel_carries_the_binary() {
    let dir = temp_dir("py-install");
    let python = oxrl_fixtures::peer_python();
    let pip = |args: &[&str], binary: Option<&str>| {
        let mut c = Command::new(&python);
        c.args(["-m", "pip"]).args(args);
        c.args(["--quiet", "--no-deps", "--no-build-isolation"]);
        if let Some(b) = binary {
            c.env("OXRL_WHEEL_BINARY", b);
        }
        ok(&c.output().unwrap());
    };
    let import = |site: &Path, with_binary_env: bool| {
        let mut c = Command::new(&python);
        c.args([
            "-c",
            "import oxrl; print(oxrl.__file__); print(oxrl.__version__); \
             print(oxrl.find_binary())",
        ]);
        c.env("PYTHONPATH", site)
            .env_remove("OXRL_BINARY")
            .env("PATH", "/usr/bin:/bin");
        if with_binary_env {
            c.env("OXRL_BINARY", env!("CARGO_BIN_EXE_oxrl"));
        }
        let out = c.current_dir(&dir).output().unwrap();
        ok(&out);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let package = repo().join("python");

    let site = dir.join("site");
    pip(&["install", "--target", s(&site), s(&package)], None);
    let lines = import(&site, true);
    assert!(lines[0].starts_with(s(&site)), "{lines:?}");
    assert_eq!(lines[1], "0.1.0");
    assert_eq!(lines[2], env!("CARGO_BIN_EXE_oxrl"));

    let wheels = dir.join("wheels");
    pip(
        &["wheel", "-w", s(&wheels), s(&package)],
        Some(env!("CARGO_BIN_EXE_oxrl")),
    );
    let wheel = std::fs::read_dir(&wheels)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert!(
        !s(&wheel).ends_with("-any.whl"),
        "a wheel with a binary is platform-tagged: {wheel:?}"
    );
    let bundled = dir.join("bundled");
    pip(&["install", "--target", s(&bundled), s(&wheel)], None);
    let lines = import(&bundled, false);
    let carried = bundled.join("oxrl/bin/oxrl");
    assert_eq!(lines[2], s(&carried));
    let version = Command::new(&carried).arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("oxrl "));
    std::fs::remove_dir_all(&dir).unwrap();
}
