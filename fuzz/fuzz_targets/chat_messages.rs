//! Any JSON as the messages of a chat prompt, rendered by the real Qwen3 chat template.
#![no_main]

use std::sync::OnceLock;

fn tokenizer() -> &'static oxrl_models::Tokenizer {
    static TOK: OnceLock<oxrl_models::Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/fixtures/qwen3-tokenizer");
        oxrl_models::Tokenizer::from_dir(&dir).expect("the qwen3-tokenizer fixture")
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(messages) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let tok = tokenizer();
    for generation_prompt in [false, true] {
        if let Ok(text) = tok.apply_chat_template(&messages, generation_prompt, &Default::default())
        {
            let _ = tok.encode(&text);
        }
    }
});
