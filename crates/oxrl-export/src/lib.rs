//! Checkpoints for local and edge deployment, written from a Hugging Face checkpoint one tensor
//! at a time: [`gguf`] (one file for llama.cpp and what is built on it) and [`onnx`] (a decoder
//! graph with KV-cache inputs and outputs for onnxruntime, in the layout optimum and
//! onnxruntime-genai use, and Qwen3-VL's vision tower as a second graph).

mod decoder;
pub mod error;
pub mod gguf;
pub mod onnx;
pub mod tensors;

pub use error::{ExportError, Result};

use error::io_err;
use std::fs::File;
use std::path::{Path, PathBuf};

/// `out`'s parent (created) and a hidden sibling name for work in progress.
fn staging(out: &Path) -> Result<(PathBuf, PathBuf)> {
    let name = out
        .file_name()
        .ok_or_else(|| ExportError::Unsupported(format!("{}: not a file name", out.display())))?
        .to_string_lossy()
        .to_string();
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    std::fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    let tmp = parent.join(format!(".{name}.partial-{}", std::process::id()));
    Ok((parent, tmp))
}

/// Writes the file `out` atomically: `write` fills a hidden sibling, which is fsynced and only
/// then renamed to `out`, so a crash or Ctrl-C never leaves a half-written file under the final
/// name (nor destroys a previous one). A failed write removes what it wrote.
pub fn write_file_atomically<T>(
    out: &Path,
    write: &mut dyn FnMut(&mut File) -> Result<T>,
) -> Result<T> {
    let (parent, tmp) = staging(out)?;
    let result = File::create(&tmp)
        .map_err(io_err(&tmp))
        .and_then(|mut f| {
            let value = write(&mut f)?;
            f.sync_all().map_err(io_err(&tmp))?;
            Ok(value)
        })
        .and_then(|value| {
            std::fs::rename(&tmp, out).map_err(io_err(out))?;
            Ok(value)
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    let value = result?;
    File::open(&parent)
        .and_then(|f| f.sync_all())
        .map_err(io_err(&parent))?;
    Ok(value)
}

/// Writes the directory `out` atomically, as [`write_file_atomically`] writes a file: `write`
/// fills a hidden sibling directory (and fsyncs its files), which replaces `out` at the end.
pub fn write_dir_atomically<T>(out: &Path, write: &mut dyn FnMut(&Path) -> Result<T>) -> Result<T> {
    let (parent, tmp) = staging(out)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let value = match write(&tmp) {
        Ok(value) => value,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out.exists() {
        let old = parent.join(format!(
            ".{}.old-{}",
            out.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        std::fs::rename(out, &old).map_err(io_err(out))?;
        std::fs::rename(&tmp, out).map_err(io_err(out))?;
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    } else {
        std::fs::rename(&tmp, out).map_err(io_err(out))?;
    }
    File::open(&parent)
        .and_then(|f| f.sync_all())
        .map_err(io_err(&parent))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_failed_write_keeps_the_previous_file_and_leaves_nothing_beside_it() {
        let dir = std::env::temp_dir().join(format!("oxrl-export-atomic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("model.gguf");
        write_file_atomically(&out, &mut |f| {
            f.write_all(b"first").unwrap();
            Ok(())
        })
        .unwrap();
        let failed: Result<()> = write_file_atomically(&out, &mut |f| {
            f.write_all(b"half of the second").unwrap();
            Err(ExportError::Unsupported("interrupted".into()))
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(&out).unwrap(), b"first");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);

        let out_dir = dir.join("onnx");
        let failed: Result<()> = write_dir_atomically(&out_dir, &mut |tmp| {
            std::fs::write(tmp.join("model.onnx"), b"half").unwrap();
            Err(ExportError::Unsupported("interrupted".into()))
        });
        assert!(failed.is_err());
        assert!(!out_dir.exists());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
