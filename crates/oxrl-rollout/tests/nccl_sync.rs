//! `sync = "nccl"` against two stub servers that hold up their half of each collective the way
//! vLLM's workers do: `/init_weight_transfer_engine` answers only once the trainer has joined
//! the group, `/update_weights` only once every tensor it announced has been broadcast. A
//! trainer that sent the requests and the NCCL calls one after the other would stall here, as
//! it would against vLLM. The broadcaster records what it sent, in order; the real one (NCCL)
//! needs GPUs.

use base64::Engine as _;
use candle_core::{DType, Device, Tensor};
use oxrl_fixtures::{fixture, read_http_request, write_http_json};
use oxrl_models::Qwen3;
use oxrl_rollout::weight_transfer::NCCL_UNIQUE_ID_BYTES;
use oxrl_rollout::{Broadcaster, Engine, VllmEngine, VllmSpec, WeightSync, WeightVersion};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What both sides of the stubbed collectives have seen.
#[derive(Default)]
struct Log {
    /// Per server: every control request, `(path, body)`, in arrival order.
    requests: Vec<Vec<(String, Value)>>,
    /// The world size the trainer joined with, once it has.
    joined: Option<usize>,
    /// The shape of every tensor broadcast, in order.
    broadcast: Vec<Vec<usize>>,
}

type Shared = Arc<(Mutex<Log>, Condvar)>;

/// Waits up to 5 s for `ready`; false if it never was.
fn wait_for(shared: &Shared, ready: impl Fn(&Log) -> bool) -> bool {
    let (log, changed) = &**shared;
    let guard = log.lock().unwrap();
    let (still_locked, timeout) = changed
        .wait_timeout_while(guard, Duration::from_secs(5), |l| !ready(l))
        .unwrap();
    drop(still_locked);
    !timeout.timed_out()
}

fn record(shared: &Shared, change: impl FnOnce(&mut Log)) {
    let (log, changed) = &**shared;
    change(&mut log.lock().unwrap());
    changed.notify_all();
}

fn requests_to(log: &Log, path: &str) -> usize {
    log.requests
        .iter()
        .flatten()
        .filter(|(p, _)| p == path)
        .count()
}

/// A server with `workers` workers, answering as vLLM's dev-mode routes do.
fn serve(index: usize, workers: usize, shared: Shared) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let Some((path, body)) = read_http_request(&stream) else {
                    return;
                };
                match path.as_str() {
                    "/health" => return write_http_json(&stream, "200 OK", ""),
                    "/get_world_size" => {
                        let answer = json!({ "world_size": workers }).to_string();
                        return write_http_json(&stream, "200 OK", &answer);
                    }
                    _ => {}
                }
                let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let names = body
                    .pointer("/update_info/names")
                    .and_then(Value::as_array)
                    .map_or(0, Vec::len);
                record(&shared, |l| l.requests[index].push((path.clone(), body)));
                let held_up_by_the_trainer = match path.as_str() {
                    "/init_weight_transfer_engine" => wait_for(&shared, |l| l.joined.is_some()),
                    "/update_weights" => wait_for(&shared, |l| {
                        let rounds = requests_to(l, "/finish_weight_update") / 2 + 1;
                        l.broadcast.len() >= rounds * names
                    }),
                    _ => true,
                };
                if held_up_by_the_trainer {
                    write_http_json(&stream, "200 OK", r#"{"message": "ok"}"#)
                } else {
                    write_http_json(
                        &stream,
                        "500 Internal Server Error",
                        "the trainer never came",
                    )
                }
            });
        }
    });
    url
}

/// Rank 0 of the stubbed group: joining waits for both servers' init requests, a broadcast for
/// both servers' update request of its round.
struct Recorder(Shared);

impl Broadcaster for Recorder {
    fn unique_id(&mut self) -> oxrl_rollout::engine::Result<[u8; NCCL_UNIQUE_ID_BYTES]> {
        let mut id = [0u8; NCCL_UNIQUE_ID_BYTES];
        id[..3].copy_from_slice(&[0xfb, 0xef, 0x01]);
        Ok(id)
    }

    fn join(
        &mut self,
        _id: &[u8; NCCL_UNIQUE_ID_BYTES],
        world_size: usize,
    ) -> oxrl_rollout::engine::Result<()> {
        let arrived = wait_for(&self.0, |l| {
            requests_to(l, "/init_weight_transfer_engine") == 2
        });
        assert!(arrived, "join: the servers never posted their init");
        record(&self.0, |l| l.joined = Some(world_size));
        Ok(())
    }

    fn broadcast(&mut self, tensor: &Tensor) -> oxrl_rollout::engine::Result<()> {
        let round = wait_for(&self.0, |l| {
            let finished = requests_to(l, "/finish_weight_update") / 2;
            requests_to(l, "/update_weights") == 2 * (finished + 1)
        });
        assert!(round, "broadcast: the servers never posted /update_weights");
        record(&self.0, |l| l.broadcast.push(tensor.dims().to_vec()));
        Ok(())
    }
}

fn spec(urls: Vec<String>, sync: WeightSync) -> VllmSpec {
    VllmSpec {
        server_urls: urls,
        sync,
        sync_dir: None,
        timeout: Duration::from_secs(10),
        max_retries: 0,
        backoff: Duration::from_millis(10),
    }
}

#[test]
fn nccl_sync_joins_once_then_announces_and_broadcasts_every_tensor_in_order() {
    let shared: Shared = Default::default();
    shared.0.lock().unwrap().requests = vec![Vec::new(), Vec::new()];
    let urls = vec![serve(0, 2, shared.clone()), serve(1, 1, shared.clone())];
    let policy = Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    let mut engine =
        VllmEngine::connect(spec(urls, WeightSync::Nccl), Path::new("/x"), None, vec![])
            .unwrap()
            .with_broadcaster(Box::new(Recorder(shared.clone())));

    engine.sync_weights(&policy, WeightVersion(1)).unwrap();
    engine.sync_weights(&policy, WeightVersion(2)).unwrap();
    assert_eq!(engine.weight_version(), WeightVersion(2));

    let log = shared.0.lock().unwrap();
    assert_eq!(log.joined, Some(4), "trainer + 2 workers + 1 worker");
    let params = policy.named_parameters();
    let shapes: Vec<Vec<usize>> = params.iter().map(|(_, t)| t.dims().to_vec()).collect();
    assert_eq!(log.broadcast, [shapes.clone(), shapes.clone()].concat());
    let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
    for (server, first_rank) in [(0, 1), (1, 3)] {
        let paths: Vec<&str> = log.requests[server]
            .iter()
            .map(|(p, _)| p.as_str())
            .collect();
        let round = [
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
        ];
        let mut expected = vec!["/init_weight_transfer_engine"];
        expected.extend(round);
        expected.extend(round);
        assert_eq!(
            paths, expected,
            "server {server}: join once, then two rounds"
        );
        let init = &log.requests[server][0].1["init_info"];
        assert_eq!(init["rank_offset"], first_rank);
        assert_eq!(init["world_size"], 4);
        assert_eq!(init["packed"], false);
        let id = base64::engine::general_purpose::STANDARD
            .decode(init["nccl_unique_id_b64"].as_str().unwrap())
            .unwrap();
        assert_eq!(id[..3], [0xfb, 0xef, 0x01]);
        let update = &log.requests[server][2].1["update_info"];
        assert_eq!(update["names"], json!(names));
        assert_eq!(update["shapes"], json!(shapes));
        assert!(update["dtype_names"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d == "float32"));
        let keys: Vec<&String> = update.as_object().unwrap().keys().collect();
        assert_eq!(
            keys.len(),
            3,
            "vLLM rejects unknown update_info keys: {keys:?}"
        );
        assert_eq!(log.requests[server][3].1, json!({"weight_version": "v1"}));
        assert_eq!(log.requests[server][6].1, json!({"weight_version": "v2"}));
    }
}

#[test]
fn nccl_sync_without_a_broadcaster_is_a_clear_error_and_keeps_the_version() {
    let shared: Shared = Default::default();
    shared.0.lock().unwrap().requests = vec![Vec::new()];
    let url = serve(0, 1, shared.clone());
    let policy = Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    let mut engine = VllmEngine::connect(
        spec(vec![url], WeightSync::Nccl),
        Path::new("/x"),
        None,
        vec![],
    )
    .unwrap();
    let err = engine
        .sync_weights(&policy, WeightVersion(1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("CUDA build") && err.contains("sync = \"disk\""),
        "{err}"
    );
    assert_eq!(engine.weight_version(), WeightVersion(0));
    assert!(
        shared.0.lock().unwrap().requests[0].is_empty(),
        "nothing was sent"
    );
}
