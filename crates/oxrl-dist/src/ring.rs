//! The CPU transport: ranks in a ring over TCP, each sending to the next and receiving from
//! the previous, as Gloo's ring algorithms do. All-reduce is a reduce-scatter then an
//! all-gather, each W − 1 steps of 1/W of the buffer, so every rank sends 2(W − 1)/W of it in
//! all — the bandwidth-optimal schedule. It lets multi-process training run and be tested on
//! CPUs with real processes; it is not a cluster transport (GPU ranks use NCCL).

use crate::error::{DistError, Result};
use crate::rendezvous::Rendezvous;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The first bytes of a ring connection: "oxrl" and the protocol version.
const RING_MAGIC: u32 = 0x6f78_726c;
const RING_VERSION: u32 = 1;

/// Pieces a broadcast is forwarded in, so the ring's hops overlap.
const BROADCAST_PIECE_BYTES: usize = 1 << 20;

/// A value the ring can sum: plain old data with an addition.
pub trait Element: bytemuck::Pod + Send + Sync {
    fn sum(self, other: Self) -> Self;
}

macro_rules! float_element {
    ($($t:ty),*) => {$(impl Element for $t { fn sum(self, other: Self) -> Self { self + other } })*};
}
macro_rules! integer_element {
    ($($t:ty),*) => {$(impl Element for $t { fn sum(self, other: Self) -> Self { self.wrapping_add(other) } })*};
}
float_element!(f32, f64, half::bf16, half::f16);
integer_element!(u8, u32, i64, u64);

/// One rank's two connections: to the next rank and from the previous one.
pub struct TcpRing {
    rank: usize,
    world_size: usize,
    next: TcpStream,
    prev: TcpStream,
    next_addr: String,
    prev_addr: String,
    /// One collective at a time: two interleaved on the same sockets would mix their bytes.
    busy: Mutex<()>,
}

impl TcpRing {
    /// Listens on a free port, publishes `ip:port` through the store, connects to the next
    /// rank and accepts the previous one; `timeout` bounds the setup and every later send or
    /// receive (a peer that neither answers nor closes its socket).
    pub fn connect(
        rendezvous: &mut Rendezvous,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let listener = TcpListener::bind(("0.0.0.0", 0)).map_err(|e| {
            DistError::Invalid(format!(
                "rank {rank}: cannot listen for the ring connection: {e}"
            ))
        })?;
        let port = listener
            .local_addr()
            .map_err(|e| {
                DistError::Invalid(format!("rank {rank}: the ring listener's address: {e}"))
            })?
            .port();
        let mine = format!("{}:{port}", advertised_ip(rendezvous)?);
        let addrs: Vec<String> = rendezvous
            .all_gather("ring", mine.as_bytes())?
            .into_iter()
            .map(|a| String::from_utf8_lossy(&a).into_owned())
            .collect();
        let next_rank = (rank + 1) % world_size;
        let prev_rank = (rank + world_size - 1) % world_size;
        let deadline = Instant::now() + timeout;
        let peer_err = |peer: usize, addr: &str, what: &str, source: io::Error| DistError::Peer {
            rank,
            peer,
            addr: addr.to_string(),
            what: what.to_string(),
            source,
        };
        let next_addr = addrs[next_rank].clone();
        let mut next = connect_until(&next_addr, deadline)
            .map_err(|e| peer_err(next_rank, &next_addr, "connecting the ring to", e))?;
        let hello = [RING_MAGIC, RING_VERSION, rank as u32, world_size as u32];
        next.write_all(bytemuck::cast_slice(&hello))
            .map_err(|e| peer_err(next_rank, &next_addr, "greeting", e))?;
        let (mut prev, from) = accept_until(&listener, deadline).map_err(|e| {
            peer_err(
                prev_rank,
                &addrs[prev_rank],
                "waiting for the ring connection of",
                e,
            )
        })?;
        prev.set_read_timeout(Some(timeout))
            .map_err(|e| peer_err(prev_rank, &from, "configuring", e))?;
        let mut greeting = [0u32; 4];
        prev.read_exact(bytemuck::cast_slice_mut(&mut greeting))
            .map_err(|e| peer_err(prev_rank, &from, "reading the greeting of", e))?;
        if greeting
            != [
                RING_MAGIC,
                RING_VERSION,
                prev_rank as u32,
                world_size as u32,
            ]
        {
            return Err(DistError::Invalid(format!(
                "rank {rank}: the ring connection from {from} is not rank {prev_rank} of \
                 {world_size} (it sent {greeting:?}); two jobs on one MASTER_PORT?"
            )));
        }
        for stream in [&next, &prev] {
            let configured = stream
                .set_nodelay(true)
                .and_then(|()| stream.set_read_timeout(Some(timeout)))
                .and_then(|()| stream.set_write_timeout(Some(timeout)));
            configured.map_err(|e| peer_err(next_rank, &next_addr, "configuring", e))?;
        }
        Ok(TcpRing {
            rank,
            world_size,
            next,
            prev,
            next_addr,
            prev_addr: from,
            busy: Mutex::new(()),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.world_size
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.world_size - 1) % self.world_size
    }

    /// Sums `buf` element-wise over the ranks; every rank ends with the same sums.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        self.reduce_scatter_steps(buf)?;
        self.all_gather_steps(buf)
    }

    /// Sums over the ranks and leaves this rank's chunk ([`chunk`]`(rank)`) of the sums in
    /// place; the rest of `buf` is scratch afterwards.
    pub fn reduce_scatter<T: Element>(&self, buf: &mut [T]) -> Result<Range<usize>> {
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        self.reduce_scatter_steps(buf)?;
        Ok(chunk(self.rank, buf.len(), self.world_size))
    }

    /// Fills every rank's chunk of `buf` from the rank that holds it (this rank's chunk is
    /// [`chunk`]`(rank)`).
    pub fn all_gather<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        self.all_gather_steps(buf)
    }

    /// Step s: send chunk (r − s − 1), receive chunk (r − s − 2) and add it in, so after
    /// W − 1 steps chunk r holds the sum over all ranks.
    fn reduce_scatter_steps<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let w = self.world_size;
        let n = buf.len();
        let mut incoming = vec![T::zeroed(); n.div_ceil(w)];
        for step in 0..w - 1 {
            let send = chunk((self.rank + 2 * w - step - 1) % w, n, w);
            let recv = chunk((self.rank + 2 * w - step - 2) % w, n, w);
            let incoming = &mut incoming[..recv.len()];
            self.exchange(
                bytemuck::cast_slice(&buf[send]),
                bytemuck::cast_slice_mut(incoming),
            )?;
            for (mine, theirs) in buf[recv].iter_mut().zip(incoming.iter()) {
                *mine = mine.sum(*theirs);
            }
        }
        Ok(())
    }

    /// Step s: send chunk (r − s), receive chunk (r − s − 1) in place.
    fn all_gather_steps<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let w = self.world_size;
        let n = buf.len();
        for step in 0..w - 1 {
            let send = chunk((self.rank + w - step) % w, n, w);
            let recv = chunk((self.rank + 2 * w - step - 1) % w, n, w);
            let (send, recv) = disjoint(buf, send, recv);
            self.exchange(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))?;
        }
        Ok(())
    }

    /// Copies `root`'s `buf` to every rank, forwarded around the ring in pieces.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(DistError::Invalid(format!(
                "broadcast from rank {root} in a group of {}",
                self.world_size
            )));
        }
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let forwards = self.next_rank() != root;
        for piece in bytes.chunks_mut(BROADCAST_PIECE_BYTES) {
            if self.rank != root {
                (&self.prev)
                    .read_exact(piece)
                    .map_err(|e| self.recv_error(e))?;
            }
            if forwards {
                (&self.next)
                    .write_all(piece)
                    .map_err(|e| self.send_error(e))?;
            }
        }
        Ok(())
    }

    /// Every rank's `mine` (any length), in rank order.
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let w = self.world_size;
        let mut all = vec![Vec::new(); w];
        all[self.rank] = mine.to_vec();
        for step in 0..w - 1 {
            let send = (self.rank + w - step) % w;
            let recv = (self.rank + 2 * w - step - 1) % w;
            let message = [&(all[send].len() as u64).to_le_bytes()[..], &all[send]].concat();
            all[recv] = std::thread::scope(|scope| {
                let sender = scope.spawn(|| (&self.next).write_all(&message));
                let received = read_message(&self.prev);
                let sent = sender
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("sender panicked")));
                sent.map_err(|e| self.send_error(e))?;
                received.map_err(|e| self.recv_error(e))
            })?;
        }
        Ok(all)
    }

    /// Sends `send` to the next rank while receiving `recv` from the previous one: both at
    /// once, or a ring of ranks all sending more than their socket buffers would deadlock.
    fn exchange(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| (&self.next).write_all(send));
            let received = (&self.prev).read_exact(recv);
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("sender panicked")));
            received.map_err(|e| self.recv_error(e))?;
            sent.map_err(|e| self.send_error(e))
        })
    }

    fn recv_error(&self, e: io::Error) -> DistError {
        DistError::Peer {
            rank: self.rank,
            peer: self.prev_rank(),
            addr: self.prev_addr.clone(),
            what: "receiving from".into(),
            source: explain(e, self.prev_rank()),
        }
    }

    fn send_error(&self, e: io::Error) -> DistError {
        DistError::Peer {
            rank: self.rank,
            peer: self.next_rank(),
            addr: self.next_addr.clone(),
            what: "sending to".into(),
            source: explain(e, self.next_rank()),
        }
    }
}

/// The elements of `buf` (length `n`) that rank `i` of `w` owns in reduce-scatter and
/// all-gather: as equal as integers allow.
pub fn chunk(i: usize, n: usize, w: usize) -> Range<usize> {
    i * n / w..(i + 1) * n / w
}

/// Two non-overlapping chunks of one buffer (either may be empty), one to read and one to
/// write.
fn disjoint<T>(buf: &mut [T], send: Range<usize>, recv: Range<usize>) -> (&[T], &mut [T]) {
    if send.end <= recv.start {
        let (head, tail) = buf.split_at_mut(recv.start);
        (&head[send], &mut tail[..recv.len()])
    } else {
        let (head, tail) = buf.split_at_mut(send.start);
        (&tail[..send.len()], &mut head[recv])
    }
}

fn read_message(mut from: &TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    from.read_exact(&mut len)?;
    let mut message = vec![0u8; u64::from_le_bytes(len) as usize];
    from.read_exact(&mut message)?;
    Ok(message)
}

/// What a failed socket operation most likely means, in a cluster user's words.
fn explain(e: io::Error, peer: usize) -> io::Error {
    let hint = match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted => {
            format!("connection closed ({e}): rank {peer} exited or crashed; its log says why")
        }
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "no progress within the group's timeout ({e}): rank {peer} is stuck or far behind \
             (OXRL_DIST_TIMEOUT sets the timeout in seconds)"
        ),
        _ => return e,
    };
    io::Error::new(e.kind(), hint)
}

/// The address this rank's peers can reach it on: `OXRL_DIST_HOST` if set, else the interface
/// this host reaches the store through (unless that is loopback while others are remote).
fn advertised_ip(rendezvous: &Rendezvous) -> Result<String> {
    if let Ok(host) = std::env::var("OXRL_DIST_HOST") {
        if !host.trim().is_empty() {
            return Ok(host.trim().to_string());
        }
    }
    Ok(rendezvous.local_ip()?.to_string())
}

fn connect_until(addr: &str, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() < deadline && e.kind() == io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

fn accept_until(listener: &TcpListener, deadline: Instant) -> io::Result<(TcpStream, String)> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                stream.set_nonblocking(false)?;
                return Ok((stream, from.to_string()));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no connection before the timeout",
                ))
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_once() {
        for (n, w) in [(10, 3), (2, 4), (0, 2), (12, 4)] {
            let covered: Vec<usize> = (0..w).flat_map(|i| chunk(i, n, w)).collect();
            assert_eq!(covered, (0..n).collect::<Vec<_>>(), "n {n} w {w}");
        }
    }

    #[test]
    fn disjoint_chunks_borrow_both_ways() {
        let mut buf = [0, 1, 2, 3, 4, 5];
        let (send, recv) = disjoint(&mut buf, 0..2, 4..6);
        assert_eq!(send, &[0, 1]);
        recv.copy_from_slice(&[9, 9]);
        let (send, recv) = disjoint(&mut buf, 4..6, 2..4);
        assert_eq!(send, &[9, 9]);
        assert_eq!(recv, &[2, 3]);
        // Fewer elements than ranks: empty chunks share a start with their neighbour.
        let (send, recv) = disjoint(&mut buf, 0..0, 0..1);
        assert!(send.is_empty());
        assert_eq!(recv, &[0]);
        let (send, recv) = disjoint(&mut buf, 0..1, 1..1);
        assert_eq!((send, recv.len()), (&[0][..], 0));
    }
}
