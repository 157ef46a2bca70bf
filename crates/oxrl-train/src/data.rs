//! Prompt datasets: JSONL or Parquet rows whose prompt column is a string or chat messages,
//! rendered with the policy's chat template, and a seeded per-epoch order that a checkpoint can
//! resume.

use crate::config::DataConfig;
pub use crate::error::DataError;
use oxrl_models::image::prompt_image_sources;
use oxrl_models::{ImagePrompting, ProcessedImage, Tokenizer};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::Path;
use std::sync::Arc;

/// One prompt of the dataset, ready for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRow {
    /// The row's `uid` or `id` column, else `<file>:<line>`.
    pub uid: String,
    /// Where the row came from (`<file>:<line>`, or `<file>:row N` for Parquet), for errors.
    pub at: String,
    pub prompt_ids: Vec<u32>,
    /// The rendered prompt text (what reward functions see as the prompt).
    pub prompt_text: String,
    /// Every column of the row (the ground truth among them).
    pub row: Map<String, Value>,
    /// The prompt's images, processed, in the order of their tokens (Qwen3-VL).
    pub images: Vec<Arc<ProcessedImage>>,
    /// Where each image came from, as a path or `data:` URL (what rollout files record).
    pub image_refs: Vec<String>,
}

/// The chat messages of a prompt cell: a string becomes one user message. With `images` images
/// from the image column, a string's `<image>` markers (verl's convention) become image items
/// in place, or the images go before the text when it has none.
fn messages_of(cell: &Value, images: usize) -> Option<Value> {
    use serde_json::json;
    match cell {
        Value::String(s) if images == 0 => Some(json!([{"role": "user", "content": s}])),
        Value::String(s) => {
            let mut content = Vec::new();
            let parts: Vec<&str> = s.split("<image>").collect();
            if parts.len() == 1 {
                content.extend((0..images).map(|_| json!({"type": "image"})));
            }
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    content.push(json!({"type": "image"}));
                }
                if !part.is_empty() {
                    content.push(json!({"type": "text", "text": part}));
                }
            }
            Some(json!([{"role": "user", "content": content}]))
        }
        Value::Array(_) => Some(cell.clone()),
        _ => None,
    }
}

/// One row of a dataset file: where it is (`file:line`, or `file:row N` for Parquet) and its
/// columns.
pub struct Row {
    pub at: String,
    pub columns: Map<String, Value>,
}

/// Every row of a JSONL file, or of a Parquet file (`.parquet`), as JSON objects.
pub fn read_rows(file: &Path) -> Result<Vec<Row>, DataError> {
    let is_parquet = file
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
    if is_parquet {
        return read_parquet(file);
    }
    let text = std::fs::read_to_string(file).map_err(|source| DataError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    parse_jsonl(&text, &file.display().to_string())
}

/// The rows of JSONL `text` (from the file named `name`): one JSON object per non-blank line.
pub fn parse_jsonl(text: &str, name: &str) -> Result<Vec<Row>, DataError> {
    let mut rows = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let at = format!("{name}:{}", i + 1);
        let columns = match serde_json::from_str(raw) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(DataError::row(at, "expected a JSON object")),
            Err(e) => return Err(DataError::row(at, format!("invalid JSON: {e}"))),
        };
        rows.push(Row { at, columns });
    }
    Ok(rows)
}

/// Parquet rows through Arrow, each converted to a JSON object (lists and structs nest, as the
/// `messages` column of chat datasets does).
fn read_parquet(file: &Path) -> Result<Vec<Row>, DataError> {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let err = |e: &dyn std::fmt::Display| DataError::row(file.display().to_string(), e);
    let f = std::fs::File::open(file).map_err(|source| DataError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(f)
        .map_err(|e| err(&e))?
        .build()
        .map_err(|e| err(&e))?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| err(&e))?;
        let mut buf = Vec::new();
        let mut writer = arrow_json::ArrayWriter::new(&mut buf);
        writer.write_batches(&[&batch]).map_err(|e| err(&e))?;
        writer.finish().map_err(|e| err(&e))?;
        let objects: Vec<Map<String, Value>> = match buf.is_empty() {
            true => Vec::new(),
            false => serde_json::from_slice(&buf).map_err(|e| err(&e))?,
        };
        for columns in objects {
            rows.push(Row {
                at: format!("{}:row {}", file.display(), rows.len() + 1),
                columns,
            });
        }
    }
    Ok(rows)
}

/// Reads every file, renders and tokenizes each prompt (with its images, for a policy that takes
/// them: `image_prompting`), and drops (or refuses) prompts longer than `max_prompt_length`
/// tokens. Returns the rows and how many were dropped.
pub fn load_prompts(
    files: &[impl AsRef<Path>],
    cfg: &DataConfig,
    tok: &Tokenizer,
    image_prompting: Option<&ImagePrompting>,
) -> Result<(Vec<PromptRow>, usize), DataError> {
    let mut rows = Vec::new();
    let mut dropped = 0;
    let mut kwargs = Map::new();
    if let Some(t) = cfg.enable_thinking {
        kwargs.insert("enable_thinking".into(), Value::Bool(t));
    }
    for file in files {
        let base = file.as_ref().parent().unwrap_or(Path::new("."));
        for Row { at, columns: row } in read_rows(file.as_ref())? {
            let cell = row.get(&cfg.prompt_key).ok_or_else(|| {
                DataError::row(
                    &at,
                    format!("no `{}` column (data.prompt_key)", cfg.prompt_key),
                )
            })?;
            let sources = prompt_image_sources(row.get(&cfg.image_key), Some(cell), base)
                .map_err(|e| DataError::row(&at, e))?;
            let images = ImagePrompting::prepare_with(image_prompting, &sources)
                .map_err(|e| DataError::row(&at, e))?;
            let listed = row.get(&cfg.image_key).is_some_and(|v| !v.is_null());
            let messages =
                messages_of(cell, if listed { images.len() } else { 0 }).ok_or_else(|| {
                    DataError::row(
                        &at,
                        format!(
                            "`{}` must be a string or a list of chat messages",
                            cfg.prompt_key
                        ),
                    )
                })?;
            let prompt_text = match (tok.has_chat_template(), cell) {
                (true, _) => tok.apply_chat_template(&messages, true, &kwargs),
                (false, Value::String(s)) => Ok(s.clone()),
                (false, _) => {
                    return Err(DataError::row(
                        &at,
                        "chat messages need a chat template, and the tokenizer has none",
                    ))
                }
            }
            .map_err(|e| DataError::row(&at, e))?;
            let mut prompt_ids = tok
                .encode(&prompt_text)
                .map_err(|e| DataError::row(&at, e))?;
            if let (Some(p), false) = (image_prompting, images.is_empty()) {
                prompt_ids = p
                    .expand(&prompt_ids, &images)
                    .map_err(|e| DataError::row(&at, e))?;
            }
            if prompt_ids.len() > cfg.max_prompt_length {
                if cfg.filter_overlong {
                    dropped += 1;
                    continue;
                }
                return Err(DataError::row(
                    &at,
                    format!(
                        "the prompt has {} tokens, more than data.max_prompt_length = {}",
                        prompt_ids.len(),
                        cfg.max_prompt_length
                    ),
                ));
            }
            let uid = match row.get("uid").or_else(|| row.get("id")) {
                Some(Value::String(s)) => s.clone(),
                Some(v @ Value::Number(_)) => v.to_string(),
                _ => at.clone(),
            };
            rows.push(PromptRow {
                uid,
                at,
                prompt_ids,
                prompt_text,
                row,
                images,
                image_refs: sources.iter().map(|s| s.to_reference()).collect(),
            });
        }
    }
    if rows.is_empty() {
        let names: Vec<String> = files
            .iter()
            .map(|f| f.as_ref().display().to_string())
            .collect();
        return Err(DataError::row(
            names.join(", "),
            "the dataset has no usable prompts",
        ));
    }
    Ok((rows, dropped))
}

/// Where the run is in its data: the epoch and the position within that epoch's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    pub epoch: u64,
    pub position: usize,
}

/// A permutation of the rows per epoch, from the run's seed and the epoch number, so a resumed
/// run sees exactly the rows an uninterrupted one would.
pub struct DataOrder {
    len: usize,
    seed: u64,
    shuffle: bool,
    pub cursor: DataCursor,
    order: Vec<usize>,
}

impl DataOrder {
    pub fn new(len: usize, seed: u64, shuffle: bool, cursor: DataCursor) -> Self {
        let mut o = Self {
            len,
            seed,
            shuffle,
            cursor,
            order: Vec::new(),
        };
        o.order = o.permutation(cursor.epoch);
        o
    }

    fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
            rng.set_stream(epoch);
            order.shuffle(&mut rng);
        }
        order
    }

    /// The next `n` row indices, moving into the next epoch when this one runs out.
    pub fn next_batch(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.cursor.position >= self.len {
                self.cursor = DataCursor {
                    epoch: self.cursor.epoch + 1,
                    position: 0,
                };
                self.order = self.permutation(self.cursor.epoch);
            }
            out.push(self.order[self.cursor.position]);
            self.cursor.position += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_a_seeded_permutation_per_epoch_and_resumes_exactly() {
        let mut a = DataOrder::new(
            5,
            7,
            true,
            DataCursor {
                epoch: 0,
                position: 0,
            },
        );
        let first: Vec<usize> = a.next_batch(5);
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2, 3, 4]);
        let second = a.next_batch(5);
        assert_ne!(first, second, "each epoch has its own order");
        let mut whole = DataOrder::new(
            5,
            7,
            true,
            DataCursor {
                epoch: 0,
                position: 0,
            },
        );
        let ab: Vec<usize> = (0..4).flat_map(|_| whole.next_batch(3)).collect();
        let mut part = DataOrder::new(
            5,
            7,
            true,
            DataCursor {
                epoch: 0,
                position: 0,
            },
        );
        let mut got: Vec<usize> = (0..2).flat_map(|_| part.next_batch(3)).collect();
        let mut resumed = DataOrder::new(5, 7, true, part.cursor);
        got.extend((0..2).flat_map(|_| resumed.next_batch(3)));
        assert_eq!(got, ab);
    }

    #[test]
    fn unshuffled_order_is_file_order() {
        let mut o = DataOrder::new(
            3,
            1,
            false,
            DataCursor {
                epoch: 0,
                position: 0,
            },
        );
        assert_eq!(o.next_batch(4), vec![0, 1, 2, 0]);
    }
}
