//! The output directory of a run. One run writes to it at a time (an exclusive lock on
//! `.oxrl.lock`, released by the kernel when the process ends, however it ends); a fresh run
//! never mixes its files into another run's (it refuses a used directory unless asked to
//! resume); and what a killed run left half-written (`.checkpoint-N.tmp-<pid>/`, temporary
//! siblings of `metrics.jsonl` or the chart) is removed before anything else happens.

use crate::state;
use crate::update::{Result, TrainError};
use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

pub const LOCK_FILE: &str = ".oxrl.lock";

/// The copy of the run's configuration a fresh run keeps (what `oxrl compare` reads).
pub const CONFIG_COPY: &str = "config.toml";

/// An output directory this process holds for the length of a run.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    /// Held, not read: the lock lasts as long as this handle.
    _lock: File,
    /// The newest complete checkpoint, `(step, dir)`, when resuming.
    pub resumed: Option<(u64, PathBuf)>,
}

impl RunDir {
    /// Keeps the configuration the run started from (`config.toml`, written atomically), so
    /// the run directory says how it was made. Relative paths in it stay relative to the
    /// original file's directory.
    pub fn keep_config(&self, text: &str) -> Result<()> {
        let target = self.path.join(CONFIG_COPY);
        let tmp = self.path.join(format!(".{CONFIG_COPY}.tmp"));
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &target))
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", target.display())))
    }

    /// Creates and locks `path`. With `resume`, finds the newest complete checkpoint (none is a
    /// fresh start); without, fails if `path` already holds a run's checkpoints or metrics.
    pub fn open(path: &Path, resume: bool) -> Result<Self> {
        let io = |source: std::io::Error, at: &Path| {
            TrainError::Invalid(format!("{}: {source}", at.display()))
        };
        std::fs::create_dir_all(path).map_err(|e| io(e, path))?;
        let lock_path = path.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io(e, &lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(TrainError::Invalid(format!(
                    "{}: another oxrl run is writing to this output directory (it holds {}); \
                     wait for it to finish or choose another output_dir",
                    path.display(),
                    lock_path.display()
                )))
            }
            Err(TryLockError::Error(e)) => return Err(io(e, &lock_path)),
        }
        remove_partials(path)?;
        let resumed = match resume {
            true => state::latest(path),
            false => {
                if let Some(found) = previous_run(path) {
                    return Err(TrainError::Invalid(format!(
                        "{}: already holds a run ({found}); pass --resume to continue it, or \
                         choose another output_dir",
                        path.display()
                    )));
                }
                None
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            _lock: lock,
            resumed,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// What in `dir` shows an earlier run: a checkpoint, a non-empty metrics log, saved rollouts.
fn previous_run(dir: &Path) -> Option<String> {
    let mut checkpoints: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    checkpoints.sort();
    match checkpoints.len() {
        0 => {}
        1 => return Some(checkpoints.remove(0)),
        n => return Some(format!("{} and {} more", checkpoints[0], n - 1)),
    }
    let metrics = dir.join("metrics.jsonl");
    if std::fs::metadata(&metrics).is_ok_and(|m| m.len() > 0) {
        return Some("metrics.jsonl".into());
    }
    dir.join("rollouts").is_dir().then(|| "rollouts/".into())
}

/// Removes the temporary files and directories of writes that never finished. Only called with
/// the lock held, so no live writer owns them.
fn remove_partials(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", dir.display())))?;
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !is_partial(&name) {
            continue;
        }
        let path = entry.path();
        let removed = match entry.file_type().is_ok_and(|t| t.is_dir()) {
            true => std::fs::remove_dir_all(&path),
            false => std::fs::remove_file(&path),
        };
        removed.map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

/// The temporary names oxrl writes under before renaming: `.checkpoint-3.tmp-1234`,
/// `.checkpoint-3.old-1234` (a checkpoint being replaced), `metrics.jsonl.tmp`, `reward.svg.tmp`.
fn is_partial(name: &str) -> bool {
    let checkpoint = name.starts_with(".checkpoint-");
    (checkpoint && (name.contains(".tmp-") || name.contains(".old-"))) || name.ends_with(".tmp")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("oxrl-rundir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let d = scratch("lock");
        let first = RunDir::open(&d, false).unwrap();
        let err = RunDir::open(&d, true).unwrap_err().to_string();
        assert!(err.contains("another oxrl run"), "{err}");
        drop(first);
        RunDir::open(&d, true).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_fresh_run_refuses_a_used_directory_and_resume_takes_it() {
        let d = scratch("used");
        std::fs::create_dir_all(d.join("checkpoint-2")).unwrap();
        let err = RunDir::open(&d, false).unwrap_err().to_string();
        assert!(
            err.contains("checkpoint-2") && err.contains("--resume"),
            "{err}"
        );
        // checkpoint-2 lacks trainer_state.json: not complete, so resume starts fresh.
        assert!(RunDir::open(&d, true).unwrap().resumed.is_none());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn partial_writes_of_a_killed_run_are_removed() {
        let d = scratch("partial");
        std::fs::create_dir_all(d.join(".checkpoint-4.tmp-999/x")).unwrap();
        std::fs::write(d.join("metrics.jsonl.tmp"), "half").unwrap();
        std::fs::write(d.join("metrics.jsonl"), "").unwrap();
        RunDir::open(&d, false).unwrap();
        assert!(!d.join(".checkpoint-4.tmp-999").exists());
        assert!(!d.join("metrics.jsonl.tmp").exists());
        assert!(d.join("metrics.jsonl").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
