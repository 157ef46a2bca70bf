//! oxrl's TCPStore client and server against torch 2.13's `torch.distributed.TCPStore` (the
//! pinned venv): the store torchrun's agent serves is torch's, so the client must speak its
//! protocol byte for byte, and torch's client must find nothing missing in oxrl's server.

use oxrl_dist::{StoreClient, StoreServer};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TORCH_SERVER: &str = r#"
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
store.set("from_torch", b"\x00torch\xff")
print(store.port, flush=True)
store.wait(["from_oxrl"])
print("from_oxrl=" + store.get("from_oxrl").hex(), flush=True)
print("counter=" + str(store.add("counter", 0)), flush=True)
store.set("done", b"1")
sys.stdin.read()
"#;

#[test]
fn oxrl_client_speaks_to_torchs_store() {
    let python = oxrl_fixtures::peer_python();
    let mut server = Command::new(&python)
        .args(["-c", TORCH_SERVER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs");
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let port: u16 = lines
        .next()
        .expect("the port")
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let mut store = StoreClient::connect("127.0.0.1", port, Duration::from_secs(60)).unwrap();
    assert_eq!(store.get("from_torch").unwrap(), b"\x00torch\xff");
    assert_eq!(store.add("counter", 5).unwrap(), 5);
    assert_eq!(store.add("counter", 2).unwrap(), 7);
    assert!(store.check(&["from_torch", "counter"]).unwrap());
    assert!(!store.check(&["absent"]).unwrap());

    // A wait that times out is cancelled on torch's server; the connection stays usable.
    let started = Instant::now();
    let err = store
        .wait(&["never"], Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("never") && err.contains(&port.to_string()),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    store.set("from_oxrl", &[1, 2, 3, 0, 255]).unwrap();
    assert_eq!(store.get("done").unwrap(), b"1");

    assert_eq!(
        lines.next().unwrap().unwrap(),
        "from_oxrl=010203 00ff".replace(' ', "")
    );
    assert_eq!(lines.next().unwrap().unwrap(), "counter=7");
    drop(server.stdin.take());
    assert!(server.wait().unwrap().success());
}

const TORCH_CLIENT: &str = r#"
import datetime, sys, torch.distributed as dist
port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
print("get", store.get("from_oxrl").decode())
store.set("from_torch", b"written by torch")
print("add", store.add("n", 3), store.add("n", -1))
print("compare_set", store.compare_set("cs", b"", b"first").decode(),
      store.compare_set("cs", b"wrong", b"second").decode(),
      store.compare_set("cs", b"first", b"third").decode())
print("check", store.check(["from_oxrl", "n"]), store.check(["nothing"]))
try:
    store.wait(["nothing"], datetime.timedelta(milliseconds=200))
    print("wait returned")
except Exception as e:
    print("wait timed out")
print("after cancel", store.get("cs").decode())
store.append("log", b"a"); store.append("log", b"b")
store.multi_set(["m1", "m2"], [b"x", b"y"])
print("multi", [v.decode() for v in store.multi_get(["m1", "m2", "log"])])
print("delete", store.delete_key("m1"), store.delete_key("m1"))
print("keys", store.num_keys())
"#;

#[test]
fn torchs_client_finds_oxrls_store_complete() {
    let python = oxrl_fixtures::peer_python();
    let server = StoreServer::bind("127.0.0.1", 0).unwrap();
    let mut store =
        StoreClient::connect("127.0.0.1", server.port(), Duration::from_secs(30)).unwrap();
    store.set("from_oxrl", b"hello torch").unwrap();
    let mut child = Command::new(&python)
        .args(["-c", TORCH_CLIENT, &server.port().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs");
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(child.wait().unwrap().success(), "{out}\n{err}");
    let expected = [
        "get hello torch",
        "add 3 2",
        "compare_set first first third",
        "check True False",
        "wait timed out",
        "after cancel third",
        "multi ['x', 'y', 'ab']",
        "delete True False",
    ];
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(&lines[..expected.len()], &expected, "{out}\n{err}");
    // from_oxrl, from_torch, n, cs, log, m2: torch's count includes nothing else.
    assert_eq!(lines[expected.len()], "keys 6", "{out}");
    assert_eq!(store.get("from_torch").unwrap(), b"written by torch");
}
