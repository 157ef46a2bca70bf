//! What the commands print and write. Output files are written whole or not at all: lines go to a
//! temporary sibling that is renamed over the target only after the last one, so a failure or
//! Ctrl-C never leaves a half-written file. Stdout is written with errors returned, never
//! panicked on: a closed pipe (`| head`) ends the command quietly (exit 141, as `SIGPIPE` would),
//! a full device is an `error:` line.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::Path;

/// Writes `text` to stdout and flushes it, so a write error surfaces here and not in a
/// destructor that drops it.
pub fn print_text(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .context("writing to stdout")
}

/// `println!` that returns the write error (see [`print_text`]) instead of panicking.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::print_text(&format!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use say;

/// Rows as text columns, each padded to its widest cell (the first row is the header).
pub fn table(rows: &[Vec<String>]) -> String {
    let Some(first) = rows.first() else {
        return String::new();
    };
    let widths: Vec<usize> = (0..first.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            let cells: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            format!("{}\n", cells.join("  ").trim_end())
        })
        .collect()
}

/// True when `error` comes from writing to a pipe whose reader has gone.
pub fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Writes `lines` (one JSON value each) to `path`, or to stdout when `path` is `None`.
pub fn write_jsonl(path: Option<&Path>, lines: &[serde_json::Value]) -> Result<()> {
    let mut text = String::new();
    for line in lines {
        text.push_str(&serde_json::to_string(line)?);
        text.push('\n');
    }
    let Some(path) = path else {
        return print_text(&text);
    };
    match destination(path)? {
        Destination::Replace(target) => write_atomically(&target, text.as_bytes()),
        Destination::Stream => std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .with_context(|| format!("writing {}", path.display())),
    }
}

/// How an output path is written.
enum Destination {
    /// A regular file (or nothing yet) at this path, replaced whole.
    Replace(std::path::PathBuf),
    /// A device, FIFO or socket (`/dev/stdout`, `/dev/null`, a named pipe): written into,
    /// never replaced by a regular file.
    Stream,
}

/// Where writing `path` goes: through symlinks to what they name, so a link stays a link and
/// a device stays a device.
fn destination(path: &Path) -> Result<Destination> {
    let Ok(meta) = std::fs::metadata(path) else {
        if std::fs::symlink_metadata(path).is_ok() {
            bail!("{}: a symbolic link to nothing", path.display());
        }
        return Ok(Destination::Replace(path.to_path_buf()));
    };
    if meta.is_dir() {
        bail!("{}: is a directory, not a file to write", path.display());
    }
    if !meta.is_file() {
        return Ok(Destination::Stream);
    }
    let linked = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    match linked {
        false => Ok(Destination::Replace(path.to_path_buf())),
        // A link into /proc (`/dev/stdout` redirected to a file) has no real path: write into it.
        true => Ok(std::fs::canonicalize(path).map_or(Destination::Stream, Destination::Replace)),
    }
}

/// Writes `bytes` to a temporary sibling of `path`, syncs it and renames it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file name", path.display()))?;
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.with_context(|| format!("writing {}", path.display()))
}
