//! vLLM's token-in/token-out route (`POST /inference/v1/generate`) and its weight-reload control
//! routes, so that `[rollout] backend = "vllm"` can point at `oxrl serve` as it would at vLLM.

use super::http::ApiError;
use super::openai::token_ids;
use oxrl_models::ImageSource;
use oxrl_rollout::{Completion, SamplerConfig, SamplingParams, VersionSpan, WeightVersion};
use serde_json::{json, Map, Value};
use std::path::Path;

/// A generate request: `{token_ids, content_parts?, sampling_params: {n, max_tokens,
/// temperature, top_p, top_k, min_p, seed, stop_token_ids, ignore_eos, logprobs, ...}}`.
pub struct GenerateRequest {
    /// The prompt; an image's pads may be one pad (as the chat template writes it, and as
    /// vLLM takes it) or already expanded.
    pub ids: Vec<u32>,
    /// The `image_url` items of `content_parts`, in prompt order (paths relative to `base`).
    pub images: Vec<ImageSource>,
    pub params: SamplingParams,
}

pub fn request(body: &Map<String, Value>, base: &Path) -> Result<GenerateRequest, ApiError> {
    let ids = body
        .get("token_ids")
        .ok_or_else(|| ApiError::field("token_ids", "is required"))
        .and_then(|v| token_ids(v).map_err(|m| ApiError::field("token_ids", m)))?;
    if body.get("features").is_some_and(|f| !f.is_null()) {
        return Err(ApiError::field(
            "features",
            "pre-processed image features are not taken by oxrl serve: send the images as \
             content_parts ({\"type\": \"image_url\", \"url\": ...})",
        ));
    }
    let images = content_parts(body.get("content_parts"), base)?;
    let empty = Map::new();
    let sp = match body.get("sampling_params") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(o)) => o,
        Some(other) => {
            return Err(ApiError::field(
                "sampling_params",
                format!("expected an object, got {other}"),
            ))
        }
    };
    let num = |key: &str, default: f64| -> Result<f64, ApiError> {
        match sp.get(key).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| {
                ApiError::field(
                    &format!("sampling_params.{key}"),
                    format!("expected a number, got {v}"),
                )
            }),
        }
    };
    let int = |key: &str| -> Result<Option<i64>, ApiError> {
        match sp.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_i64().map(Some).ok_or_else(|| {
                ApiError::field(
                    &format!("sampling_params.{key}"),
                    format!("expected an integer, got {v}"),
                )
            }),
        }
    };
    let positive = |key: &str, default: i64| -> Result<usize, ApiError> {
        match int(key)?.unwrap_or(default) {
            v if v >= 1 => Ok(v as usize),
            v => Err(ApiError::field(
                &format!("sampling_params.{key}"),
                format!("must be at least 1, got {v}"),
            )),
        }
    };
    let top_k = match int("top_k")? {
        None | Some(-1) => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => {
            return Err(ApiError::field(
                "sampling_params.top_k",
                format!("must be -1 (off) or ≥ 0, got {k}"),
            ))
        }
    };
    let stop_token_ids = match sp.get("stop_token_ids").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(v) => {
            token_ids(v).map_err(|m| ApiError::field("sampling_params.stop_token_ids", m))?
        }
    };
    let params = SamplingParams {
        n: positive("n", 1)?,
        max_new_tokens: positive("max_tokens", 16)?,
        sampler: SamplerConfig {
            temperature: num("temperature", 1.0)?,
            top_k,
            top_p: num("top_p", 1.0)?,
            min_p: num("min_p", 0.0)?,
        },
        seed: match int("seed")? {
            Some(s) => s as u64,
            None => rand::random(),
        },
        stop_token_ids,
        stop_strings: Vec::new(),
        ignore_eos: sp
            .get("ignore_eos")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        first_prompt: 0,
    };
    Ok(GenerateRequest {
        ids,
        images,
        params,
    })
}

/// The images of vLLM's `content_parts`: `[{"type": "image_url", "url": "data:..." or a path}]`.
fn content_parts(parts: Option<&Value>, base: &Path) -> Result<Vec<ImageSource>, ApiError> {
    let parts = match parts {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(ApiError::field(
                "content_parts",
                format!("expected a list of parts, got {other}"),
            ))
        }
    };
    parts
        .iter()
        .enumerate()
        .map(|(i, part)| {
            let field = format!("content_parts[{i}]");
            match (part.get("type").and_then(Value::as_str), part.get("url")) {
                (Some("image_url"), Some(Value::String(url))) => {
                    Ok(ImageSource::from_reference(url, base))
                }
                (Some("image_url"), _) => Err(ApiError::field(&field, "needs a `url` string")),
                (kind, _) => Err(ApiError::field(
                    &field,
                    format!(
                        "oxrl serve takes image parts ({{\"type\": \"image_url\", \"url\": ...}}), \
                         got type {}",
                        kind.unwrap_or("(none)")
                    ),
                )),
            }
        })
        .collect()
}

/// One choice of the answer, as vLLM writes it.
pub fn choice(index: usize, completion: &Completion, versions: &[VersionSpan]) -> Value {
    let content: Vec<Value> = completion
        .response_ids
        .iter()
        .zip(&completion.logprobs)
        .map(|(id, lp)| json!({"token_id": id, "logprob": lp}))
        .collect();
    let spans: Vec<Value> = versions
        .iter()
        .map(|s| json!({"version": s.version.to_string(), "start": s.start, "end": s.end}))
        .collect();
    json!({
        "index": index,
        "token_ids": completion.response_ids,
        "logprobs": {"content": content},
        "finish_reason": completion.finish_reason.as_str(),
        "weight_versions": spans,
    })
}

/// A weight version as a client names it: `v3`, `"3"` or `3` (oxrl's versions are step counts).
pub fn version(body: &Map<String, Value>) -> Result<WeightVersion, ApiError> {
    let v = body
        .get("new_version")
        .or_else(|| body.get("weight_version"))
        .ok_or_else(|| ApiError::field("new_version", "is required"))?;
    let parsed = match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.strip_prefix('v').unwrap_or(s).parse().ok(),
        _ => None,
    };
    parsed.map(WeightVersion).ok_or_else(|| {
        ApiError::field(
            "new_version",
            format!("oxrl serve names versions by step: `v3`, \"3\" or 3, got {v}"),
        )
    })
}

/// The checkpoint directory of a `collective_rpc` call: only `reload_weights` is served.
pub fn reload_dir(body: &Map<String, Value>) -> Result<std::path::PathBuf, ApiError> {
    match body.get("method").and_then(Value::as_str) {
        Some("reload_weights") => {}
        Some(other) => {
            return Err(ApiError::field(
                "method",
                format!("oxrl serve runs only `reload_weights`, not `{other}`"),
            ))
        }
        None => return Err(ApiError::field("method", "is required")),
    }
    body.get("kwargs")
        .and_then(|k| k.get("weights_path"))
        .and_then(Value::as_str)
        .map(std::path::PathBuf::from)
        .ok_or_else(|| ApiError::field("kwargs.weights_path", "is required (a directory)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxrl_rollout::FinishReason;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_vllm_request_becomes_sampling_params() {
        let base = Path::new("/media");
        let r = request(
            &body(json!({
                "token_ids": [1, 2],
                "sampling_params": {"n": 4, "max_tokens": 9, "temperature": 0.7, "top_p": 0.9,
                    "top_k": -1, "min_p": 0.05, "seed": 11, "stop_token_ids": [3],
                    "ignore_eos": false, "logprobs": 0, "detokenize": false}
            })),
            base,
        )
        .unwrap();
        let p = &r.params;
        assert_eq!(r.ids, vec![1, 2]);
        assert!(r.images.is_empty());
        assert_eq!((p.n, p.max_new_tokens, p.seed), (4, 9, 11));
        assert_eq!(p.sampler.top_k, 0);
        assert_eq!(p.stop_token_ids, vec![3]);
        let e = request(
            &body(json!({"token_ids": [1], "sampling_params": {"n": 0}})),
            base,
        )
        .err()
        .unwrap();
        assert_eq!(e.param.as_deref(), Some("sampling_params.n"));
        assert!(request(&body(json!({"token_ids": [-1]})), base).is_err());
    }

    #[test]
    fn content_parts_name_the_images_in_order() {
        let base = Path::new("/media");
        let r = request(
            &body(json!({"token_ids": [1], "content_parts": [
                {"type": "image_url", "url": "data:image/png;base64,AA=="},
                {"type": "image_url", "url": "a.png"}]})),
            base,
        )
        .unwrap();
        assert_eq!(
            r.images,
            vec![
                ImageSource::Base64("data:image/png;base64,AA==".into()),
                ImageSource::Path("/media/a.png".into()),
            ]
        );
        let audio = json!({"token_ids": [1], "content_parts": [{"type": "audio_url", "url": "x"}]});
        let e = request(&body(audio), base).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("content_parts[0]"));
        assert!(e.message.contains("audio_url"), "{}", e.message);
    }

    #[test]
    fn a_choice_carries_ids_logprobs_and_version_spans() {
        let c = Completion {
            response_ids: vec![5, 6],
            logprobs: vec![-0.5, -1.0],
            finish_reason: FinishReason::Length,
            text: None,
            weight_version: WeightVersion(2),
            episode: None,
        };
        let spans = [
            VersionSpan {
                version: WeightVersion(2),
                start: 0,
                end: 1,
            },
            VersionSpan {
                version: WeightVersion(3),
                start: 1,
                end: 2,
            },
        ];
        let v = choice(1, &c, &spans);
        assert_eq!(v["token_ids"], json!([5, 6]));
        assert_eq!(v["logprobs"]["content"][1]["logprob"], json!(-1.0));
        assert_eq!(
            v["weight_versions"][1],
            json!({"version": "v3", "start": 1, "end": 2})
        );
        assert_eq!(v["finish_reason"], "length");
    }

    #[test]
    fn versions_are_read_as_step_counts() {
        assert_eq!(
            version(&body(json!({"new_version": "v3"}))).unwrap(),
            WeightVersion(3)
        );
        assert_eq!(
            version(&body(json!({"new_version": 4}))).unwrap(),
            WeightVersion(4)
        );
        assert!(version(&body(json!({"new_version": "step-1"}))).is_err());
    }
}
