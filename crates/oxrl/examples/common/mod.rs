//! Pieces the demo generators share: a byte-level tokenizer, file writing, and the SFT warm-up
//! that turns a random policy into the demo's shipped one.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// GPT-2's byte → printable-character map used by byte-level BPE.
pub fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(chars) {
        map[*b as usize] = char::from_u32(c).expect("valid char");
    }
    map
}

/// A byte-level BPE `tokenizer.json` with no merges: 256 byte tokens, then `specials`.
pub fn tokenizer_json(specials: &[&str]) -> Value {
    let vocab: serde_json::Map<String, Value> = byte_chars()
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": 256 + i, "content": s, "single_word": false, "lstrip": false,
                             "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
}

/// The ChatML template of the text demos (no system turn). (Each demo compiles this module
/// on its own; the vision demo has its own template and specials.)
#[allow(dead_code)]
pub const TEXT_CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The special tokens of the text demos, after the 256 byte tokens (ids 256, 257, 258).
#[allow(dead_code)]
pub const TEXT_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Writes a demo policy's tokenizer files into `side`: the byte-level `tokenizer.json` with
/// `specials`, `tokenizer_config.json` with `chat_template` (eos `<|im_end|>` = 258, pad
/// `<|endoftext|>` = 256), and `generation_config.json`.
pub fn write_tokenizer_files(side: &Path, specials: &[&str], chat_template: &str) {
    write(
        &side.join("tokenizer.json"),
        &tokenizer_json(specials).to_string(),
    );
    write(
        &side.join("tokenizer_config.json"),
        &json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null,
                "chat_template": chat_template, "tokenizer_class": "PreTrainedTokenizerFast"})
        .to_string(),
    );
    write(
        &side.join("generation_config.json"),
        &json!({"eos_token_id": 258, "pad_token_id": 256}).to_string(),
    );
}

/// Writes `text` to `path`, creating its directory.
pub fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("create dir");
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Runs `<root>/sft.toml` (its `__INIT__` replaced by `init`, the random policy) and copies the
/// last checkpoint's `files` into `<root>/policy/`.
pub fn warm_up(root: &Path, init: &Path, name: &str, files: &[&str]) {
    let sft_config = root.join("sft.toml");
    let text = std::fs::read_to_string(&sft_config)
        .unwrap_or_else(|e| panic!("{}: {e}", sft_config.display()));
    let tmp_config = root.join(".sft.resolved.toml");
    write(
        &tmp_config,
        &text.replace("__INIT__", &init.display().to_string()),
    );
    let mut cfg = oxrl_train::RunConfig::from_file(&tmp_config).expect("valid sft.toml");
    let out: PathBuf = std::env::temp_dir().join(format!("oxrl-{name}-sft"));
    let _ = std::fs::remove_dir_all(&out);
    cfg.output_dir = out;
    let last = oxrl_train::sft::run(&cfg, false, &oxrl_train::Interrupt::default())
        .expect("sft")
        .last;
    let _ = std::fs::remove_file(&tmp_config);
    let policy = root.join("policy");
    let _ = std::fs::remove_dir_all(&policy);
    std::fs::create_dir_all(&policy).expect("policy dir");
    for f in files {
        std::fs::copy(last.join(f), policy.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
}
