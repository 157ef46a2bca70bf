//! A table of bad inputs for every command: missing and unreadable files, malformed
//! TOML/JSONL/JSON, non-UTF-8, wrong types and ranges, empty datasets, out-of-range token ids,
//! truncated or corrupted safetensors, a config.json whose shapes disagree with the weights,
//! NaN weights, a non-image image, absurd numbers, an output path that is a file or cannot be
//! written. Each must end with a non-zero exit, an `error:` line naming what was wrong, no
//! panic, and no output file or checkpoint left behind.

use candle_core::{Device, Tensor};
use oxrl_fixtures::temp_dir;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// A copy of the arithmetic demo's policy (a tiny Qwen3 with a tokenizer), changed by `edit`.
fn policy_variant(root: &Path, name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let from = repo().join("examples/arithmetic/policy");
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&from).unwrap().flatten() {
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    edit(&dir);
    dir
}

/// One bad invocation: its arguments, the text its error must contain, and the paths that
/// must not exist afterwards.
struct Case {
    name: &'static str,
    args: Vec<String>,
    expect: Vec<&'static str>,
    absent: Vec<PathBuf>,
}

fn case<A: AsRef<str>>(name: &'static str, args: &[A], expect: &[&'static str]) -> Case {
    Case {
        name,
        args: args.iter().map(|a| a.as_ref().to_string()).collect(),
        expect: expect.to_vec(),
        absent: Vec::new(),
    }
}

/// A training config over `model` and `data` writing to `out`, with `extra` TOML appended.
fn train_config(dir: &Path, name: &str, model: &Path, data: &Path, extra: &str) -> PathBuf {
    let text = format!(
        "[model]\npath = \"{}\"\n[data]\ntrain_files = \"{}\"\nprompt_key = \"prompt\"\n\
         [rollout]\nn_samples_per_prompt = 2\nmax_new_tokens = 3\n\
         [[reward.functions]]\ntype = \"math_answer\"\nname = \"correct\"\n\
         [trainer]\nbatch_size = 2\nmax_steps = 1\nsave_every = 1\n{extra}",
        s(model),
        s(data)
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn sft_config(dir: &Path, name: &str, model: &Path, data: &Path) -> PathBuf {
    let text = format!(
        "[model]\npath = \"{}\"\n[data]\ntrain_files = \"{}\"\nprompt_key = \"messages\"\n\
         [trainer]\nbatch_size = 2\nmax_steps = 1\n",
        s(model),
        s(data)
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn every_command_turns_bad_input_into_one_error_line() {
    let dir = temp_dir("bad-inputs");
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let good = repo().join("examples/arithmetic/policy");
    let prompts = repo().join("examples/arithmetic/data/prompts.jsonl");
    let chats = repo().join("examples/arithmetic/data/sft.jsonl");

    let truncated = policy_variant(&dir, "truncated", |d| {
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    });
    let corrupt = policy_variant(&dir, "corrupt", |d| {
        let p = d.join("model.safetensors");
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&p, bytes).unwrap();
    });
    let misshapen = policy_variant(&dir, "misshapen", |d| {
        let p = d.join("config.json");
        let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        let h = c["hidden_size"].as_u64().unwrap();
        c["hidden_size"] = (h * 2).into();
        std::fs::write(&p, c.to_string()).unwrap();
    });
    let bad_json = policy_variant(&dir, "bad-json", |d| {
        std::fs::write(d.join("config.json"), "{\"hidden_size\": ").unwrap();
    });
    let nan = policy_variant(&dir, "nan", |d| {
        let p = d.join("model.safetensors");
        let mut tensors = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
        let name = tensors
            .keys()
            .find(|k| k.ends_with("norm.weight"))
            .unwrap()
            .clone();
        let t = &tensors[&name];
        let poisoned = Tensor::full(f32::NAN, t.shape(), &Device::Cpu).unwrap();
        tensors.insert(name, poisoned);
        candle_core::safetensors::save(&tensors, &p).unwrap();
    });

    let malformed = write(
        "malformed.jsonl",
        b"{\"prompt_ids\": [1], \"response_ids\": [2]}\n{\"prompt_ids\": [1\n",
    );
    let non_utf8 = write(
        "latin1.jsonl",
        b"{\"prompt\": \"caf\xe9\", \"response\": \"x\"}\n",
    );
    let wrong_type = write(
        "type.jsonl",
        b"{\"prompt_ids\": \"abc\", \"response_ids\": [2]}\n",
    );
    let out_of_vocab = write(
        "vocab.jsonl",
        b"{\"prompt_ids\": [1, 99999999], \"response_ids\": [2]}\n",
    );
    let empty = write("empty.jsonl", b"");
    let ids = write(
        "ids.jsonl",
        b"{\"prompt_ids\": [1, 2], \"response_ids\": [3]}\n",
    );
    let no_answer = write(
        "noanswer.jsonl",
        b"{\"prompt\": \"1+1=\"}\n{\"prompt\": \"1+2=\"}\n",
    );
    let not_chat = write("notchat.jsonl", b"{\"messages\": \"hello\"}\n");
    // Longer than the policy's 128 positions.
    let long_chat = write(
        "long.jsonl",
        format!(
            "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}, \
             {{\"role\": \"assistant\", \"content\": \"2\"}}]}}\n",
            "1+1=".repeat(100)
        )
        .as_bytes(),
    );
    let not_image = write("not-an-image.png", b"this is text, not a PNG");
    let a_file = write("a-file", b"x");
    let absent = dir.join("absent.jsonl");
    let out = dir.join("out.jsonl");
    let run = dir.join("run");

    let bad_toml = write("bad.toml", b"[model]\npath = \"x\"\n[trainer\nlr = 1\n");
    let latin1_toml = write("latin1.toml", b"[model]\npath = \"caf\xe9\"\n");
    let cfg = |name: &'static str, extra: &str| train_config(&dir, name, &good, &prompts, extra);
    let wrong_lr = cfg("wrong-lr", "lr = \"fast\"\n");
    let negative_lr = cfg("negative-lr", "lr = -1.0\n");
    let huge_group = train_config(&dir, "huge-group", &good, &prompts, "");
    std::fs::write(
        &huge_group,
        std::fs::read_to_string(&huge_group).unwrap().replace(
            "n_samples_per_prompt = 2",
            "n_samples_per_prompt = 10000000000",
        ),
    )
    .unwrap();
    let empty_data = train_config(&dir, "empty-data", &good, &empty, "");
    let missing_data = train_config(&dir, "missing-data", &good, &absent, "");
    let malformed_data = train_config(&dir, "malformed-data", &good, &malformed, "");
    let no_answer_data = train_config(&dir, "no-answer", &good, &no_answer, "");
    let truncated_model = train_config(&dir, "truncated-model", &truncated, &prompts, "");
    let output_is_file = train_config(
        &dir,
        "output-file",
        &good,
        &prompts,
        &format!("output_dir = \"{}\"\n", s(&a_file)),
    );
    let sft_empty = sft_config(&dir, "sft-empty", &good, &empty);
    let sft_not_chat = sft_config(&dir, "sft-notchat", &good, &not_chat);
    let sft_misshapen = sft_config(&dir, "sft-misshapen", &misshapen, &chats);
    let sft_long = sft_config(&dir, "sft-long", &good, &long_chat);

    let score = |model: &Path, input: &Path| -> Vec<String> {
        [
            "score",
            "--model",
            &s(model),
            "--input",
            &s(input),
            "--output",
            &s(&out),
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    };
    let with_adapter = |adapter: &Path| -> Vec<String> {
        let mut args = score(&good, &ids);
        args.extend(["--adapter".to_string(), s(adapter)]);
        args
    };
    let mut cases = vec![
        case(
            "score: missing input",
            &score(&good, &absent),
            &["absent.jsonl"],
        ),
        case(
            "score: missing adapter",
            &with_adapter(&dir.join("no-adapter")),
            &["no-adapter/adapter_config.json"],
        ),
        case(
            "score: an adapter of another kind",
            &with_adapter(&{
                let adapter = dir.join("ia3-adapter");
                std::fs::create_dir_all(&adapter).unwrap();
                std::fs::write(
                    adapter.join("adapter_config.json"),
                    "{\"peft_type\": \"IA3\", \"r\": 4}",
                )
                .unwrap();
                adapter
            }),
            &["adapter_config.json", "peft_type", "LORA"],
        ),
        case(
            "export: an adapter without --merge",
            &[
                "export",
                "--model",
                &s(&good),
                "--adapter",
                &s(&dir.join("no-adapter")),
                "--output",
                &s(&run),
            ],
            &["--merge"],
        ),
        case(
            "score: a directory as input",
            &score(&good, &dir),
            &["bad-inputs"],
        ),
        case(
            "score: malformed JSONL",
            &score(&good, &malformed),
            &["malformed.jsonl:2"],
        ),
        case(
            "score: non-UTF-8",
            &score(&good, &non_utf8),
            &["latin1.jsonl", "UTF-8"],
        ),
        case(
            "score: wrong type",
            &score(&good, &wrong_type),
            &["type.jsonl:1", "prompt_ids"],
        ),
        case(
            "score: token id out of range",
            &score(&good, &out_of_vocab),
            &["vocab.jsonl:1", "99999999"],
        ),
        case(
            "score: empty input",
            &score(&good, &empty),
            &["empty.jsonl"],
        ),
        case(
            "score: truncated safetensors",
            &score(&truncated, &ids),
            &["truncated", "model.safetensors"],
        ),
        case(
            "score: corrupted safetensors",
            &score(&corrupt, &ids),
            &["corrupt", "model.safetensors"],
        ),
        case(
            "score: shapes disagree",
            &score(&misshapen, &ids),
            &["misshapen", "shape"],
        ),
        case(
            "score: malformed config.json",
            &score(&bad_json, &ids),
            &["bad-json", "config.json"],
        ),
        case(
            "score: NaN weights",
            &score(&nan, &ids),
            &["ids.jsonl:1", "non-finite"],
        ),
        case(
            "score: output under a file",
            &[
                "score",
                "--model",
                &s(&good),
                "--input",
                &s(&ids),
                "--output",
                &s(&a_file.join("out.jsonl")),
            ],
            &["a-file"],
        ),
        case(
            "generate: absurd n",
            &[
                "generate",
                "--model",
                &s(&good),
                "--prompt",
                "1+1=",
                "--n",
                "10000000000",
                "--output",
                &s(&out),
            ],
            &["at most 4096"],
        ),
        case(
            "generate: NaN weights",
            &[
                "generate",
                "--model",
                &s(&nan),
                "--prompt",
                "1+1=",
                "--output",
                &s(&out),
            ],
            &["nan", "not finite"],
        ),
        case(
            "generate: n not a number",
            &[
                "generate",
                "--model",
                &s(&good),
                "--prompt",
                "1+1=",
                "--n",
                "1e10",
            ],
            &["--n"],
        ),
        case(
            "generate: malformed input",
            &[
                "generate",
                "--model",
                &s(&good),
                "--input",
                &s(&malformed),
                "--output",
                &s(&out),
            ],
            &["malformed.jsonl:2"],
        ),
        case(
            "generate: a non-image image",
            &[
                "generate",
                "--model",
                &s(&repo().join("examples/shapes/policy")),
                "--chat",
                "--prompt",
                "hi",
                "--image",
                &s(&not_image),
            ],
            &["not-an-image.png"],
        ),
        case(
            "train: missing config",
            &["train", "--config", &s(&absent)],
            &["absent.jsonl"],
        ),
        case(
            "train: malformed TOML",
            &["train", "--config", &s(&bad_toml)],
            &["bad.toml:3"],
        ),
        case(
            "train: non-UTF-8 TOML",
            &["train", "--config", &s(&latin1_toml)],
            &["latin1.toml", "UTF-8"],
        ),
        case(
            "train: wrong type",
            &["train", "--config", &s(&wrong_lr)],
            &["wrong-lr.toml:16", "lr"],
        ),
        case(
            "train: out of range",
            &["train", "--config", &s(&negative_lr)],
            &["negative-lr.toml:16", "lr"],
        ),
        case(
            "train: absurd group size",
            &["train", "--config", &s(&huge_group)],
            &["huge-group.toml:7", "n_samples_per_prompt"],
        ),
        case(
            "train: empty dataset",
            &[
                "train",
                "--config",
                &s(&empty_data),
                "--output-dir",
                &s(&run),
            ],
            &["empty.jsonl"],
        ),
        case(
            "train: missing dataset",
            &[
                "train",
                "--config",
                &s(&missing_data),
                "--output-dir",
                &s(&run),
            ],
            &["absent.jsonl"],
        ),
        case(
            "train: malformed dataset",
            &[
                "train",
                "--config",
                &s(&malformed_data),
                "--output-dir",
                &s(&run),
            ],
            &["malformed.jsonl:2"],
        ),
        case(
            "train: no answer column",
            &[
                "train",
                "--config",
                &s(&no_answer_data),
                "--output-dir",
                &s(&run),
            ],
            &["noanswer.jsonl:1", "`answer`", "correct"],
        ),
        case(
            "train: truncated weights",
            &[
                "train",
                "--config",
                &s(&truncated_model),
                "--output-dir",
                &s(&run),
            ],
            &["model.safetensors"],
        ),
        case(
            "train: output dir is a file",
            &["train", "--config", &s(&output_is_file)],
            &["a-file"],
        ),
        case(
            "train: malformed rollouts",
            &[
                "train",
                "--config",
                &s(&cfg("replay", "")),
                "--rollouts",
                &s(&malformed),
                "--output-dir",
                &s(&run),
            ],
            &["malformed.jsonl:"],
        ),
        case(
            "sft: empty dataset",
            &["sft", "--config", &s(&sft_empty), "--output-dir", &s(&run)],
            &["empty.jsonl"],
        ),
        case(
            "sft: messages not a list",
            &[
                "sft",
                "--config",
                &s(&sft_not_chat),
                "--output-dir",
                &s(&run),
            ],
            &["notchat.jsonl:1", "messages"],
        ),
        case(
            "sft: shapes disagree",
            &[
                "sft",
                "--config",
                &s(&sft_misshapen),
                "--output-dir",
                &s(&run),
            ],
            &["misshapen", "shape"],
        ),
        case(
            "sft: every conversation too long",
            &["sft", "--config", &s(&sft_long), "--output-dir", &s(&run)],
            &["long.jsonl", "128 positions"],
        ),
        case(
            "config: malformed TOML",
            &["config", "--check", &s(&bad_toml)],
            &["bad.toml:3"],
        ),
        case(
            "config: missing file",
            &["config", "--check", &s(&absent)],
            &["absent.jsonl"],
        ),
    ];
    for c in &mut cases {
        c.absent.push(out.clone());
        c.absent.push(run.join("checkpoint-1"));
    }
    let mut failures = Vec::new();
    for c in &cases {
        let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
            .args(&c.args)
            .env("HF_HUB_OFFLINE", "1")
            .current_dir(&dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&r.stderr);
        let last = err.trim_end().lines().last().unwrap_or_default();
        let mut wrong = Vec::new();
        if r.status.success() {
            wrong.push("exit 0".to_string());
        }
        if err.contains("panicked") || r.status.code() == Some(101) {
            wrong.push("panicked".into());
        }
        let clap_usage = err.starts_with("error: ") && r.status.code() == Some(2);
        if !last.starts_with("error: ") && !clap_usage {
            wrong.push("no `error:` line at the end".into());
        }
        if last.matches("(os error").count() > 1 {
            wrong.push("repeats a cause".into());
        }
        for want in &c.expect {
            if !err.contains(want) {
                wrong.push(format!("does not mention {want:?}"));
            }
        }
        for p in &c.absent {
            if p.exists() {
                wrong.push(format!("left {}", p.display()));
                let _ = std::fs::remove_file(p);
                let _ = std::fs::remove_dir_all(p);
            }
        }
        if !wrong.is_empty() {
            failures.push(format!(
                "{}: {}\n  stderr: {}",
                c.name,
                wrong.join("; "),
                err.trim_end()
            ));
        }
        let _ = std::fs::remove_dir_all(&run);
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    std::fs::remove_dir_all(&dir).unwrap();
}
