//! Output files written whole or not at all: lines go to a temporary sibling that is renamed over
//! the target only after the last one, so a failure or Ctrl-C never leaves a half-written file.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

/// Writes `lines` (one JSON value each) to `path`, or to stdout when `path` is `None`.
pub fn write_jsonl(path: Option<&Path>, lines: &[serde_json::Value]) -> Result<()> {
    let mut text = String::new();
    for line in lines {
        text.push_str(&serde_json::to_string(line)?);
        text.push('\n');
    }
    let Some(path) = path else {
        std::io::stdout().write_all(text.as_bytes())?;
        return Ok(());
    };
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
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.with_context(|| format!("writing {}", path.display()))
}
