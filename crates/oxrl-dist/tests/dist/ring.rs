//! The TCP ring's collectives between real sockets: W ranks as threads of this test, each
//! joining through the rendezvous store exactly as separate processes do.

use candle_core::{DType, Device, Tensor};
use oxrl_dist::{chunk, Collective, DistEnv, Launcher, ProcessGroup};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port()
}

fn env(rank: usize, world_size: usize, port: u16) -> DistEnv {
    DistEnv {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        launcher: Launcher::Env,
        agent_store: false,
        attempt: 0,
    }
}

/// Runs `body` on `world` ranks joined into one group; returns their results in rank order.
fn on_ranks<R: Send + 'static>(
    world: usize,
    body: impl Fn(usize, Arc<dyn Collective>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let port = free_port();
    let body = Arc::new(body);
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let body = body.clone();
            std::thread::spawn(move || {
                let group = ProcessGroup::join_cpu(env(rank, world, port), Duration::from_secs(60))
                    .expect("joining the group");
                body(rank, group.collective())
            })
        })
        .collect();
    ranks
        .into_iter()
        .map(|r| r.join().expect("rank thread"))
        .collect()
}

/// Rank r's test vector: distinct per rank and element, exact in f32.
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 1000 + i) as f32 * 0.5).collect()
}

/// The element-wise sum of every rank's [`values`], added in rank order.
fn sums(world: usize, n: usize) -> Vec<f32> {
    let mut total = vec![0f32; n];
    for rank in 0..world {
        for (t, v) in total.iter_mut().zip(values(rank, n)) {
            *t += v;
        }
    }
    total
}

#[test]
fn all_reduce_sums_over_two_three_and_four_ranks() {
    for world in [2, 3, 4] {
        // 10 elements over 3 or 4 ranks: uneven chunks.
        for n in [1, 10, 100_003] {
            let reduced = on_ranks(world, move |rank, group| {
                let t = Tensor::from_vec(values(rank, n), n, &Device::Cpu).unwrap();
                group.all_reduce_sum(&t).unwrap().to_vec1::<f32>().unwrap()
            });
            let expected = sums(world, n);
            for (rank, got) in reduced.iter().enumerate() {
                assert_eq!(got, &expected, "world {world} n {n} rank {rank}");
            }
        }
    }
}

#[test]
fn reduce_scatter_then_all_gather_is_an_all_reduce() {
    let world = 4;
    let n = 4 * 2501;
    let results = on_ranks(world, move |rank, group| {
        let t = Tensor::from_vec(values(rank, n), n, &Device::Cpu).unwrap();
        let shard = group.reduce_scatter_sum(&t).unwrap();
        let gathered = group.all_gather(&shard).unwrap();
        (
            shard.to_vec1::<f32>().unwrap(),
            gathered.to_vec1::<f32>().unwrap(),
        )
    });
    let expected = sums(world, n);
    for (rank, (shard, gathered)) in results.iter().enumerate() {
        assert_eq!(
            shard.as_slice(),
            &expected[chunk(rank, n, world)],
            "rank {rank}"
        );
        assert_eq!(gathered, &expected, "rank {rank}");
    }
}

#[test]
fn broadcast_bytes_and_host_sums() {
    let world = 3;
    let n = 700_001; // several broadcast pieces
    let results = on_ranks(world, move |rank, group| {
        let mine = Tensor::from_vec(values(rank, n), n, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let from_1 = group
            .broadcast(&mine, 1)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let messages = group
            .all_gather_bytes(format!("rank {rank} says hi").repeat(rank).as_bytes())
            .unwrap();
        let mut totals = [rank as f64, 1.0];
        group.all_reduce_host(&mut totals).unwrap();
        group.barrier().unwrap();
        (from_1.to_vec1::<f32>().unwrap(), messages, totals)
    });
    let expected = Tensor::from_vec(values(1, n), n, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (from_1, messages, totals) in &results {
        assert_eq!(from_1, &expected);
        let want: Vec<Vec<u8>> = (0..world)
            .map(|r| format!("rank {r} says hi").repeat(r).into_bytes())
            .collect();
        assert_eq!(messages, &want);
        assert_eq!(totals, &[3.0, 3.0]);
    }
}

#[test]
fn a_reduce_scatter_of_an_unpadded_buffer_is_refused() {
    let errors = on_ranks(2, |_, group| {
        let t = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
        group.reduce_scatter_sum(&t).unwrap_err().to_string()
    });
    assert!(
        errors[0].contains("pad to a multiple of 2"),
        "{}",
        errors[0]
    );
}

#[test]
fn a_rank_that_exits_fails_its_peers_at_once_naming_it() {
    let started = Instant::now();
    let results = on_ranks(3, |rank, group| {
        group.barrier().unwrap();
        if rank == 1 {
            // Rank 1 leaves: dropping the group closes its sockets, as a crash would.
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
        let t = Tensor::ones(1 << 16, DType::F32, &Device::Cpu).unwrap();
        group
            .all_reduce_sum(&t)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "peers must not hang"
    );
    // Rank 2 receives from rank 1 and names it. Rank 0 sends to rank 1 and receives from
    // rank 2; whichever fails first, it reports a peer that is gone (rank 2 leaves as soon as
    // it has failed), and errors instead of hanging.
    let rank_2 = results[2].as_ref().unwrap_err();
    assert!(
        rank_2.contains("rank 2: receiving from rank 1") && rank_2.contains("exited or crashed"),
        "{rank_2}"
    );
    let rank_0 = results[0].as_ref().unwrap_err();
    assert!(
        rank_0.starts_with("rank 0: ") && rank_0.contains("exited or crashed"),
        "{rank_0}"
    );
}
