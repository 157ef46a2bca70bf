//! OpenAI's completion and chat-completion requests as engine work, and the answers back in
//! OpenAI's shapes (with vLLM's extensions: `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
//! `chat_template_kwargs`).

use super::http::ApiError;
use oxrl_models::Tokenizer;
use oxrl_rollout::{Completion, SamplerConfig, SamplingParams};
use serde_json::{json, Map, Value};

/// Which OpenAI route a request came by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
}

/// The settings of a request besides its prompts.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub params: SamplingParams,
    /// `max_tokens` as the client gave it; `None` fills the model's context.
    pub max_tokens: Option<usize>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
    /// Return the sampled tokens' log-probabilities.
    pub logprobs: bool,
}

fn field<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn number(body: &Map<String, Value>, key: &str, default: f64) -> Result<f64, ApiError> {
    match field(body, key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| ApiError::field(key, format!("expected a number, got {v}"))),
    }
}

fn integer(body: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match field(body, key) {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| ApiError::field(key, format!("expected an integer, got {v}"))),
    }
}

fn count(body: &Map<String, Value>, key: &str, least: i64) -> Result<Option<usize>, ApiError> {
    match integer(body, key)? {
        Some(n) if n < least => Err(ApiError::field(
            key,
            format!("must be at least {least}, got {n}"),
        )),
        other => Ok(other.map(|n| n as usize)),
    }
}

fn boolean(body: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match field(body, key) {
        None => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| ApiError::field(key, format!("expected true or false, got {v}"))),
    }
}

/// Settings oxrl does not implement: refused when set to anything but their neutral value,
/// rather than silently ignored.
fn refuse_unsupported(body: &Map<String, Value>) -> Result<(), ApiError> {
    for key in ["presence_penalty", "frequency_penalty"] {
        if number(body, key, 0.0)? != 0.0 {
            return Err(ApiError::field(
                key,
                "is not supported by oxrl serve (use 0)",
            ));
        }
    }
    if field(body, "repetition_penalty").is_some()
        && number(body, "repetition_penalty", 1.0)? != 1.0
    {
        return Err(ApiError::field(
            "repetition_penalty",
            "is not supported by oxrl serve (use 1)",
        ));
    }
    if let Some(bias) = field(body, "logit_bias").and_then(Value::as_object) {
        if !bias.is_empty() {
            return Err(ApiError::field(
                "logit_bias",
                "is not supported by oxrl serve",
            ));
        }
    }
    if boolean(body, "echo")? {
        return Err(ApiError::field("echo", "is not supported by oxrl serve"));
    }
    if field(body, "suffix").is_some() {
        return Err(ApiError::field("suffix", "is not supported by oxrl serve"));
    }
    Ok(())
}

/// The request's sampling settings. `seed` defaults to a fresh random one, as OpenAI's does.
pub fn options(route: Route, body: &Map<String, Value>) -> Result<Options, ApiError> {
    refuse_unsupported(body)?;
    let n = count(body, "n", 1)?.unwrap_or(1);
    if let Some(best_of) = count(body, "best_of", 1)? {
        if best_of != n {
            return Err(ApiError::field(
                "best_of",
                "must equal n (oxrl serve returns every sample)",
            ));
        }
    }
    let max_tokens = match route {
        Route::Chat => match count(body, "max_completion_tokens", 1)? {
            Some(m) => Some(m),
            None => count(body, "max_tokens", 1)?,
        },
        // OpenAI's default for completions.
        Route::Completions => Some(count(body, "max_tokens", 1)?.unwrap_or(16)),
    };
    let temperature = number(body, "temperature", 1.0)?;
    if !(0.0..=100.0).contains(&temperature) {
        return Err(ApiError::field(
            "temperature",
            format!("must be in [0, 100], got {temperature}"),
        ));
    }
    let top_p = number(body, "top_p", 1.0)?;
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::field(
            "top_p",
            format!("must be in (0, 1], got {top_p}"),
        ));
    }
    // vLLM takes -1 (or 0) for "every token".
    let top_k = match integer(body, "top_k")? {
        None | Some(-1) => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => {
            return Err(ApiError::field(
                "top_k",
                format!("must be -1 (off) or ≥ 0, got {k}"),
            ))
        }
    };
    let min_p = number(body, "min_p", 0.0)?;
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::field(
            "min_p",
            format!("must be in [0, 1], got {min_p}"),
        ));
    }
    let seed = match integer(body, "seed")? {
        Some(s) => s as u64,
        None => rand::random(),
    };
    let stop_strings = match field(body, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(list)) => list
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::field("stop", "expected a string or a list of strings"))?,
        Some(other) => {
            return Err(ApiError::field(
                "stop",
                format!("expected a string or a list of strings, got {other}"),
            ))
        }
    };
    if stop_strings.iter().any(String::is_empty) {
        return Err(ApiError::field(
            "stop",
            "an empty stop string would stop at once",
        ));
    }
    let stop_token_ids = match field(body, "stop_token_ids") {
        None => Vec::new(),
        Some(v) => token_ids(v).map_err(|m| ApiError::field("stop_token_ids", m))?,
    };
    let logprobs = match (route, field(body, "logprobs")) {
        (_, None) => false,
        (Route::Chat, Some(v)) => v.as_bool().ok_or_else(|| {
            ApiError::field("logprobs", format!("expected true or false, got {v}"))
        })?,
        // Completions: `logprobs: k` asks for the sampled token and its k best alternatives.
        (Route::Completions, Some(_)) => {
            let k = count(body, "logprobs", 0)?.unwrap_or(0);
            if k > 0 {
                return Err(unsupported_alternatives("logprobs"));
            }
            true
        }
    };
    if count(body, "top_logprobs", 0)?.unwrap_or(0) > 0 {
        return Err(unsupported_alternatives("top_logprobs"));
    }
    let include_usage = field(body, "stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Options {
        params: SamplingParams {
            n,
            // Settled once the prompt's length is known ([`Options::settle_length`]).
            max_new_tokens: max_tokens.unwrap_or(1),
            sampler: SamplerConfig {
                temperature,
                top_k,
                top_p,
                min_p,
            },
            seed,
            stop_token_ids,
            stop_strings,
            ignore_eos: boolean(body, "ignore_eos")?,
            first_prompt: 0,
        },
        max_tokens,
        stream: boolean(body, "stream")?,
        include_usage,
        logprobs,
    })
}

fn unsupported_alternatives(param: &str) -> ApiError {
    ApiError::field(
        param,
        "alternatives to the sampled token are not returned by oxrl serve: use 0 (the sampled \
         token's log-prob)",
    )
}

impl Options {
    /// Fits `max_tokens` to the longest prompt: an explicit budget that runs past the model's
    /// context is a 400 (as vLLM answers), an absent one fills the context.
    pub fn settle_length(&mut self, longest_prompt: usize, context: usize) -> Result<(), ApiError> {
        if longest_prompt >= context {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {context} tokens. However, your prompt \
                 has {longest_prompt} tokens: shorten it"
            )));
        }
        let room = context - longest_prompt;
        match self.max_tokens {
            Some(m) if m > room => Err(ApiError::bad_request(format!(
                "This model's maximum context length is {context} tokens. However, you requested \
                 {} tokens ({longest_prompt} in the prompt, {m} in the completion): lower \
                 max_tokens",
                longest_prompt + m
            ))),
            Some(m) => {
                self.params.max_new_tokens = m;
                Ok(())
            }
            None => {
                self.params.max_new_tokens = room;
                Ok(())
            }
        }
    }
}

/// A list of token ids.
pub fn token_ids(v: &Value) -> Result<Vec<u32>, String> {
    let list = v.as_array().ok_or("expected a list of token ids")?;
    list.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("{x} is not a token id (a non-negative integer)"))
        })
        .collect()
}

/// The prompts of a completions request: a string, a list of strings, a list of ids or a list
/// of lists of ids.
pub fn completion_prompts(
    body: &Map<String, Value>,
    tokenizer: &Tokenizer,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| {
        tokenizer
            .encode(text)
            .map_err(|e| ApiError::field("prompt", e))
    };
    let prompts = match field(body, "prompt") {
        None => return Err(ApiError::field("prompt", "is required")),
        Some(Value::String(text)) => vec![encode(text)?],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::field("prompt", "is an empty list"))
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|t| match t {
                    Value::String(s) => encode(s),
                    other => Err(ApiError::field(
                        "prompt",
                        format!("mixes strings with {other}"),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => {
                vec![token_ids(&Value::Array(items.clone()))
                    .map_err(|m| ApiError::field("prompt", m))?]
            }
            Value::Array(_) => items
                .iter()
                .map(|p| token_ids(p).map_err(|m| ApiError::field("prompt", m)))
                .collect::<Result<_, _>>()?,
            other => {
                return Err(ApiError::field(
                    "prompt",
                    format!("expected text or token ids, got {other}"),
                ))
            }
        },
        Some(other) => {
            return Err(ApiError::field(
                "prompt",
                format!("expected text or token ids, got {other}"),
            ))
        }
    };
    Ok(prompts)
}

/// Template variables of a chat request: `chat_template_kwargs` (vLLM's), and a top-level
/// `enable_thinking` for clients that send it bare.
pub fn template_kwargs(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = match field(body, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(other) => {
            return Err(ApiError::field(
                "chat_template_kwargs",
                format!("expected an object, got {other}"),
            ))
        }
    };
    if let Some(t) = field(body, "enable_thinking") {
        let t = t
            .as_bool()
            .ok_or_else(|| ApiError::field("enable_thinking", "expected true or false"))?;
        kwargs.insert("enable_thinking".into(), Value::Bool(t));
    }
    Ok(kwargs)
}

/// The text of each token, for log-prob answers (special tokens kept: they were sampled).
fn token_texts(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&id| tokenizer.decode(&[id], false).unwrap_or_default())
        .collect()
}

/// The `logprobs` object of a choice or a stream chunk, for `ids` sampled with `logprobs`.
pub fn logprobs_value(
    route: Route,
    tokenizer: &Tokenizer,
    ids: &[u32],
    logprobs: &[f32],
    text_offset: usize,
) -> Value {
    let texts = token_texts(tokenizer, ids);
    match route {
        Route::Chat => {
            let content: Vec<Value> = texts
                .iter()
                .zip(logprobs)
                .map(|(t, lp)| {
                    json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": []})
                })
                .collect();
            json!({ "content": content })
        }
        Route::Completions => {
            let mut offsets = Vec::with_capacity(texts.len());
            let mut at = text_offset;
            for t in &texts {
                offsets.push(at);
                at += t.len();
            }
            json!({
                "tokens": texts,
                "token_logprobs": logprobs,
                "top_logprobs": null,
                "text_offset": offsets,
            })
        }
    }
}

/// One finished choice of a non-streamed answer.
pub fn choice(
    route: Route,
    index: usize,
    completion: &Completion,
    tokenizer: &Tokenizer,
    logprobs: bool,
) -> Value {
    let text = completion.text.clone().unwrap_or_default();
    let lp = logprobs.then(|| {
        logprobs_value(
            route,
            tokenizer,
            &completion.response_ids,
            &completion.logprobs,
            0,
        )
    });
    let finish = completion.finish_reason.as_str();
    match route {
        Route::Completions => json!({
            "index": index, "text": text, "logprobs": lp, "finish_reason": finish,
        }),
        Route::Chat => json!({
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp,
            "finish_reason": finish,
        }),
    }
}

/// The envelope every answer and stream chunk shares.
pub fn envelope(route: Route, id: &str, created: u64, model: &str, stream: bool) -> Value {
    let object = match (route, stream) {
        (Route::Completions, _) => "text_completion",
        (Route::Chat, false) => "chat.completion",
        (Route::Chat, true) => "chat.completion.chunk",
    };
    json!({"id": id, "object": object, "created": created, "model": model})
}

pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// The text of one streamed sample, sent in pieces as tokens arrive. A piece never ends inside
/// a character (a byte-level token can be half of one) nor in what may be the start of a stop
/// string, so the pieces always add up to the final text.
#[derive(Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    sent: usize,
}

impl TextStream {
    /// The new text that `token` makes safe to send.
    pub fn push(&mut self, token: u32, tokenizer: &Tokenizer, stops: &[String]) -> String {
        self.ids.push(token);
        let text = tokenizer.decode(&self.ids, true).unwrap_or_default();
        let safe = safe_len(&text, stops);
        self.take(&text, safe)
    }

    /// What is left of `final_text` (the sample's text, stop string removed) to send.
    pub fn finish(&mut self, final_text: &str) -> String {
        self.take(final_text, final_text.len())
    }

    fn take(&mut self, text: &str, upto: usize) -> String {
        if upto <= self.sent || !text.is_char_boundary(self.sent) {
            return String::new();
        }
        let piece = text[self.sent..upto].to_string();
        self.sent = upto;
        piece
    }
}

/// How much of `text` can be sent: up to a stop string in it, or up to the longest tail that
/// could start one, and never an unfinished character (decoded as U+FFFD).
fn safe_len(text: &str, stops: &[String]) -> usize {
    let mut safe = text.trim_end_matches('\u{FFFD}').len();
    for stop in stops {
        if let Some(at) = text.find(stop.as_str()) {
            safe = safe.min(at);
            continue;
        }
        for (i, _) in text
            .char_indices()
            .filter(|&(i, _)| i + stop.len() > text.len())
        {
            if stop.starts_with(&text[i..]) {
                safe = safe.min(i);
                break;
            }
        }
    }
    safe
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn completion_defaults_follow_openai() {
        let o = options(Route::Completions, &body(json!({"prompt": "x", "seed": 3}))).unwrap();
        assert_eq!(o.max_tokens, Some(16));
        assert_eq!(o.params.n, 1);
        assert_eq!(o.params.sampler.temperature, 1.0);
        assert_eq!(o.params.seed, 3);
        assert!(!o.stream && !o.logprobs);
    }

    #[test]
    fn bad_settings_name_their_field() {
        let cases = [
            (json!({"max_tokens": -1}), "max_tokens"),
            (json!({"n": 0}), "n"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"stop": [1]}), "stop"),
            (json!({"presence_penalty": 0.5}), "presence_penalty"),
            (json!({"logprobs": 3}), "logprobs"),
            (json!({"best_of": 2}), "best_of"),
        ];
        for (b, param) in cases {
            let e = options(Route::Completions, &body(b.clone())).unwrap_err();
            assert_eq!(e.status, 400, "{b}");
            assert_eq!(e.param.as_deref(), Some(param), "{b}: {}", e.message);
        }
    }

    #[test]
    fn vllm_extensions_and_chat_names_are_read() {
        let o = options(
            Route::Chat,
            &body(json!({
                "max_completion_tokens": 7, "top_k": -1, "min_p": 0.1, "stop": "##",
                "stop_token_ids": [5], "ignore_eos": true, "logprobs": true, "stream": true,
                "stream_options": {"include_usage": true}
            })),
        )
        .unwrap();
        assert_eq!(o.max_tokens, Some(7));
        assert_eq!(o.params.sampler.top_k, 0);
        assert_eq!(o.params.sampler.min_p, 0.1);
        assert_eq!(o.params.stop_strings, vec!["##".to_string()]);
        assert_eq!(o.params.stop_token_ids, vec![5]);
        assert!(o.params.ignore_eos && o.logprobs && o.stream && o.include_usage);
    }

    #[test]
    fn the_length_budget_fits_the_context() {
        let mut o = options(Route::Chat, &body(json!({}))).unwrap();
        o.settle_length(10, 64).unwrap();
        assert_eq!(o.params.max_new_tokens, 54);
        let mut o = options(Route::Completions, &body(json!({"max_tokens": 60}))).unwrap();
        let e = o.settle_length(10, 64).unwrap_err();
        assert!(
            e.message.contains("70 tokens (10 in the prompt, 60"),
            "{}",
            e.message
        );
        assert!(o.settle_length(64, 64).is_err());
    }

    #[test]
    fn streamed_text_holds_back_what_may_start_a_stop_string() {
        assert_eq!(safe_len("hello wor", &["world".into()]), 6);
        assert_eq!(safe_len("hello world!", &["world".into()]), 6);
        assert_eq!(safe_len("hello", &["xyz".into()]), 5);
        assert_eq!(safe_len("ab\u{FFFD}", &[]), 2);
        assert_eq!(safe_len("aaa", &["ab".into()]), 2);
    }
}
