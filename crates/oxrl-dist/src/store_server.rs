//! oxrl's own TCPStore server, for launchers that do not bring one (srun, Ray, plain
//! Kubernetes Jobs): rank 0 serves it on `MASTER_PORT`. It speaks torch's protocol in full
//! (a Python `torch.distributed.TCPStore` client works against it), one thread per connection.

use crate::wire::{self, Message, Query};
use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How often a waiting connection looks for a CANCEL_WAIT or a closed peer.
const WAIT_POLL: Duration = Duration::from_millis(50);

#[derive(Default)]
struct Keys {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl Keys {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A connection thread that panicked cannot leave the map half-written (every update is
        // one insert), so a poisoned lock's data is still sound.
        self.values.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A store serving on a port until the process exits.
pub struct StoreServer {
    port: u16,
}

impl StoreServer {
    /// Listens on `host:port` (port 0: any free port) and serves from a background thread.
    pub fn bind(host: &str, port: u16) -> io::Result<Self> {
        let listener = TcpListener::bind((host, port))?;
        let port = listener.local_addr()?.port();
        let keys = Arc::new(Keys::default());
        std::thread::Builder::new()
            .name("oxrl-store".into())
            .spawn(move || {
                for connection in listener.incoming().flatten() {
                    let keys = keys.clone();
                    let _ = std::thread::Builder::new()
                        .name("oxrl-store-conn".into())
                        .spawn(move || serve(connection, &keys));
                }
            })?;
        Ok(StoreServer { port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

/// Answers one client's queries until it disconnects or breaks the protocol.
fn serve(mut stream: TcpStream, keys: &Keys) {
    let _ = stream.set_nodelay(true);
    // A client's first query validates it with torch's magic number.
    match wire::read_u8(&mut stream) {
        Ok(byte) if byte == Query::Validate as u8 => {}
        _ => return,
    }
    match wire::read_u32(&mut stream) {
        Ok(wire::VALIDATION_MAGIC) => {}
        _ => return,
    }
    while let Ok(byte) = wire::read_u8(&mut stream) {
        let Some(query) = Query::from_byte(byte) else {
            return;
        };
        if answer(query, &mut stream, keys).is_err() {
            return;
        }
    }
}

fn answer(query: Query, stream: &mut TcpStream, keys: &Keys) -> io::Result<()> {
    match query {
        Query::Validate => {
            if wire::read_u32(stream)? != wire::VALIDATION_MAGIC {
                return Err(io::ErrorKind::InvalidData.into());
            }
        }
        Query::Ping => {
            let nonce = wire::read_u32(stream)?;
            Message::reply().u32(nonce).send(stream)?;
        }
        Query::Set => {
            let key = wire::read_string(stream)?;
            let value = wire::read_bytes(stream)?;
            keys.lock().insert(key, value);
            keys.changed.notify_all();
        }
        Query::CompareSet => {
            let key = wire::read_string(stream)?;
            let expected = wire::read_bytes(stream)?;
            let desired = wire::read_bytes(stream)?;
            let mut values = keys.lock();
            // torch's semantics: an absent key is set only when `expected` is empty.
            let current = match values.get(&key) {
                None if expected.is_empty() => {
                    values.insert(key, desired.clone());
                    desired
                }
                None => expected,
                Some(current) if *current == expected => {
                    values.insert(key, desired.clone());
                    desired
                }
                Some(current) => current.clone(),
            };
            drop(values);
            keys.changed.notify_all();
            Message::reply().bytes(&current).send(stream)?;
        }
        Query::Get => {
            let key = wire::read_string(stream)?;
            // Clients WAIT before GET; a GET of an absent key is a broken client.
            let value = keys
                .lock()
                .get(&key)
                .cloned()
                .ok_or(io::ErrorKind::NotFound)?;
            Message::reply().bytes(&value).send(stream)?;
        }
        Query::Add => {
            let key = wire::read_string(stream)?;
            let delta = wire::read_i64(stream)?;
            let mut values = keys.lock();
            // Counters are stored as decimal text, as torch stores them.
            let current = match values.get(&key) {
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or(io::ErrorKind::InvalidData)?,
                None => 0,
            };
            let sum = current + delta;
            values.insert(key, sum.to_string().into_bytes());
            drop(values);
            keys.changed.notify_all();
            Message::reply().i64(sum).send(stream)?;
        }
        Query::Check => {
            let wanted = read_keys(stream)?;
            let values = keys.lock();
            let ready = wanted.iter().all(|k| values.contains_key(k));
            drop(values);
            let answer = if ready {
                wire::CHECK_READY
            } else {
                wire::CHECK_NOT_READY
            };
            stream_write(stream, &[answer])?;
        }
        Query::Wait => {
            let wanted = read_keys(stream)?;
            wait_for(stream, keys, &wanted)?;
        }
        Query::CancelWait => stream_write(stream, &[wire::WAIT_CANCELED])?,
        Query::GetNumKeys => {
            let n = keys.lock().len() as i64;
            Message::reply().i64(n).send(stream)?;
        }
        Query::DeleteKey => {
            let key = wire::read_string(stream)?;
            let deleted = keys.lock().remove(&key).is_some() as i64;
            Message::reply().i64(deleted).send(stream)?;
        }
        Query::Append => {
            let key = wire::read_string(stream)?;
            let value = wire::read_bytes(stream)?;
            keys.lock()
                .entry(key)
                .or_default()
                .extend_from_slice(&value);
            keys.changed.notify_all();
        }
        Query::MultiGet => {
            let wanted = read_keys(stream)?;
            let values = keys.lock();
            let mut reply = Message::reply();
            for key in &wanted {
                let value = values.get(key).ok_or(io::ErrorKind::NotFound)?;
                reply = reply.bytes(value);
            }
            drop(values);
            reply.send(stream)?;
        }
        Query::MultiSet => {
            let n = wire::read_u64(stream)?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                pairs.push((wire::read_string(stream)?, wire::read_bytes(stream)?));
            }
            keys.lock().extend(pairs);
            keys.changed.notify_all();
        }
    }
    Ok(())
}

/// Blocks until every key is set (STOP_WAITING), the client cancels (WAIT_CANCELED) or
/// disconnects.
fn wait_for(stream: &mut TcpStream, keys: &Keys, wanted: &[String]) -> io::Result<()> {
    let mut values = keys.lock();
    loop {
        if wanted.iter().all(|k| values.contains_key(k)) {
            drop(values);
            return stream_write(stream, &[wire::STOP_WAITING]);
        }
        values = keys
            .changed
            .wait_timeout(values, WAIT_POLL)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        if let Some(byte) = pending_byte(stream)? {
            drop(values);
            if byte != Query::CancelWait as u8 {
                return Err(io::ErrorKind::InvalidData.into());
            }
            let mut consumed = [0u8; 1];
            stream.read_exact(&mut consumed)?;
            return stream_write(stream, &[wire::WAIT_CANCELED]);
        }
    }
}

/// The next byte the client has sent, without consuming it; an error once it disconnected.
fn pending_byte(stream: &TcpStream) -> io::Result<Option<u8>> {
    stream.set_nonblocking(true)?;
    let mut byte = [0u8; 1];
    let peeked = stream.peek(&mut byte);
    stream.set_nonblocking(false)?;
    match peeked {
        Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
        Ok(_) => Ok(Some(byte[0])),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

fn read_keys(stream: &mut TcpStream) -> io::Result<Vec<String>> {
    let n = wire::read_u64(stream)?;
    if n > 1 << 20 {
        return Err(io::ErrorKind::InvalidData.into());
    }
    (0..n).map(|_| wire::read_string(stream)).collect()
}

fn stream_write(stream: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    stream.write_all(bytes)
}
