//! The input parsers never panic: thousands of seeded mutations of valid run configs, prompt
//! datasets, chat messages and rollout files (bytes flipped, ranges cut and repeated, tokens
//! that parsers trip on spliced in) must each end in a value or an error. This is the CI-sized
//! counterpart of the coverage-guided fuzzing in `fuzz/` (`bash fuzz/run`), over the same
//! four parsers and seeds.

use oxrl_fixtures::fixture;
use oxrl_train::config::DataConfig;
use oxrl_train::data::load_prompts;
use oxrl_train::trajectory::parse_trajectories;
use oxrl_train::RunConfig;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Text parsers stumble on: delimiters, escapes, extreme numbers, odd characters, and the
/// keys and markers oxrl's formats give meaning to.
const TOKENS: &[&str] = &[
    "\"",
    "'",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "=",
    "\n",
    "\\",
    "\\u0000",
    "\\ud800",
    "1e400",
    "-1",
    "0",
    "-0.0",
    "18446744073709551616",
    "9223372036854775807",
    "NaN",
    "inf",
    "null",
    "true",
    "[]",
    "{}",
    "é",
    "🦀",
    "\u{202e}",
    "[[reward.functions]]\n",
    "[trainer]\n",
    "type = \"code\"\n",
    "\"role\"",
    "\"content\"",
    "\"assistant\"",
    "\"tool_calls\"",
    "{\"type\": \"image\", \"image\": \"x.png\"}",
    "<image>",
    "<|im_start|>",
    "<|image_pad|>",
    "\"prompt_ids\"",
    "\"response_ids\"",
    "\"rollout_logprobs\"",
    "\"images\"",
];

/// A small seeded generator (xorshift64*): the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One to four random edits of `seed`.
fn mutate(seed: &str, rng: &mut Rng) -> String {
    let mut bytes = seed.as_bytes().to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(bytes.len() + 1);
        match rng.below(5) {
            0 if !bytes.is_empty() => {
                let i = at.min(bytes.len() - 1);
                bytes[i] = rng.next() as u8;
            }
            1 => {
                let end = (at + rng.below(16)).min(bytes.len());
                bytes.drain(at..end);
            }
            2 => {
                let end = (at + rng.below(32)).min(bytes.len());
                let copy = bytes[at..end].to_vec();
                let to = rng.below(bytes.len() + 1);
                bytes.splice(to..to, copy);
            }
            3 => bytes.truncate(at),
            _ => {
                let token = TOKENS[rng.below(TOKENS.len())].as_bytes();
                bytes.splice(at..at, token.iter().copied());
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A random JSON value built from [`TOKENS`]: what a structured mutation puts in place.
fn random_value(rng: &mut Rng, depth: usize) -> serde_json::Value {
    use serde_json::{json, Value};
    match rng.below(if depth > 2 { 5 } else { 7 }) {
        0 => Value::Null,
        1 => json!(rng.below(3) == 0),
        2 => json!(rng.next() as i64),
        3 => json!(f64::from_bits(rng.next())).clone(),
        4 => json!(TOKENS[rng.below(TOKENS.len())]),
        5 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let keys = [
                "role",
                "content",
                "type",
                "text",
                "image",
                "tool_calls",
                "name",
            ];
            Value::Object(
                (0..rng.below(4))
                    .map(|_| {
                        (
                            keys[rng.below(keys.len())].to_string(),
                            random_value(rng, depth + 1),
                        )
                    })
                    .collect(),
            )
        }
    }
}

/// `value` with one node (anywhere in the tree) replaced by a random value.
fn mutate_json(value: &mut serde_json::Value, rng: &mut Rng) {
    use serde_json::Value;
    let children: Vec<&mut Value> = match value {
        Value::Array(a) => a.iter_mut().collect(),
        Value::Object(o) => o.values_mut().collect(),
        _ => Vec::new(),
    };
    if children.is_empty() || rng.below(3) == 0 {
        *value = random_value(rng, 0);
        return;
    }
    let n = children.len();
    let pick = rng.below(n);
    if let Some(child) = children.into_iter().nth(pick) {
        mutate_json(child, rng);
    }
}

fn seeds(target: &str) -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect()
}

/// Runs `parse` on `rounds` mutations of each seed of `target`; returns the inputs that
/// panicked.
fn survive(target: &str, rounds: usize, mut parse: impl FnMut(&str)) -> Vec<String> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ target.len() as u64);
    let mut panicked = Vec::new();
    for seed in seeds(target) {
        for _ in 0..rounds {
            let input = mutate(&seed, &mut rng);
            if catch_unwind(AssertUnwindSafe(|| parse(&input))).is_err() {
                panicked.push(input);
            }
        }
    }
    panicked
}

fn assert_none(target: &str, panicked: Vec<String>) {
    assert!(
        panicked.is_empty(),
        "{target}: {} inputs panicked, the first:\n{:?}",
        panicked.len(),
        panicked.first()
    );
}

#[test]
fn run_configs_never_panic() {
    let panicked = survive("config_toml", 1500, |text| {
        let _ = RunConfig::from_str(text, Path::new("mutated.toml"));
    });
    assert_none("config_toml", panicked);
}

#[test]
fn rollout_files_never_panic() {
    let panicked = survive("trajectories", 3000, |text| {
        let _ = parse_trajectories(text, "mutated.jsonl");
    });
    assert_none("trajectories", panicked);
}

#[test]
fn chat_messages_never_panic() {
    let tok = oxrl_models::Tokenizer::from_dir(&fixture("qwen3-tokenizer")).unwrap();
    let render = |messages: &serde_json::Value| {
        for generation_prompt in [false, true] {
            if let Ok(t) = tok.apply_chat_template(messages, generation_prompt, &Default::default())
            {
                let _ = tok.encode(&t);
            }
        }
    };
    let mut panicked = survive("chat_messages", 1000, |text| {
        if let Ok(messages) = serde_json::from_str(text) {
            render(&messages);
        }
    });
    // Byte edits mostly break the JSON; these edit the tree, so the template sees them all.
    let mut rng = Rng(7);
    for seed in seeds("chat_messages") {
        let seed: serde_json::Value = serde_json::from_str(&seed).unwrap();
        for _ in 0..1500 {
            let mut messages = seed.clone();
            for _ in 0..=rng.below(3) {
                mutate_json(&mut messages, &mut rng);
            }
            if catch_unwind(AssertUnwindSafe(|| render(&messages))).is_err() {
                panicked.push(messages.to_string());
            }
        }
    }
    assert_none("chat_messages", panicked);
}

#[test]
fn prompt_datasets_never_panic() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tok = oxrl_models::Tokenizer::from_dir(&repo.join("examples/arithmetic/policy")).unwrap();
    let config =
        "[model]\npath = \"m\"\n[data]\ntrain_files = \"x.jsonl\"\nmax_prompt_length = 64\n";
    let data: DataConfig = RunConfig::from_str(config, Path::new("c.toml"))
        .unwrap()
        .data;
    let file = std::env::temp_dir().join(format!("oxrl-mutated-rows-{}.jsonl", std::process::id()));
    let panicked = survive("prompt_rows", 600, |text| {
        std::fs::write(&file, text).unwrap();
        let _ = load_prompts(&[&file], &data, &tok, None);
    });
    let _ = std::fs::remove_file(&file);
    assert_none("prompt_rows", panicked);
}
