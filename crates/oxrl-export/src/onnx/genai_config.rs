//! `genai_config.json`: what onnxruntime-genai reads to run a decoder directory
//! (`og.Model(dir)`, then its generator and tokenizer) — the decoder's file, its KV-cache
//! input and output names, its heads, and the special tokens and sampling defaults that
//! `generation_config.json` gives transformers. It is the file onnxruntime-genai's own model
//! builder writes, for the graph [`super::decoder_graph`] builds.

use crate::decoder::Decoder;
use crate::error::Result;
use oxrl_models::config::read_json;
use oxrl_models::{eos_token_ids, Tokenizer};
use serde_json::{json, Value};
use std::path::Path;

/// The file's name, where onnxruntime-genai looks for it.
pub const GENAI_CONFIG_FILE: &str = "genai_config.json";

/// The configuration of the text decoder exported from the checkpoint in `dir` as `model_file`.
pub fn genai_config(dir: &Path, decoder: &Decoder, model_file: &str) -> Result<Value> {
    let c = &decoder.config;
    let generation = match dir.join("generation_config.json") {
        path if path.exists() => read_json(&path)?,
        _ => json!({}),
    };
    let tokenizer = match dir.join("tokenizer.json").exists() {
        true => Some(Tokenizer::from_dir(dir)?),
        false => None,
    };
    // transformers' order: generation_config.json, then config.json, then the tokenizer.
    let token = |key: &str, from_tokenizer: Option<u32>| -> Option<u64> {
        [&generation, &decoder.config_json]
            .iter()
            .find_map(|j| j.get(key).and_then(Value::as_u64))
            .or(from_tokenizer.map(u64::from))
    };
    let eos = eos_token_ids(dir, tokenizer.as_ref())?;
    let pad = token(
        "pad_token_id",
        tokenizer.as_ref().and_then(|t| t.pad_token_id),
    )
    .or(eos.first().map(|&id| u64::from(id)));
    let bos = token("bos_token_id", None).or(pad);
    let search = |key: &str, default: Value| generation.get(key).cloned().unwrap_or(default);
    Ok(json!({
        "model": {
            "bos_token_id": bos,
            "context_length": c.max_position_embeddings,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": model_file,
                "head_size": c.head_dim,
                "hidden_size": c.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": c.num_attention_heads,
                "num_hidden_layers": c.num_hidden_layers,
                "num_key_value_heads": c.num_key_value_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": "qwen3",
            "vocab_size": c.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": search("do_sample", json!(false)),
            "early_stopping": true,
            "length_penalty": 1.0,
            "max_length": c.max_position_embeddings,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            // The graph appends to the past it is given (`present` is a new, longer tensor),
            // so the runtime must not hand it one buffer for both.
            "past_present_share_buffer": false,
            "repetition_penalty": search("repetition_penalty", json!(1.0)),
            "temperature": search("temperature", json!(1.0)),
            "top_k": search("top_k", json!(50)),
            "top_p": search("top_p", json!(1.0)),
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_tiny_gives_its_generation_config_tokens_and_the_decoders_shape() {
        // qwen3-tiny: no tokenizer; generation_config.json says bos 1, eos 2.
        let dir = oxrl_fixtures::fixture("qwen3-tiny");
        let decoder = Decoder::read(&dir).unwrap();
        let config = genai_config(&dir, &decoder, "model.onnx").unwrap();
        let model = &config["model"];
        assert_eq!(model["eos_token_id"], json!([2]));
        assert_eq!(model["bos_token_id"], 1);
        assert_eq!(model["pad_token_id"], 2, "no pad token: the first eos");
        let d = &decoder.config;
        assert_eq!(model["decoder"]["num_hidden_layers"], d.num_hidden_layers);
        assert_eq!(
            model["decoder"]["num_key_value_heads"],
            d.num_key_value_heads
        );
        assert_eq!(model["decoder"]["head_size"], d.head_dim);
        assert_eq!(model["vocab_size"], d.vocab_size);
        assert_eq!(config["search"]["past_present_share_buffer"], false);
        assert_eq!(config["search"]["do_sample"], false);
    }
}
