//! A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` crate, the chat template
//! from `chat_template.jinja` or `tokenizer_config.json`, and the special tokens the template and
//! the generation engine need.

use crate::chat_template::ChatTemplate;
use crate::config::read_json;
use crate::error::{ModelError, Result};
use serde_json::{Map, Value};
use std::path::Path;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<ChatTemplate>,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` as the template sees them.
    special_tokens: Map<String, Value>,
    /// The id of `eos_token` from tokenizer_config.json, if any.
    pub eos_token_id: Option<u32>,
    /// The id of `pad_token` from tokenizer_config.json, if any.
    pub pad_token_id: Option<u32>,
}

/// A special token in tokenizer_config.json: a plain string or an `AddedToken` object.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads the tokenizer of the model directory `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|source| {
            ModelError::TokenizerLoad {
                path: path.clone(),
                source,
            }
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config = match config_path.exists() {
            true => read_json(&config_path)?,
            false => Value::Object(Map::new()),
        };
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            let source = std::fs::read_to_string(&jinja).map_err(|source| ModelError::Io {
                path: jinja.clone(),
                source,
            })?;
            Some(ChatTemplate::new(&source, &jinja.display().to_string())?)
        } else {
            match config.get("chat_template") {
                Some(Value::String(source)) => Some(ChatTemplate::new(
                    source,
                    &format!("{} (chat_template)", config_path.display()),
                )?),
                _ => None,
            }
        };
        let mut special_tokens = Map::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            let text = config.get(key).and_then(token_text);
            special_tokens.insert(key.into(), text.map(Value::String).unwrap_or(Value::Null));
        }
        let id_of = |key: &str| {
            special_tokens
                .get(key)
                .and_then(Value::as_str)
                .and_then(|t| inner.token_to_id(t))
        };
        let (eos_token_id, pad_token_id) = (id_of("eos_token"), id_of("pad_token"));
        Ok(Self {
            inner,
            chat_template,
            special_tokens,
            eos_token_id,
            pad_token_id,
        })
    }

    /// Token ids of `text`, without added special tokens (`add_special_tokens=False`): chat
    /// templates already spell them out.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|source| ModelError::Tokenize {
                action: "encode text",
                source,
            })?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|source| ModelError::Tokenize {
                action: "decode ids",
                source,
            })
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders chat `messages` with the checkpoint's template; `kwargs` holds template variables
    /// such as `enable_thinking`.
    pub fn apply_chat_template(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(ModelError::NoChatTemplate)?;
        template.render(
            messages,
            add_generation_prompt,
            &self.special_tokens,
            kwargs,
        )
    }
}

/// Token ids that end generation: `eos_token_id` of generation_config.json (a number or a list),
/// else of config.json, plus the tokenizer's `eos_token`.
pub fn eos_token_ids(dir: &Path, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        if !path.exists() {
            continue;
        }
        match read_json(&path)?.get("eos_token_id") {
            Some(Value::Number(n)) => ids.extend(n.as_u64().map(|x| x as u32)),
            Some(Value::Array(a)) => {
                ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32))
            }
            _ => continue,
        }
        break;
    }
    ids.extend(tokenizer.and_then(|t| t.eos_token_id));
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}
