//! Input lines of `score` and `generate`: JSONL objects whose prompt is given as token ids
//! (`prompt_ids`), raw text (`prompt`), or chat messages (`messages`, or `prompt` as a list)
//! rendered with the model's chat template.

use anyhow::{anyhow, bail, Context, Result};
use oxrl_models::image::prompt_image_sources;
use oxrl_models::{PolicyModel, Tokenizer};
use oxrl_rollout::PromptImage;
use serde_json::{Map, Value};
use std::path::Path;

/// One non-blank input line: its 1-based number and its object.
pub struct Line {
    pub number: usize,
    pub fields: Map<String, Value>,
}

pub fn read_jsonl(path: &Path) -> Result<Vec<Line>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let value: Value =
            serde_json::from_str(raw).with_context(|| format!("{}: invalid JSON", at()))?;
        let Value::Object(fields) = value else {
            bail!("{}: expected a JSON object", at());
        };
        lines.push(Line {
            number: i + 1,
            fields,
        });
    }
    if lines.is_empty() {
        bail!("{}: no input lines", path.display());
    }
    Ok(lines)
}

/// Template variables and the chat rendering switch shared by every line.
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// `enable_thinking` for Qwen3 templates; unset leaves the template's default.
    pub enable_thinking: Option<bool>,
}

impl ChatOptions {
    fn kwargs(&self) -> Map<String, Value> {
        let mut kw = Map::new();
        if let Some(t) = self.enable_thinking {
            kw.insert("enable_thinking".into(), Value::Bool(t));
        }
        kw
    }
}

/// `key` as a list of token ids, if present.
pub fn ids_field(fields: &Map<String, Value>, key: &str) -> Result<Option<Vec<u32>>> {
    let Some(v) = fields.get(key) else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| anyhow!("`{key}`: expected a list of token ids"))?;
    list.iter()
        .map(|x| {
            x.as_u64()
                .filter(|&t| t <= u32::MAX as u64)
                .map(|t| t as u32)
                .ok_or_else(|| anyhow!("`{key}`: {x} is not a token id (a non-negative integer)"))
        })
        .collect::<Result<Vec<u32>>>()
        .map(Some)
}

fn need_tokenizer<'a>(tokenizer: Option<&'a Tokenizer>, key: &str) -> Result<&'a Tokenizer> {
    tokenizer.ok_or_else(|| {
        anyhow!("`{key}` is text, but the model has no tokenizer.json: give token ids instead")
    })
}

/// Chat messages rendered with the template and the generation prompt, then tokenized.
pub fn chat_ids(
    messages: &Value,
    tokenizer: Option<&Tokenizer>,
    chat: &ChatOptions,
) -> Result<Vec<u32>> {
    let tok = need_tokenizer(tokenizer, "messages")?;
    if !messages.is_array() {
        bail!("`messages`: expected a list of {{\"role\", \"content\"}} objects");
    }
    let text = tok.apply_chat_template(messages, true, &chat.kwargs())?;
    Ok(tok.encode(&text)?)
}

/// The prompt of a line as token ids.
pub fn prompt_ids(
    fields: &Map<String, Value>,
    tokenizer: Option<&Tokenizer>,
    chat: &ChatOptions,
) -> Result<Vec<u32>> {
    if let Some(ids) = ids_field(fields, "prompt_ids")? {
        return Ok(ids);
    }
    if let Some(messages) = fields.get("messages") {
        return chat_ids(messages, tokenizer, chat);
    }
    match fields.get("prompt") {
        Some(Value::String(text)) => Ok(need_tokenizer(tokenizer, "prompt")?.encode(text)?),
        Some(messages @ Value::Array(_)) => chat_ids(messages, tokenizer, chat),
        Some(_) => bail!("`prompt`: expected a string or a list of chat messages"),
        None => bail!("no prompt: expected `prompt_ids`, `prompt` or `messages`"),
    }
}

/// The response of a `score` line as token ids (`response_ids`, or `response` text).
pub fn response_ids(
    fields: &Map<String, Value>,
    tokenizer: Option<&Tokenizer>,
) -> Result<Vec<u32>> {
    if let Some(ids) = ids_field(fields, "response_ids")? {
        return Ok(ids);
    }
    match fields.get("response") {
        Some(Value::String(text)) => Ok(need_tokenizer(tokenizer, "response")?.encode(text)?),
        Some(_) => bail!("`response`: expected a string"),
        None => bail!("no response: expected `response_ids` or `response`"),
    }
}

/// A line's prompt ids with its images (Qwen3-VL): the images from `images` (paths relative to
/// `base`, the input file's directory, or data URLs) or from the image items of `messages`,
/// processed with the checkpoint's image processor; each image's single `<|image_pad|>` in the
/// prompt is expanded to the image's token count.
pub fn prompt_with_images(
    fields: &Map<String, Value>,
    tokenizer: Option<&Tokenizer>,
    chat: &ChatOptions,
    model: &dyn PolicyModel,
    base: &Path,
) -> Result<(Vec<u32>, Vec<PromptImage>)> {
    let messages = fields
        .get("messages")
        .or_else(|| fields.get("prompt").filter(|p| p.is_array()));
    let sources =
        prompt_image_sources(fields.get("images"), messages, base).map_err(|e| anyhow!(e))?;
    let images = model.prepare_images(&sources)?;
    let ids = prompt_ids(fields, tokenizer, chat)?;
    let ids = model.expand_image_pads(&ids, &images)?;
    let images = images
        .into_iter()
        .zip(&sources)
        .map(|(pixels, source)| PromptImage {
            pixels,
            source: Some(source.to_reference()),
        })
        .collect();
    Ok((ids, images))
}
