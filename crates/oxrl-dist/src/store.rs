//! A client of torch's TCPStore: the key-value store every PyTorch launcher rendezvous
//! through. Under torchrun the agent already serves one on `MASTER_ADDR:MASTER_PORT`; oxrl
//! speaks its protocol (validate, ping, set, get, add, check, wait) instead of running a second.
//!
//! Keys carry torch's `/` prefix, so a key oxrl sets is the key a Python
//! `torch.distributed.TCPStore` reads under the same name, and the other way round.

use crate::error::{DistError, Result};
use crate::wire::{self, Message, Query};
use std::io;
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The prefix torch's Python `TCPStore` puts before every key.
const KEY_PREFIX: &str = "/";

/// One connection to a TCPStore server.
pub struct StoreClient {
    stream: TcpStream,
    addr: String,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to the store at `host:port`, retrying while it is not up yet (rank 0 may start
    /// after the others), for at most `timeout`; `timeout` also bounds every later wait.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match connect_once(host, port, deadline) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() < deadline && retryable(&e) => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => {
                    return Err(DistError::Store {
                        addr,
                        what: format!(
                            "cannot connect within {:.0} s (is rank 0 running, and MASTER_ADDR \
                             reachable from here?)",
                            timeout.as_secs_f64()
                        ),
                        source: e,
                    })
                }
            }
        };
        stream
            .set_nodelay(true)
            .map_err(|e| store_io(&addr, "setting TCP_NODELAY", e))?;
        let mut client = StoreClient {
            stream,
            addr,
            timeout,
        };
        client.handshake()?;
        Ok(client)
    }

    /// The address of this end of the connection: an interface of this host that reaches the
    /// store, so peers can reach it too.
    pub fn local_ip(&self) -> Result<IpAddr> {
        self.stream
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| store_io(&self.addr, "reading the local address", e))
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// VALIDATE with torch's magic number, then a PING whose nonce must come back.
    fn handshake(&mut self) -> Result<()> {
        let nonce = std::process::id();
        let sent = Message::new(Query::Validate)
            .u32(wire::VALIDATION_MAGIC)
            .send(&mut self.stream)
            .and_then(|()| Message::new(Query::Ping).u32(nonce).send(&mut self.stream));
        self.io("handshake", sent)?;
        self.set_read_timeout(Some(self.timeout))?;
        let echoed = wire::read_u32(&mut self.stream);
        let echoed = self.io("handshake (ping)", echoed)?;
        if echoed != nonce {
            return Err(DistError::Protocol {
                addr: self.addr.clone(),
                what: format!("ping returned {echoed}, not the nonce {nonce}: not a TCPStore?"),
            });
        }
        Ok(())
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let sent = Message::new(Query::Set)
            .bytes(prefixed(key).as_bytes())
            .bytes(value)
            .send(&mut self.stream);
        self.io(&format!("setting {key}"), sent)
    }

    /// The value of `key`, waiting up to the client's timeout for some rank to set it.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        self.wait(&[key], self.timeout)?;
        let value = Message::new(Query::Get)
            .bytes(prefixed(key).as_bytes())
            .send(&mut self.stream)
            .and_then(|()| wire::read_bytes(&mut self.stream));
        self.io(&format!("getting {key}"), value)
    }

    /// Adds `delta` to the integer at `key` (absent: 0) and returns the sum.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let sum = Message::new(Query::Add)
            .bytes(prefixed(key).as_bytes())
            .i64(delta)
            .send(&mut self.stream)
            .and_then(|()| wire::read_i64(&mut self.stream));
        self.io(&format!("adding to {key}"), sum)
    }

    /// Whether every key is set, without waiting.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool> {
        let mut message = Message::new(Query::Check).u64(keys.len() as u64);
        for key in keys {
            message = message.bytes(prefixed(key).as_bytes());
        }
        let answer = message
            .send(&mut self.stream)
            .and_then(|()| wire::read_u8(&mut self.stream));
        match self.io("checking keys", answer)? {
            wire::CHECK_READY => Ok(true),
            wire::CHECK_NOT_READY => Ok(false),
            other => Err(self.protocol(format!("CHECK answered {other}"))),
        }
    }

    /// Waits until every key is set, for at most `timeout`. On timeout the wait is cancelled
    /// on the server as torch's client does, so the connection stays usable.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut message = Message::new(Query::Wait).u64(keys.len() as u64);
        for key in keys {
            message = message.bytes(prefixed(key).as_bytes());
        }
        let sent = message.send(&mut self.stream);
        self.io("waiting for keys", sent)?;
        self.set_read_timeout(Some(timeout))?;
        match wire::read_u8(&mut self.stream) {
            Ok(wire::STOP_WAITING) => Ok(()),
            Ok(other) => Err(self.protocol(format!("WAIT answered {other}"))),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                self.cancel_wait()?;
                Err(DistError::Store {
                    addr: self.addr.clone(),
                    what: format!(
                        "waiting for {} (no rank set it within {:.1} s)",
                        keys.join(", "),
                        timeout.as_secs_f64()
                    ),
                    source: e,
                })
            }
            Err(e) => Err(store_io(&self.addr, "waiting for keys", e)),
        }
    }

    /// CANCEL_WAIT; the server may have answered the wait just before seeing it.
    fn cancel_wait(&mut self) -> Result<()> {
        let sent = Message::new(Query::CancelWait).send(&mut self.stream);
        self.io("cancelling a wait", sent)?;
        self.set_read_timeout(Some(self.timeout))?;
        let first = wire::read_u8(&mut self.stream);
        let mut answer = self.io("cancelling a wait", first)?;
        if answer == wire::STOP_WAITING {
            let second = wire::read_u8(&mut self.stream);
            answer = self.io("cancelling a wait", second)?;
        }
        if answer != wire::WAIT_CANCELED {
            return Err(self.protocol(format!("CANCEL_WAIT answered {answer}")));
        }
        Ok(())
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        self.stream
            .set_read_timeout(timeout.filter(|t| !t.is_zero()))
            .map_err(|e| store_io(&self.addr, "setting a timeout", e))
    }

    fn io<T>(&self, what: &str, r: io::Result<T>) -> Result<T> {
        r.map_err(|e| store_io(&self.addr, what, e))
    }

    fn protocol(&self, what: String) -> DistError {
        DistError::Protocol {
            addr: self.addr.clone(),
            what,
        }
    }
}

fn prefixed(key: &str) -> String {
    format!("{KEY_PREFIX}{key}")
}

fn store_io(addr: &str, what: &str, source: io::Error) -> DistError {
    DistError::Store {
        addr: addr.into(),
        what: what.into(),
        source,
    }
}

fn connect_once(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{host} resolves to no address"),
    );
    let addrs = (host, port).to_socket_addrs().map_err(|e| {
        // A Kubernetes service or a Slurm node may not resolve yet: retried as "not up".
        io::Error::new(io::ErrorKind::NotFound, format!("resolving {host}: {e}"))
    })?;
    for addr in addrs {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Failures that mean "not up yet" rather than "wrong address".
fn retryable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::TimedOut
            | io::ErrorKind::NotFound
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::AddrNotAvailable
    ) || e
        .raw_os_error()
        .is_some_and(|c| c == 11 || c == 110 || c == 111)
}
