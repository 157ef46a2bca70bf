//! The Qwen tokenizer and chat templates against transformers' outputs in
//! `../shared/fixtures/qwen3-tokenizer/`.

use oxrl_fixtures::{fixture, ids, jsonl};
use oxrl_models::chat_template::ChatTemplate;
use oxrl_models::{eos_token_ids, Tokenizer};
use serde_json::{Map, Value};

#[test]
fn encode_and_decode_match_transformers() {
    let dir = fixture("qwen3-tokenizer");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let cases = jsonl(&dir.join("encode_cases.jsonl"));
    assert!(!cases.is_empty());
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids(&c["ids"]), "{text:?}");
        assert_eq!(
            tok.decode(&got, false).unwrap(),
            c["decoded"].as_str().unwrap()
        );
    }
}

#[test]
fn chat_templates_render_byte_for_byte_and_tokenize_to_the_stored_ids() {
    let dir = fixture("qwen3-tokenizer");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let cases = jsonl(&dir.join("chat_template_cases.jsonl"));
    assert_eq!(cases.len(), 7);
    for c in cases {
        let add = c["kwargs"]["add_generation_prompt"]
            .as_bool()
            .unwrap_or(false);
        let mut kwargs: Map<String, Value> = c["kwargs"].as_object().unwrap().clone();
        kwargs.remove("add_generation_prompt");
        let text = match c["template"].as_str().unwrap() {
            "tokenizer_config.json" => tok
                .apply_chat_template(&c["messages"], add, &kwargs)
                .unwrap(),
            file => {
                let source = std::fs::read_to_string(dir.join(file)).unwrap();
                ChatTemplate::new(&source, file)
                    .unwrap()
                    .render(&c["messages"], add, &Map::new(), &kwargs)
                    .unwrap()
            }
        };
        assert_eq!(text, c["text"].as_str().unwrap(), "{}", c["messages"]);
        assert_eq!(tok.encode(&text).unwrap(), ids(&c["ids"]));
    }
}

#[test]
fn special_tokens_come_from_tokenizer_config() {
    let dir = fixture("qwen3-tokenizer");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.eos_token_id, Some(151645), "<|im_end|>");
    assert_eq!(tok.pad_token_id, Some(151643), "<|endoftext|>");
    assert_eq!(eos_token_ids(&dir, Some(&tok)).unwrap(), vec![151645]);
    // qwen3-tiny has no tokenizer: its generation_config.json names eos 2.
    assert_eq!(
        eos_token_ids(&fixture("qwen3-tiny"), None).unwrap(),
        vec![2]
    );
}
