//! oxrl's store client against oxrl's store server: what the rendezvous of srun, Ray and
//! Kubernetes groups relies on.

use oxrl_dist::{StoreClient, StoreServer};
use std::time::{Duration, Instant};

#[test]
fn values_counters_and_waits_across_clients() {
    let server = StoreServer::bind("127.0.0.1", 0).unwrap();
    let port = server.port();
    let waiter = std::thread::spawn(move || {
        let mut store = StoreClient::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
        // Blocks until the other client sets the key.
        store.get("late").unwrap()
    });
    let mut store = StoreClient::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    store.set("late", b"arrived").unwrap();
    assert_eq!(waiter.join().unwrap(), b"arrived");
    assert_eq!(store.add("c", 2).unwrap(), 2);
    assert_eq!(store.add("c", -5).unwrap(), -3);
    assert_eq!(store.get("c").unwrap(), b"-3");
    assert!(store.check(&["late", "c"]).unwrap());
    assert!(!store.check(&["late", "absent"]).unwrap());
}

#[test]
fn a_timed_out_wait_is_cancelled_and_the_connection_survives() {
    let server = StoreServer::bind("127.0.0.1", 0).unwrap();
    let mut store =
        StoreClient::connect("127.0.0.1", server.port(), Duration::from_secs(30)).unwrap();
    let started = Instant::now();
    let err = store
        .wait(&["never"], Duration::from_millis(200))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("waiting for never") && err.contains("within 0.2 s"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
}

#[test]
fn a_client_waits_for_a_store_that_starts_late() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        StoreServer::bind("127.0.0.1", port).unwrap()
    });
    let mut store = StoreClient::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
    let _server = late.join().unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
}

#[test]
fn no_store_is_a_clear_error_within_the_timeout() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let started = Instant::now();
    let err = StoreClient::connect("127.0.0.1", port, Duration::from_millis(500))
        .err()
        .expect("nothing listens")
        .to_string();
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("is rank 0 running"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn something_that_is_not_a_store_is_refused() {
    // An HTTP-ish server that answers the handshake with garbage.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 10];
        s.read_exact(&mut buf).unwrap();
        s.write_all(b"HTTP").unwrap();
    });
    let err = StoreClient::connect("127.0.0.1", port, Duration::from_secs(5))
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("not a TCPStore"), "{err}");
}
