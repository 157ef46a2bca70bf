//! How a run ended, and that ending in one line for people.

use crate::Limits;
use std::time::Duration;

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The program exited with this status.
    Code(i32),
    /// The program was killed by this signal.
    Signal(i32),
    /// It used up its CPU time and was killed.
    CpuLimit,
    /// It ran past the wall-clock timeout and was killed.
    Timeout,
    /// Its processes together held more than `memory_mb` resident and it was killed.
    MemoryLimit,
    /// It wrote more than `output_bytes` to stdout or stderr and was killed.
    OutputLimit,
    /// The run's supervisor was killed before it could report (only without a PID namespace).
    Lost,
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub exit: Exit,
    /// At most `output_bytes` of each stream.
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub wall: Duration,
    /// CPU time of the program (and of the children it waited for).
    pub cpu: Duration,
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGSYS => "SIGSYS",
        _ => "signal",
    }
}

impl RunOutcome {
    pub fn success(&self) -> bool {
        self.exit == Exit::Code(0)
    }

    /// Why the run failed, in one line (`None` when it exited with 0): the limit it hit, or the
    /// exit status with the last line of stderr (a Python traceback's exception).
    pub fn failure_reason(&self, limits: &Limits) -> Option<String> {
        let last_line = || {
            let text = String::from_utf8_lossy(&self.stderr);
            let line = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim();
            let mut line = line.to_string();
            if line.len() > 200 {
                let cut = (0..=200).rev().find(|&i| line.is_char_boundary(i));
                line.truncate(cut.unwrap_or(0));
                line.push('…');
            }
            line
        };
        Some(match self.exit {
            Exit::Code(0) => return None,
            Exit::Code(c) => match last_line() {
                l if l.is_empty() => format!("exit status {c}"),
                l => format!("exit status {c}: {l}"),
            },
            Exit::Signal(s) => format!("killed by signal {s} ({})", signal_name(s)),
            Exit::CpuLimit => format!("CPU time limit ({} s)", limits.cpu_s),
            Exit::Timeout => format!(
                "timed out after {:.1} s (wall clock)",
                limits.timeout.as_secs_f64()
            ),
            Exit::OutputLimit => format!("output over {} bytes", limits.output_bytes),
            Exit::MemoryLimit => format!("memory limit ({} MiB for the run)", limits.memory_mb),
            Exit::Lost => "the run's supervisor was killed".to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_reasons_name_the_limit_or_the_error() {
        let limits = Limits::default();
        let outcome = |exit, stderr: &str| RunOutcome {
            exit,
            stdout: Vec::new(),
            stderr: stderr.as_bytes().to_vec(),
            wall: Duration::ZERO,
            cpu: Duration::ZERO,
        };
        let reason = |o: RunOutcome| o.failure_reason(&limits);
        assert_eq!(reason(outcome(Exit::Code(0), "warning")), None);
        assert_eq!(
            reason(outcome(
                Exit::Code(1),
                "Traceback\n  x\nValueError: bad\n\n"
            ))
            .unwrap(),
            "exit status 1: ValueError: bad"
        );
        assert_eq!(reason(outcome(Exit::Code(2), "")).unwrap(), "exit status 2");
        assert_eq!(
            reason(outcome(Exit::Timeout, "")).unwrap(),
            "timed out after 5.0 s (wall clock)"
        );
        assert_eq!(
            reason(outcome(Exit::CpuLimit, "")).unwrap(),
            "CPU time limit (5 s)"
        );
        assert_eq!(
            reason(outcome(Exit::Signal(11), "")).unwrap(),
            "killed by signal 11 (SIGSEGV)"
        );
        assert_eq!(
            reason(outcome(Exit::OutputLimit, "")).unwrap(),
            "output over 65536 bytes"
        );
    }
}
