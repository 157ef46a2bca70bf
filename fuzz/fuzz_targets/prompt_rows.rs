//! Any text as a prompt dataset (JSONL rows, string or chat prompts, answer columns), loaded
//! as a training run loads it with the arithmetic demo's tokenizer and chat template.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

struct Setup {
    tokenizer: oxrl_models::Tokenizer,
    data: oxrl_train::config::DataConfig,
    file: PathBuf,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let tokenizer = oxrl_models::Tokenizer::from_dir(&repo.join("examples/arithmetic/policy"))
            .expect("the demo's tokenizer");
        let config = "[model]\npath = \"m\"\n[data]\ntrain_files = \"x.jsonl\"\nmax_prompt_length = 64\n";
        let data = oxrl_train::RunConfig::from_str(config, std::path::Path::new("fuzz.toml"))
            .expect("a valid config")
            .data;
        let file = std::env::temp_dir().join(format!("oxrl-fuzz-rows-{}.jsonl", std::process::id()));
        Setup { tokenizer, data, file }
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let s = setup();
    if std::fs::write(&s.file, data).is_err() {
        return;
    }
    let _ = oxrl_train::data::load_prompts(&[&s.file], &s.data, &s.tokenizer, None);
});
