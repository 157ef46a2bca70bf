//! What a run may use: time, memory, files, processes and output.

use std::time::Duration;

/// Limits of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Wall clock, from spawn to exit; past it the run's process group is killed.
    pub timeout: Duration,
    /// CPU seconds per process, all its threads together (RLIMIT_CPU, soft = hard: SIGKILL
    /// when used up).
    pub cpu_s: u64,
    /// Memory in MiB: the address space of each process (RLIMIT_AS), and the resident memory of
    /// all the run's processes together (summed by the parent every 20 ms; over it, the run is
    /// killed). The scratch tmpfs is bounded by `scratch_mb` on top.
    pub memory_mb: u64,
    /// Largest file a process may write, in MiB (RLIMIT_FSIZE).
    pub file_size_mb: u64,
    /// Processes and threads of the run (RLIMIT_NPROC, counted in the run's user namespace).
    pub max_processes: u64,
    /// Open file descriptors per process (RLIMIT_NOFILE).
    pub max_open_files: u64,
    /// Bytes kept of stdout and of stderr each; more kills the run.
    pub output_bytes: usize,
    /// Size of the writable tmpfs scratch directory in MiB (where mounts are allowed).
    pub scratch_mb: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            cpu_s: 5,
            memory_mb: 1024,
            file_size_mb: 16,
            max_processes: 32,
            max_open_files: 64,
            output_bytes: 1 << 16,
            scratch_mb: 64,
        }
    }
}
