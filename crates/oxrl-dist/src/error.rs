//! The errors of oxrl-dist. Every message names what it was doing and with whom (the variable,
//! the store's address, the peer rank), because a cluster user reads it in one rank's log.

/// A failure of the process group: its environment, its rendezvous or a collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A launcher variable that is present but unusable.
    #[error("environment variable {var}={value:?}: {expected}")]
    Env {
        var: String,
        value: String,
        expected: String,
    },
    /// Talking to the rendezvous store failed.
    #[error("rendezvous store {addr}: {what}: {source}")]
    Store {
        addr: String,
        what: String,
        source: std::io::Error,
    },
    /// The store answered something torch's TCPStore protocol does not allow.
    #[error("rendezvous store {addr}: {what}")]
    Protocol { addr: String, what: String },
    /// Sending to or receiving from another rank failed: it exited, crashed or timed out.
    #[error("rank {rank}: {what} rank {peer} ({addr}): {source}")]
    Peer {
        rank: usize,
        peer: usize,
        addr: String,
        what: String,
        source: std::io::Error,
    },
    /// A collective called with arguments the group cannot use.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, DistError>;
