//! Where the ranks of a group meet before they can talk to each other: a TCPStore on
//! `MASTER_ADDR:MASTER_PORT`. torchrun's agent serves one already (`agent_store`); for every
//! other launcher rank 0 serves oxrl's own. Ranks then publish what the others need (ring
//! addresses, the NCCL unique id) under keys of this attempt.

use crate::env::DistEnv;
use crate::error::{DistError, Result};
use crate::store::StoreClient;
use crate::store_server::StoreServer;
use std::net::IpAddr;
use std::time::Duration;

/// Who serves the store this group met through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreHost {
    /// torchrun's agent.
    TorchrunAgent,
    /// oxrl's store, served by rank 0.
    Rank0,
}

impl std::fmt::Display for StoreHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StoreHost::TorchrunAgent => "torchrun's agent",
            StoreHost::Rank0 => "rank 0",
        })
    }
}

/// A rank's connection to the group's store.
pub struct Rendezvous {
    store: StoreClient,
    /// Rank 0's server, alive as long as the rendezvous is.
    _server: Option<StoreServer>,
    host: StoreHost,
    prefix: String,
    rank: usize,
    world_size: usize,
}

impl Rendezvous {
    /// Joins the group's store (rank 0 first serves it unless torchrun's agent does);
    /// `timeout` bounds connecting and every wait for another rank.
    pub fn join(env: &DistEnv, timeout: Duration) -> Result<Self> {
        let (server, host) = if env.agent_store {
            (None, StoreHost::TorchrunAgent)
        } else if env.is_main() {
            let server = StoreServer::bind("0.0.0.0", env.master_port).map_err(|source| {
                DistError::Store {
                    addr: format!("0.0.0.0:{}", env.master_port),
                    what: "rank 0 serving the rendezvous store on MASTER_PORT (is another job \
                           using that port? set MASTER_PORT)"
                        .into(),
                    source,
                }
            })?;
            (Some(server), StoreHost::Rank0)
        } else {
            (None, StoreHost::Rank0)
        };
        let store = StoreClient::connect(&env.master_addr, env.master_port, timeout)?;
        Ok(Rendezvous {
            store,
            _server: server,
            host,
            prefix: format!("oxrl/{}/", env.attempt),
            rank: env.rank,
            world_size: env.world_size,
        })
    }

    pub fn host(&self) -> StoreHost {
        self.host
    }

    pub fn addr(&self) -> &str {
        self.store.addr()
    }

    /// This host's address as the store sees it: the interface peers can reach.
    pub fn local_ip(&self) -> Result<IpAddr> {
        self.store.local_ip()
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.key(key);
        self.store.set(&key, value)
    }

    /// A key some rank sets, waiting for it.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        let key = self.key(key);
        self.store.get(&key)
    }

    /// Every rank's `mine` for `name`, in rank order.
    pub fn all_gather(&mut self, name: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.set(&format!("{name}/{}", self.rank), mine)?;
        (0..self.world_size)
            .map(|rank| self.get(&format!("{name}/{rank}")))
            .collect()
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
}
