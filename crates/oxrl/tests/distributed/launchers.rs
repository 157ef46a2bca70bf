//! `oxrl dist-check` as separate processes under each launcher's environment: torchrun from
//! the pinned venv (its agent serves the store), and the variables srun, a Kubernetes Job or
//! Ray set (rank 0 serves the store). A rank that dies makes the others fail, not hang.

use serde_json::Value;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn oxrl() -> &'static str {
    env!("CARGO_BIN_EXE_oxrl")
}

fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port()
}

/// Rank 0's JSON report out of a launcher's combined stdout.
fn report(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no report in:\n{stdout}\n{stderr}"));
    serde_json::from_str(line).unwrap()
}

fn check_ranks(report: &Value, world: usize) {
    assert_eq!(report["world_size"], world);
    assert_eq!(report["transport"], "tcp-ring");
    assert_eq!(report["all_reduce"]["ok"], true);
    assert_eq!(
        report["all_reduce"]["expected"],
        (world * (world + 1) / 2) as f64
    );
    let ranks = report["ranks"].as_array().unwrap();
    let numbers: Vec<u64> = ranks.iter().map(|r| r["rank"].as_u64().unwrap()).collect();
    assert_eq!(numbers, (0..world as u64).collect::<Vec<_>>());
    let pids: std::collections::BTreeSet<u64> =
        ranks.iter().map(|r| r["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids.len(), world, "one process per rank: {report}");
    assert!(report["all_reduce"]["busbw_gb_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn torchrun_two_and_four_ranks_meet_through_its_agent_store() {
    let python = oxrl_fixtures::peer_python();
    let torchrun = python.with_file_name("torchrun");
    for world in [2, 4] {
        let out = Command::new(&torchrun)
            .args([
                "--nproc_per_node",
                &world.to_string(),
                "--no-python",
                oxrl(),
            ])
            .args([
                "dist-check",
                "--json",
                "--megabytes",
                "2",
                "--timeout",
                "60",
            ])
            .output()
            .expect("torchrun runs");
        let report = report(&out);
        check_ranks(&report, world);
        assert_eq!(report["launcher"], "torchrun");
        let store = report["store"].as_str().unwrap();
        assert!(store.contains("torchrun's agent"), "{store}");
        let locals: Vec<String> = report["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| format!("{}/{}", r["local_rank"], r["local_world_size"]))
            .collect();
        let expected: Vec<String> = (0..world).map(|r| format!("{r}/{world}")).collect();
        assert_eq!(locals, expected);
    }
}

/// Starts `world` dist-checks with the variables `vars(rank)` returns.
fn spawn_ranks(
    world: usize,
    args: &[&str],
    vars: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Child> {
    (0..world)
        .map(|rank| {
            Command::new(oxrl())
                .arg("dist-check")
                .args(args)
                // Nothing inherited from a launcher this test itself runs under.
                .env_remove("RANK")
                .env_remove("WORLD_SIZE")
                .envs(vars(rank))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("oxrl runs")
        })
        .collect()
}

fn pairs(list: &[(&str, String)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

#[test]
fn rank_and_world_variables_without_torchrun_serve_a_store_on_rank_0() {
    // What Ray's launcher and a Kubernetes Job set.
    let port = free_port();
    let ranks = spawn_ranks(
        3,
        &["--json", "--megabytes", "1", "--timeout", "60"],
        |rank| {
            pairs(&[
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", "3".into()),
                ("LOCAL_RANK", rank.to_string()),
                ("LOCAL_WORLD_SIZE", "3".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.to_string()),
            ])
        },
    );
    let outs: Vec<Output> = ranks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let report = report(&outs[0]);
    check_ranks(&report, 3);
    assert_eq!(report["launcher"], "RANK/WORLD_SIZE");
    assert!(
        report["store"]
            .as_str()
            .unwrap()
            .contains("served by rank 0"),
        "{report}"
    );
    for out in &outs[1..] {
        assert!(out.status.success());
        assert!(out.stdout.is_empty(), "only rank 0 reports");
    }
}

#[test]
fn slurm_variables_find_rank_0_on_the_first_node() {
    let port = free_port();
    let ranks = spawn_ranks(
        2,
        &["--json", "--megabytes", "1", "--timeout", "60"],
        |rank| {
            pairs(&[
                ("SLURM_PROCID", rank.to_string()),
                ("SLURM_NTASKS", "2".into()),
                ("SLURM_LOCALID", rank.to_string()),
                ("SLURM_NODEID", "0".into()),
                ("SLURM_TASKS_PER_NODE", "2".into()),
                // The first host of the list is where rank 0 runs: this machine.
                ("SLURM_JOB_NODELIST", "localhost,node[2-3]".into()),
                ("SLURM_JOB_ID", "4242".into()),
                ("MASTER_PORT", port.to_string()),
            ])
        },
    );
    let outs: Vec<Output> = ranks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let report = report(&outs[0]);
    check_ranks(&report, 2);
    assert_eq!(report["launcher"], "slurm");
    assert_eq!(report["master"], format!("localhost:{port}"));
}

#[test]
fn a_killed_rank_fails_the_others_within_seconds() {
    let port = free_port();
    // Long enough to be mid-all-reduce when rank 1 is killed.
    let mut ranks = spawn_ranks(
        2,
        &["--megabytes", "64", "--iters", "100000", "--timeout", "600"],
        |rank| {
            pairs(&[
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.to_string()),
            ])
        },
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        ranks[0].try_wait().unwrap().is_none(),
        "rank 0 is still timing all-reduces"
    );
    ranks[1].kill().unwrap();
    ranks[1].wait().unwrap();
    let killed_at = Instant::now();
    let survivor = ranks.remove(0);
    let out = survivor.wait_with_output().unwrap();
    assert!(
        killed_at.elapsed() < Duration::from_secs(20),
        "rank 0 hung after rank 1 died"
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("error: ")
            && stderr.contains("rank 1")
            && stderr.contains("exited or crashed"),
        "{stderr}"
    );
}

#[test]
fn malformed_launcher_variables_are_named() {
    let out = Command::new(oxrl())
        .arg("dist-check")
        .env("RANK", "0")
        .env("WORLD_SIZE", "two")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("WORLD_SIZE=\"two\""), "{stderr}");
}
