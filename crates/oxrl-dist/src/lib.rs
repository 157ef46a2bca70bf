//! Multi-process training's plumbing, with no scheduler of its own: the launcher a cluster
//! already has (torchrun, srun, a Kubeflow PyTorchJob, mpirun, Ray) decides which process is
//! which rank; [`DistEnv`] reads that; [`Rendezvous`] meets the other ranks through torch's
//! TCPStore (torchrun's agent's, or one rank 0 serves); a [`Collective`] then moves tensors:
//! the [`TcpRing`] between CPU processes, NCCL between GPUs.

mod collective;
mod env;
mod error;
mod hostlist;
#[cfg(feature = "cuda")]
mod nccl;
mod rendezvous;
mod ring;
mod store;
mod store_server;
mod wire;

pub use collective::{Collective, Solo};
pub use env::{DistEnv, Launcher, DEFAULT_MASTER_PORT};
pub use error::{DistError, Result};
#[cfg(feature = "cuda")]
pub use nccl::NcclCollective;
pub use rendezvous::{Rendezvous, StoreHost};
pub use ring::{chunk, Element, TcpRing};
pub use store::StoreClient;
pub use store_server::StoreServer;

use std::sync::Arc;
use std::time::Duration;

/// How long a rank waits for another before giving up, unless `OXRL_DIST_TIMEOUT` (seconds)
/// says otherwise: torch's default for its CPU backend, 30 minutes. A rank that exits or
/// crashes closes its sockets, so its peers fail at once, not after this.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The group's timeout: `OXRL_DIST_TIMEOUT` in seconds, or [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var("OXRL_DIST_TIMEOUT") {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(value) => value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or(DistError::Env {
                var: "OXRL_DIST_TIMEOUT".into(),
                value,
                expected: "a positive number of seconds".into(),
            }),
    }
}

/// This process's membership in its group: where it is, how it met the others, and the
/// collectives it shares with them.
pub struct ProcessGroup {
    env: DistEnv,
    /// Kept for the group's lifetime: rank 0's store serves the others' later look-ups.
    rendezvous: Option<Rendezvous>,
    collective: Arc<dyn Collective>,
}

impl ProcessGroup {
    /// Joins the group `env` describes over the CPU transport (a group of one needs none).
    pub fn join_cpu(env: DistEnv, timeout: Duration) -> Result<Self> {
        if env.world_size == 1 {
            return Ok(ProcessGroup {
                env,
                rendezvous: None,
                collective: Arc::new(Solo),
            });
        }
        let mut rendezvous = Rendezvous::join(&env, timeout)?;
        let ring = TcpRing::connect(&mut rendezvous, env.rank, env.world_size, timeout)?;
        Ok(ProcessGroup {
            env,
            rendezvous: Some(rendezvous),
            collective: Arc::new(ring),
        })
    }

    /// Joins the group `env` describes with NCCL between the ranks' GPUs (`device` is this
    /// rank's), and the TCP ring beside it for host messages. A group of one builds a
    /// communicator too (`oxrl dist-check --device cuda` checks NCCL on one GPU that way).
    #[cfg(feature = "cuda")]
    pub fn join_gpu(env: DistEnv, device: &candle_core::Device, timeout: Duration) -> Result<Self> {
        let mut rendezvous = Rendezvous::join(&env, timeout)?;
        let ring = TcpRing::connect(&mut rendezvous, env.rank, env.world_size, timeout)?;
        let nccl = NcclCollective::join(&mut rendezvous, ring, device)?;
        Ok(ProcessGroup {
            env,
            rendezvous: Some(rendezvous),
            collective: Arc::new(nccl),
        })
    }

    pub fn env(&self) -> &DistEnv {
        &self.env
    }

    pub fn collective(&self) -> Arc<dyn Collective> {
        self.collective.clone()
    }

    /// The store the group met through, if it has more than one rank.
    pub fn rendezvous(&mut self) -> Option<&mut Rendezvous> {
        self.rendezvous.as_mut()
    }
}
