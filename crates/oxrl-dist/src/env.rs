//! Who this process is in the group, read from the launcher's environment: torchrun's variables
//! first (also what Ray and plain Kubernetes jobs set), then Kubeflow's `PET_*`, Slurm's and
//! OpenMPI's. oxrl never places processes itself; it reads what the cluster's launcher decided.

use crate::error::{DistError, Result};
use crate::hostlist;

/// The launcher that started this process, as told by its variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher variables: one process.
    Single,
    /// `torchrun` (torch elastic): its agent serves the store.
    Torchrun,
    /// `RANK`/`WORLD_SIZE` set by something else (Ray, a Kubernetes Job, a script).
    Env,
    /// Kubeflow's `PET_*` variables, one process per pod.
    Kubeflow,
    /// `srun`.
    Slurm,
    /// `mpirun` (OpenMPI).
    OpenMpi,
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Single => "single process",
            Launcher::Torchrun => "torchrun",
            Launcher::Env => "RANK/WORLD_SIZE",
            Launcher::Kubeflow => "kubeflow (PET_*)",
            Launcher::Slurm => "slurm",
            Launcher::OpenMpi => "openmpi",
        })
    }
}

/// The port rank 0's store listens on when nothing says otherwise (torch's default too).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// This process's place in the group and where the group meets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The rank among the processes of this node: which GPU it takes.
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub launcher: Launcher,
    /// torchrun's agent already serves a TCPStore on `master_addr:master_port`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): rank 0 must not bind that port.
    pub agent_store: bool,
    /// How many times the launcher has restarted the group (torchrun's
    /// `TORCHELASTIC_RESTART_COUNT`, Slurm's `SLURM_RESTART_COUNT`): keys of a restarted group
    /// never meet the previous attempt's in a store that outlived it.
    pub attempt: u64,
}

impl DistEnv {
    /// One process, no group.
    pub fn single() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            launcher: Launcher::Single,
            agent_store: false,
            attempt: 0,
        }
    }

    /// The group this process's environment describes.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The group that `var` (a lookup of environment variables) describes.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars = Vars(&var);
        let env = if vars.has("RANK") || vars.has("WORLD_SIZE") {
            torchrun_style(&vars)?
        } else if vars.has("PET_NNODES") {
            kubeflow(&vars)?
        } else if vars.has("SLURM_PROCID") && vars.has("SLURM_NTASKS") {
            slurm(&vars)?
        } else if vars.has("OMPI_COMM_WORLD_RANK") {
            openmpi(&vars)?
        } else {
            DistEnv::single()
        };
        env.validate()
    }

    /// Whether this is the first process of the group (the one that writes checkpoints).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    fn validate(self) -> Result<Self> {
        let names = self.names();
        if self.world_size == 0 {
            return Err(env_error(names.world, "0", "a world size of at least 1"));
        }
        if self.rank >= self.world_size {
            return Err(env_error(
                names.rank,
                &self.rank.to_string(),
                &format!(
                    "a rank below the world size {} ({})",
                    self.world_size, names.world
                ),
            ));
        }
        if self.local_rank >= self.local_world_size.max(1) {
            return Err(env_error(
                names.local_rank,
                &self.local_rank.to_string(),
                &format!(
                    "a local rank below the local world size {}",
                    self.local_world_size
                ),
            ));
        }
        Ok(self)
    }

    fn names(&self) -> Names {
        match self.launcher {
            Launcher::Slurm => Names {
                rank: "SLURM_PROCID",
                world: "SLURM_NTASKS",
                local_rank: "SLURM_LOCALID",
            },
            Launcher::OpenMpi => Names {
                rank: "OMPI_COMM_WORLD_RANK",
                world: "OMPI_COMM_WORLD_SIZE",
                local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
            },
            Launcher::Kubeflow => Names {
                rank: "PET_NODE_RANK",
                world: "PET_NNODES",
                local_rank: "PET_NODE_RANK",
            },
            _ => Names {
                rank: "RANK",
                world: "WORLD_SIZE",
                local_rank: "LOCAL_RANK",
            },
        }
    }
}

struct Names {
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
}

fn env_error(var: &str, value: &str, expected: &str) -> DistError {
    DistError::Env {
        var: var.into(),
        value: value.into(),
        expected: expected.into(),
    }
}

/// Typed reads of launcher variables; a present but malformed one is an error naming it.
struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).map(|v| v.trim().to_string())
    }

    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn number<T: std::str::FromStr>(&self, name: &str, expected: &str) -> Result<Option<T>> {
        match self.get(name) {
            None => Ok(None),
            Some(value) => value
                .parse()
                .map(Some)
                .map_err(|_| env_error(name, &value, expected)),
        }
    }

    fn count(&self, name: &str) -> Result<Option<usize>> {
        self.number(name, "a non-negative integer")
    }

    fn required_count(&self, name: &str, with: &str) -> Result<usize> {
        self.count(name)?.ok_or_else(|| DistError::Env {
            var: name.into(),
            value: String::new(),
            expected: format!("to be set alongside {with}"),
        })
    }

    fn port(&self, name: &str) -> Result<Option<u16>> {
        self.number(name, "a TCP port (1-65535)")
    }

    /// `MASTER_ADDR`/`MASTER_PORT`, required when the group has more than one process.
    fn master(&self, world_size: usize, hint: &str) -> Result<(String, u16)> {
        let addr = self.get("MASTER_ADDR");
        let port = self.port("MASTER_PORT")?;
        match addr {
            Some(addr) => Ok((addr, port.unwrap_or(DEFAULT_MASTER_PORT))),
            None if world_size == 1 => {
                Ok(("127.0.0.1".into(), port.unwrap_or(DEFAULT_MASTER_PORT)))
            }
            None => Err(DistError::Env {
                var: "MASTER_ADDR".into(),
                value: String::new(),
                expected: format!("the host rank 0 runs on, for a group of {world_size}{hint}"),
            }),
        }
    }

    fn attempt(&self, name: &str) -> Result<u64> {
        Ok(self.number(name, "a non-negative integer")?.unwrap_or(0))
    }
}

/// torchrun, Ray actors, Kubernetes Jobs: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`.
fn torchrun_style(vars: &Vars) -> Result<DistEnv> {
    let rank = vars.required_count("RANK", "WORLD_SIZE")?;
    let world_size = vars.required_count("WORLD_SIZE", "RANK")?;
    let torchrun = vars.has("TORCHELASTIC_RUN_ID") || vars.has("TORCHELASTIC_USE_AGENT_STORE");
    let (master_addr, master_port) = vars.master(world_size, "")?;
    Ok(DistEnv {
        rank,
        world_size,
        local_rank: vars.count("LOCAL_RANK")?.unwrap_or(0),
        local_world_size: vars.count("LOCAL_WORLD_SIZE")?.unwrap_or(1),
        master_addr,
        master_port,
        launcher: if torchrun {
            Launcher::Torchrun
        } else {
            Launcher::Env
        },
        agent_store: vars
            .get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true")),
        attempt: vars.attempt("TORCHELASTIC_RESTART_COUNT")?,
    })
}

/// Kubeflow's PyTorchJob / TrainJob: `PET_NNODES`, `PET_NODE_RANK`, `PET_NPROC_PER_NODE`,
/// `PET_MASTER_ADDR`, `PET_MASTER_PORT`. These are torchrun's arguments; oxrl reads them
/// directly only for one process per pod, and points to torchrun otherwise.
fn kubeflow(vars: &Vars) -> Result<DistEnv> {
    let nodes = vars.required_count("PET_NNODES", "PET_NODE_RANK")?;
    let node_rank = vars.required_count("PET_NODE_RANK", "PET_NNODES")?;
    if let Some(per_node) = vars.get("PET_NPROC_PER_NODE") {
        if per_node != "1" {
            return Err(env_error(
                "PET_NPROC_PER_NODE",
                &per_node,
                "1 when oxrl is the pod's command; for several processes per pod run \
                 `torchrun --no-python oxrl ...`, which reads the PET_* variables",
            ));
        }
    }
    let master_addr = vars
        .get("PET_MASTER_ADDR")
        .or_else(|| vars.get("MASTER_ADDR"));
    let master_addr = match master_addr {
        Some(addr) => addr,
        None if nodes == 1 => "127.0.0.1".into(),
        None => {
            return Err(env_error(
                "PET_MASTER_ADDR",
                "",
                "the host of node rank 0 (set with PET_NNODES)",
            ))
        }
    };
    let master_port = match vars.port("PET_MASTER_PORT")? {
        Some(port) => port,
        None => vars.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT),
    };
    Ok(DistEnv {
        rank: node_rank,
        world_size: nodes,
        local_rank: 0,
        local_world_size: 1,
        master_addr,
        master_port,
        launcher: Launcher::Kubeflow,
        agent_store: false,
        attempt: 0,
    })
}

/// `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, tasks per node, and the first host
/// of the step's node list as the master unless `MASTER_ADDR` says otherwise. The port, unless
/// `MASTER_PORT` is set, is derived from the job id (15000 + its last four digits, as PyTorch
/// Lightning does), so two jobs sharing a node do not collide.
fn slurm(vars: &Vars) -> Result<DistEnv> {
    let rank = vars.required_count("SLURM_PROCID", "SLURM_NTASKS")?;
    let world_size = vars.required_count("SLURM_NTASKS", "SLURM_PROCID")?;
    let local_rank = vars.count("SLURM_LOCALID")?.unwrap_or(0);
    let local_world_size = match vars.count("SLURM_NTASKS_PER_NODE") {
        Ok(Some(n)) => n,
        _ => match vars.get("SLURM_TASKS_PER_NODE") {
            Some(list) => {
                let node = vars.count("SLURM_NODEID")?.unwrap_or(0);
                hostlist::tasks_on_node(&list, node).ok_or_else(|| {
                    env_error("SLURM_TASKS_PER_NODE", &list, "a list like 8(x2),4")
                })?
            }
            None => 1,
        },
    };
    let master_addr = match vars.get("MASTER_ADDR") {
        Some(addr) => addr,
        None => {
            let (name, list) = [
                "SLURM_STEP_NODELIST",
                "SLURM_JOB_NODELIST",
                "SLURM_NODELIST",
            ]
            .iter()
            .find_map(|name| vars.get(name).map(|list| (*name, list)))
            .ok_or_else(|| {
                env_error(
                    "SLURM_JOB_NODELIST",
                    "",
                    "the job's nodes (or set MASTER_ADDR)",
                )
            })?;
            hostlist::first_host(&list)
                .ok_or_else(|| env_error(name, &list, "a Slurm host list like node[01-04]"))?
        }
    };
    let master_port = match vars.port("MASTER_PORT")? {
        Some(port) => port,
        None => match vars.number::<u64>("SLURM_JOB_ID", "an integer job id")? {
            Some(id) => 15000 + (id % 10000) as u16,
            None => DEFAULT_MASTER_PORT,
        },
    };
    Ok(DistEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        launcher: Launcher::Slurm,
        agent_store: false,
        attempt: vars.attempt("SLURM_RESTART_COUNT")?,
    })
}

/// `mpirun`: `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`; MPI has no master address,
/// so `MASTER_ADDR` must be passed (`mpirun -x MASTER_ADDR=host`).
fn openmpi(vars: &Vars) -> Result<DistEnv> {
    let rank = vars.required_count("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")?;
    let world_size = vars.required_count("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")?;
    let (master_addr, master_port) = vars.master(
        world_size,
        " (pass it with mpirun -x MASTER_ADDR=<host of rank 0>)",
    )?;
    Ok(DistEnv {
        rank,
        world_size,
        local_rank: vars.count("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
        local_world_size: vars.count("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(1),
        master_addr,
        master_port,
        launcher: Launcher::OpenMpi,
        agent_store: false,
        attempt: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> Result<DistEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_vars(|name| map.get(name).cloned())
    }

    #[test]
    fn no_launcher_is_one_process() {
        assert_eq!(env_of(&[]).unwrap(), DistEnv::single());
    }

    #[test]
    fn torchrun_uses_its_agent_store() {
        let env = env_of(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RUN_ID", "job"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ])
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (3, 8, 3, 4)
        );
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("10.0.0.5", 29400)
        );
        assert_eq!(env.launcher, Launcher::Torchrun);
        assert!(env.agent_store);
        assert_eq!(env.attempt, 2);
    }

    #[test]
    fn rank_and_world_without_torchrun_serve_their_own_store() {
        let env = env_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "head")]).unwrap();
        assert_eq!(env.launcher, Launcher::Env);
        assert!(!env.agent_store);
        assert_eq!(env.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn slurm_takes_the_first_host_and_a_port_from_the_job_id() {
        let env = env_of(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "8(x2)"),
            ("SLURM_JOB_NODELIST", "gpu-st-p5-[07-08,12],login1"),
            ("SLURM_JOB_ID", "1234567"),
            ("SLURM_RESTART_COUNT", "1"),
        ])
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (9, 16, 1, 8)
        );
        assert_eq!(env.master_addr, "gpu-st-p5-07");
        assert_eq!(env.master_port, 15000 + 4567);
        assert_eq!((env.launcher, env.attempt), (Launcher::Slurm, 1));
    }

    #[test]
    fn slurm_respects_an_explicit_master() {
        let env = env_of(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
            ("MASTER_ADDR", "n2"),
            ("MASTER_PORT", "6000"),
        ])
        .unwrap();
        assert_eq!((env.master_addr.as_str(), env.master_port), ("n2", 6000));
    }

    #[test]
    fn kubeflow_one_process_per_pod() {
        let env = env_of(&[
            ("PET_NNODES", "4"),
            ("PET_NODE_RANK", "2"),
            ("PET_NPROC_PER_NODE", "1"),
            ("PET_MASTER_ADDR", "job-master-0"),
            ("PET_MASTER_PORT", "23456"),
        ])
        .unwrap();
        assert_eq!((env.rank, env.world_size), (2, 4));
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("job-master-0", 23456)
        );
        let several = env_of(&[
            ("PET_NNODES", "2"),
            ("PET_NODE_RANK", "0"),
            ("PET_NPROC_PER_NODE", "8"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            several.contains("PET_NPROC_PER_NODE") && several.contains("torchrun"),
            "{several}"
        );
    }

    #[test]
    fn openmpi_needs_a_master_address() {
        let env = env_of(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "h0"),
        ])
        .unwrap();
        assert_eq!(
            (env.rank, env.local_rank, env.launcher),
            (1, 1, Launcher::OpenMpi)
        );
        let missing = env_of(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("MASTER_ADDR") && missing.contains("mpirun -x"),
            "{missing}"
        );
    }

    #[test]
    fn malformed_variables_are_named() {
        let bad = env_of(&[("RANK", "one"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])
            .unwrap_err()
            .to_string();
        assert!(
            bad.contains("RANK=\"one\"") && bad.contains("integer"),
            "{bad}"
        );
        let beyond = env_of(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])
            .unwrap_err()
            .to_string();
        assert!(
            beyond.contains("RANK") && beyond.contains("below the world size 2"),
            "{beyond}"
        );
        let port = env_of(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            port.contains("MASTER_PORT") && port.contains("TCP port"),
            "{port}"
        );
        let lonely = env_of(&[("RANK", "0")]).unwrap_err().to_string();
        assert!(lonely.contains("WORLD_SIZE"), "{lonely}");
        let no_master = env_of(&[("RANK", "0"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(no_master.contains("MASTER_ADDR"), "{no_master}");
    }
}
