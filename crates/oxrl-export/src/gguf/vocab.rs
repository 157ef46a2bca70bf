//! The tokenizer as GGUF metadata (`tokenizer.ggml.*`), the way llama.cpp's
//! `convert_hf_to_gguf.py` writes a byte-level BPE tokenizer: one token per id up to the
//! model's vocabulary size (ids without a token become `[PAD{id}]`, unused), token types
//! (normal, control for special added tokens, user-defined for the other added ones), the
//! merges, the special token ids and the chat template.

use super::format::MetaValue;
use crate::error::{io_err, ExportError, Result};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// llama.cpp's `llama_token_type`.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// The `tokenizer.*` metadata of the checkpoint in `dir`, with `vocab_size` tokens.
pub fn metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, MetaValue)>> {
    let path = dir.join("tokenizer.json");
    let bad = |message: String| ExportError::Checkpoint {
        path: path.clone(),
        message,
    };
    if !path.exists() {
        return Err(bad(
            "GGUF carries the tokenizer, and the checkpoint has no tokenizer.json".into(),
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let model = &json["model"];
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err(bad(format!(
            "model.type is {}; GGUF export reads byte-level BPE tokenizers (Qwen's)",
            model.get("type").unwrap_or(&Value::Null)
        )));
    }
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("model.vocab: expected an object from token to id".into()))?;
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let mut place = |token: &str, id: u64, kind: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            bad(format!(
                "token {token:?} has id {id}, outside the model's vocab_size {vocab_size}"
            ))
        })?;
        *slot = Some((token.to_string(), kind));
        Ok(())
    };
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("model.vocab[{token:?}]: expected a token id")))?;
        place(token, id, NORMAL)?;
    }
    let added = json
        .get("added_tokens")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut ids: HashMap<String, u32> = vocab
        .iter()
        .filter_map(|(t, id)| Some((t.clone(), id.as_u64()? as u32)))
        .collect();
    for token in &added {
        let (Some(content), Some(id)) = (
            token.get("content").and_then(Value::as_str),
            token.get("id").and_then(Value::as_u64),
        ) else {
            return Err(bad(format!(
                "added_tokens: {token} needs `content` and `id`"
            )));
        };
        let special = token
            .get("special")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        place(content, id, if special { CONTROL } else { USER_DEFINED })?;
        ids.insert(content.to_string(), id as u32);
    }
    let (names, types): (Vec<String>, Vec<i32>) = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| t.unwrap_or_else(|| (format!("[PAD{id}]"), UNUSED)))
        .unzip();
    let merges = merges(model).map_err(bad)?;

    let mut meta = vec![
        (
            "tokenizer.ggml.model".to_string(),
            MetaValue::Str("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            MetaValue::Str(pre_tokenizer(&json).into()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            MetaValue::ArrStr(names),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            MetaValue::ArrI32(types),
        ),
        (
            "tokenizer.ggml.merges".to_string(),
            MetaValue::ArrStr(merges),
        ),
    ];
    let config = read_optional_json(&dir.join("tokenizer_config.json"))?;
    for (key, gguf_key) in [
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("bos_token", "tokenizer.ggml.bos_token_id"),
    ] {
        let text = match config.get(key) {
            Some(Value::String(s)) => Some(s.as_str()),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str),
            _ => None,
        };
        if let Some(id) = text.and_then(|t| ids.get(t)) {
            meta.push((gguf_key.into(), MetaValue::U32(*id)));
        }
    }
    let add_bos = config.get("add_bos_token").and_then(Value::as_bool);
    meta.push((
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(add_bos.unwrap_or(false)),
    ));
    if let Some(template) = chat_template(dir, &config)? {
        meta.push(("tokenizer.chat_template".into(), MetaValue::Str(template)));
    }
    Ok(meta)
}

/// `model.merges` in GGUF's "left right" form; tokenizers writes either that or pairs.
fn merges(model: &Value) -> std::result::Result<Vec<String>, String> {
    let Some(list) = model.get("merges").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|m| match m {
            Value::String(s) => Ok(s.clone()),
            Value::Array(pair) => match (pair.first(), pair.get(1), pair.len()) {
                (Some(Value::String(a)), Some(Value::String(b)), 2) => Ok(format!("{a} {b}")),
                _ => Err(format!("model.merges: {m} is not a pair of tokens")),
            },
            _ => Err(format!("model.merges: {m} is not a merge")),
        })
        .collect()
}

/// llama.cpp's pre-tokenizer name: `gpt-2` for a lone byte-level pre-tokenizer with GPT-2's
/// regex (the demos' tokenizers), else `qwen2` (Qwen's own split regex before the bytes).
fn pre_tokenizer(json: &Value) -> &'static str {
    let pre = &json["pre_tokenizer"];
    let plain_byte_level = pre.get("type").and_then(Value::as_str) == Some("ByteLevel")
        && pre.get("use_regex").and_then(Value::as_bool) == Some(true);
    match plain_byte_level {
        true => "gpt-2",
        false => "qwen2",
    }
}

/// The chat template: `chat_template.jinja` beside the tokenizer, else `tokenizer_config.json`'s.
fn chat_template(dir: &Path, config: &Value) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(io_err(&jinja));
    }
    Ok(config
        .get("chat_template")
        .and_then(Value::as_str)
        .map(str::to_string))
}

fn read_optional_json(path: &Path) -> Result<Value> {
    match path.exists() {
        true => Ok(oxrl_models::config::read_json(path)?),
        false => Ok(Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxrl_fixtures::fixture;

    fn value<'a>(meta: &'a [(String, MetaValue)], key: &str) -> &'a MetaValue {
        &meta.iter().find(|(k, _)| k == key).unwrap().1
    }

    #[test]
    fn the_qwen_tokenizer_becomes_gpt2_tokens_with_pads_and_control_tokens() {
        let dir = fixture("qwen3-tokenizer");
        let meta = metadata(&dir, 151_936).unwrap();
        let MetaValue::ArrStr(tokens) = value(&meta, "tokenizer.ggml.tokens") else {
            panic!("tokens are strings")
        };
        let MetaValue::ArrI32(types) = value(&meta, "tokenizer.ggml.token_type") else {
            panic!("token types are ints")
        };
        assert_eq!(tokens.len(), 151_936);
        assert_eq!(types.len(), 151_936);
        // 151643 is <|endoftext|>, the first added (special) token; the last ids are padding.
        assert_eq!(tokens[151_643], "<|endoftext|>");
        assert_eq!(types[151_643], CONTROL);
        assert_eq!(tokens[151_935], "[PAD151935]");
        assert_eq!(types[151_935], UNUSED);
        assert_eq!(types[0], NORMAL);
        assert_eq!(
            value(&meta, "tokenizer.ggml.pre"),
            &MetaValue::Str("qwen2".into())
        );
        let MetaValue::ArrStr(merges) = value(&meta, "tokenizer.ggml.merges") else {
            panic!("merges are strings")
        };
        assert_eq!(merges.len(), 294_166);
        assert!(merges.iter().all(|m| m.split(' ').count() == 2));
        assert_eq!(
            value(&meta, "tokenizer.ggml.eos_token_id"),
            &MetaValue::U32(151_645)
        );
    }

    #[test]
    fn a_token_past_the_vocabulary_is_refused_by_name() {
        let err = metadata(&fixture("qwen3-tokenizer"), 1000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside the model's vocab_size 1000"), "{err}");
        assert!(err.contains("tokenizer.json"), "{err}");
    }
}
