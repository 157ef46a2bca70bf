//! `oxrl export --format onnx|gguf` checked by the runtimes that deploy those files, not by
//! oxrl reading its own output: onnxruntime (pinned in the venv `.ci/python-env` makes) runs the
//! ONNX export — logits within 1e-4 of transformers' on qwen3-tiny, log-probs within 1e-4 of
//! `oxrl score`, greedy decoding through the exported KV cache (alone and in a left-padded
//! batch) equal to `oxrl generate`'s; onnxruntime-genai generates from the export directory as
//! written (its config, tokenizer and chat template) as `oxrl generate` does; the `gguf` package
//! (llama.cpp's reader) reads every GGUF tensor back as exactly the weight in its encoding; and
//! llama.cpp's own library greedily decodes the GGUF as `oxrl generate` does.

use candle_core::{DType, Device};
use oxrl_fixtures::{fixture, ids, jsonl, peer_python, repo, temp_dir};
use serde_json::{json, Value};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn oxrl(args: &[&str]) -> String {
    let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        r.status.success(),
        "oxrl {args:?}: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8(r.stdout).unwrap()
}

/// `oxrl export --model M --format F --dtype D --output O`; what it printed.
fn export(model: &Path, format: &str, dtype: &str, output: &Path) -> String {
    oxrl(&[
        "export",
        "--model",
        s(model),
        "--format",
        format,
        "--dtype",
        dtype,
        "--output",
        s(output),
    ])
}

/// Runs `crates/oxrl/tests/peers/<script>` with `args` and `stdin`; its stdout as JSON.
fn peer(script: &str, args: &[&str], stdin: &Value) -> Value {
    let mut child = Command::new(peer_python())
        .arg(repo().join("crates/oxrl/tests/peers").join(script))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.to_string().as_bytes())
        .unwrap();
    let r = child.wait_with_output().unwrap();
    assert!(
        r.status.success(),
        "{script} {args:?}: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    serde_json::from_slice(&r.stdout).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    oxrl_fixtures::floats(v)
}

/// `oxrl score`'s log-probs of `cases` (JSONL with `prompt_ids` and `response_ids`).
fn oxrl_logprobs(model: &Path, cases: &Path) -> Vec<Vec<f64>> {
    oxrl(&["score", "--model", s(model), "--input", s(cases)])
        .lines()
        .map(|l| floats(&serde_json::from_str::<Value>(l).unwrap()["logprobs"]))
        .collect()
}

/// `oxrl generate`'s greedy continuations of `prompts` (eos ignored).
fn oxrl_greedy_all(model: &Path, prompts: &[Vec<u32>], n: usize, dir: &Path) -> Vec<Vec<u32>> {
    let input = dir.join("greedy-prompts.jsonl");
    let lines: String = prompts
        .iter()
        .map(|p| json!({"prompt_ids": p}).to_string() + "\n")
        .collect();
    std::fs::write(&input, lines).unwrap();
    let n = n.to_string();
    let out = oxrl(&[
        "generate",
        "--model",
        s(model),
        "--input",
        s(&input),
        "--temperature",
        "0",
        "--max-new-tokens",
        &n,
        "--ignore-eos",
    ]);
    let mut by_index: Vec<(u64, Vec<u32>)> = out
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["index"].as_u64().unwrap(), ids(&v["response_ids"]))
        })
        .collect();
    by_index.sort_by_key(|(i, _)| *i);
    by_index.into_iter().map(|(_, r)| r).collect()
}

/// `oxrl generate`'s greedy continuation of `prompt` (eos ignored).
fn oxrl_greedy(model: &Path, prompt: &[u32], n: usize, dir: &Path) -> Vec<u32> {
    oxrl_greedy_all(model, &[prompt.to_vec()], n, dir).remove(0)
}

fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f64::max)
}

/// The text fixture's scoring cases without their temperatures (a deployment scores at 1).
fn fixture_cases(dir: &Path) -> (Vec<Value>, std::path::PathBuf) {
    let cases: Vec<Value> = jsonl(&fixture("qwen3-tiny").join("cases.jsonl"))
        .iter()
        .map(|c| json!({"prompt_ids": c["prompt_ids"], "response_ids": c["response_ids"]}))
        .collect();
    let path = dir.join("cases.jsonl");
    let text: String = cases.iter().map(|c| c.to_string() + "\n").collect();
    std::fs::write(&path, text).unwrap();
    (cases, path)
}

#[test]
fn onnxruntime_runs_the_onnx_export_as_transformers_and_oxrl_do() {
    let dir = temp_dir("export-onnx-f32");
    let model = fixture("qwen3-tiny");
    let onnx = dir.join("onnx");
    let said = export(&model, "onnx", "f32", &onnx);
    assert!(said.contains("3 decoder layers"), "{said}");
    for file in [
        "model.onnx",
        "model.onnx.data",
        "config.json",
        "generation_config.json",
    ] {
        assert!(onnx.join(file).exists(), "{file} missing from the export");
    }

    let expected = candle_core::safetensors::load(
        fixture("qwen3-tiny").join("expected.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let logits_ids: Vec<i64> = expected["input_ids"].to_vec1::<i64>().unwrap();
    let (cases, cases_path) = fixture_cases(&dir);
    let greedy: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3-tiny").join("greedy.json")).unwrap(),
    )
    .unwrap();
    let short_prompt: Vec<u32> = ids(&cases[1]["prompt_ids"]);
    let request = json!({
        "model": onnx,
        "logits_ids": logits_ids,
        "cases": cases,
        "greedy": [
            {"prompt_ids": greedy["prompt_ids"], "max_new_tokens": 24},
            {"prompt_ids": short_prompt, "max_new_tokens": 12},
        ],
        "batch_new_tokens": 12,
    });
    let out = peer("onnx_decoder.py", &[], &request);

    // Logits of the fixture's case 0 against transformers'.
    let reference: Vec<Vec<f32>> = expected["logits"]
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec2()
        .unwrap();
    let ours: Vec<Vec<f64>> = out["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let reference: Vec<Vec<f64>> = reference
        .iter()
        .map(|row| row.iter().map(|x| *x as f64).collect())
        .collect();
    let worst = max_abs_diff(&ours, &reference);
    assert!(
        worst <= 1e-4,
        "ONNX logits vs transformers: max |Δ| {worst}"
    );

    // Log-probs of every case against `oxrl score`.
    let theirs: Vec<Vec<f64>> = out["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let worst = max_abs_diff(&theirs, &oxrl_logprobs(&model, &cases_path));
    assert!(
        worst <= 1e-4,
        "ONNX log-probs vs oxrl score: max |Δ| {worst}"
    );

    // Greedy decoding through the KV cache: transformers' 24 tokens, and `oxrl generate`'s.
    let decoded: Vec<Vec<u32>> = out["greedy"].as_array().unwrap().iter().map(ids).collect();
    assert_eq!(
        decoded[0],
        ids(&greedy["expected_ids"]),
        "greedy vs transformers"
    );
    assert_eq!(
        decoded[0],
        oxrl_greedy(&model, &ids(&greedy["prompt_ids"]), 24, &dir)
    );
    assert_eq!(decoded[1], oxrl_greedy(&model, &short_prompt, 12, &dir));
    // The two prompts left-padded into one batch decode as they do alone.
    let batch: Vec<Vec<u32>> = out["batch_greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    assert_eq!(batch[0], decoded[0][..12].to_vec(), "padded batch row 0");
    assert_eq!(batch[1], decoded[1], "padded batch row 1");
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(floats).collect()
}

fn tensor_rows(t: &candle_core::Tensor) -> Vec<Vec<f64>> {
    let rows: Vec<Vec<f32>> = t.to_dtype(DType::F32).unwrap().to_vec2().unwrap();
    rows.iter()
        .map(|r| r.iter().map(|x| *x as f64).collect())
        .collect()
}

/// Qwen3-VL: the vision graph, run once per image of the fixture's case 0 on its pixel rows,
/// gives transformers' image embeddings and DeepStack features; the decoder fed them with the
/// MRoPE positions gives transformers' logits (each within 1e-4), and greedy decoding through
/// the KV cache continues the case as `oxrl generate` does from its images.
#[test]
fn onnxruntime_runs_the_qwen3_vl_export_with_its_vision_graph() {
    let dir = temp_dir("export-onnx-vl");
    let model = fixture("qwen3-vl-tiny");
    let onnx = dir.join("onnx");
    let said = export(&model, "onnx", "f32", &onnx);
    assert!(said.contains("vision.onnx"), "{said}");
    for file in [
        "vision.onnx",
        "vision.onnx.data",
        "preprocessor_config.json",
    ] {
        assert!(onnx.join(file).exists(), "{file} missing from the export");
    }
    let expected =
        candle_core::safetensors::load(model.join("expected.safetensors"), &Device::Cpu).unwrap();
    let grids: Vec<Vec<i64>> = expected["image_grid_thw"].to_vec2().unwrap();
    let positions: Vec<Vec<i64>> = expected["position_ids"].to_vec2().unwrap();
    let request = json!({
        "model": onnx,
        "pixel_values": tensor_rows(&expected["pixel_values"]),
        "grids": grids,
        "input_ids": expected["input_ids"].to_vec1::<i64>().unwrap(),
        "position_ids": positions,
        "max_new_tokens": 8,
    });
    let out = peer("onnx_vl.py", &[], &request);
    let close = |ours: Vec<Vec<f64>>, name: &str| {
        let worst = max_abs_diff(&ours, &tensor_rows(&expected[name]));
        assert!(
            worst <= 1e-4,
            "ONNX {name} vs transformers: max |Δ| {worst}"
        );
    };
    close(rows(&out["image_embeds"]), "image_embeds");
    let deepstack = out["deepstack_embeds"].as_array().unwrap();
    assert_eq!(deepstack.len(), 2);
    for (k, feature) in deepstack.iter().enumerate() {
        close(rows(feature), &format!("deepstack_features.{k}"));
    }
    close(rows(&out["logits"]), "logits");

    // The same sequence in the compact form `oxrl generate` reads, with its image files.
    let case = &jsonl(&model.join("cases.jsonl"))[0];
    let mut prompt = ids(&case["prompt_ids"]);
    prompt.extend(ids(&case["response_ids"]));
    let images: Vec<String> = case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| model.join(i.as_str().unwrap()).display().to_string())
        .collect();
    let input = dir.join("vl-prompt.jsonl");
    std::fs::write(
        &input,
        json!({"prompt_ids": prompt, "images": images}).to_string(),
    )
    .unwrap();
    let generated = oxrl(&[
        "generate",
        "--model",
        s(&model),
        "--input",
        s(&input),
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
    ]);
    let oxrl_ids = ids(&serde_json::from_str::<Value>(&generated).unwrap()["response_ids"]);
    assert_eq!(
        ids(&out["greedy"]),
        oxrl_ids,
        "greedy through the ONNX KV cache vs oxrl generate"
    );
}

#[test]
fn half_precision_onnx_exports_match_oxrl_on_the_same_rounded_weights() {
    let dir = temp_dir("export-onnx-half");
    let model = fixture("qwen3-tiny");
    let (cases, cases_path) = fixture_cases(&dir);
    let f32_bytes = std::fs::metadata(fixture("qwen3-tiny").join("model.safetensors"))
        .unwrap()
        .len();
    for dtype in ["f16", "bf16"] {
        let onnx = dir.join(format!("onnx-{dtype}"));
        let hf = dir.join(format!("hf-{dtype}"));
        export(&model, "onnx", dtype, &onnx);
        export(&model, "hf", dtype, &hf);
        let data = std::fs::metadata(onnx.join("model.onnx.data"))
            .unwrap()
            .len();
        assert!(
            data < f32_bytes * 55 / 100,
            "{dtype}: {data} bytes of weights; the f32 checkpoint has {f32_bytes}"
        );
        let request = json!({"model": onnx, "logits_ids": [1, 2, 3], "cases": cases,
                             "greedy": [], "batch_new_tokens": 0});
        let out = peer("onnx_decoder.py", &[], &request);
        let theirs: Vec<Vec<f64>> = out["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(floats)
            .collect();
        // `oxrl score` computes in f32 on the checkpoint rounded to the same dtype.
        let worst = max_abs_diff(&theirs, &oxrl_logprobs(&hf, &cases_path));
        assert!(
            worst <= 1e-4,
            "{dtype} ONNX vs oxrl score on {dtype} weights: max |Δ| {worst}"
        );
    }
}

/// The arithmetic demo's policy: a Qwen3 with a real (byte-level BPE) tokenizer and tied
/// embeddings, trained, so greedy decoding has clear winners.
fn demo_policy() -> std::path::PathBuf {
    repo().join("examples/arithmetic/policy")
}

/// The Hugging Face name of a GGUF tensor of the demo policy (tied: no `output.weight`).
fn hf_name(gguf: &str) -> String {
    let parts: Vec<&str> = gguf.split('.').collect();
    let layer_part = |p: &str| match p {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => panic!("unexpected GGUF tensor {other}"),
    };
    match parts.as_slice() {
        ["token_embd", "weight"] => "model.embed_tokens.weight".into(),
        ["output_norm", "weight"] => "model.norm.weight".into(),
        ["blk", layer, part, "weight"] => {
            format!("model.layers.{layer}.{}.weight", layer_part(part))
        }
        _ => panic!("unexpected GGUF tensor {gguf}"),
    }
}

/// onnxruntime-genai runs the export directory as written: `og.Model` reads its
/// genai_config.json, `og.Tokenizer` renders the chat template and tokenizes as oxrl does, and
/// its greedy generator (one prompt at a time, and all of them as one batch padded by its
/// tokenizer) gives `oxrl generate`'s tokens up to and including the end token it stops at.
#[test]
fn onnxruntime_genai_generates_from_the_onnx_export_as_oxrl_does() {
    let dir = temp_dir("export-onnx-genai");
    let policy = demo_policy();
    let onnx = dir.join("onnx");
    export(&policy, "onnx", "f32", &onnx);
    let questions = ["12+34=", "7+5=", "40+21="];
    let request = json!({"model": onnx, "questions": questions, "max_new_tokens": 12});
    let out = peer("onnx_genai.py", &[], &request);

    let tokenizer = oxrl_models::Tokenizer::from_dir(&policy).unwrap();
    let eos = tokenizer.eos_token_id.unwrap();
    let results = out["results"].as_array().unwrap();
    let mut prompts = Vec::new();
    for (question, result) in questions.iter().zip(results) {
        let messages = json!([{"role": "user", "content": question}]);
        let rendered = tokenizer
            .apply_chat_template(&messages, true, &Default::default())
            .unwrap();
        assert_eq!(result["prompt"], rendered.as_str(), "chat template");
        let prompt = ids(&result["prompt_ids"]);
        assert_eq!(prompt, tokenizer.encode(&rendered).unwrap(), "{rendered:?}");
        prompts.push(prompt);
    }
    // `oxrl generate` past the end token, cut after it: what stopping there gives.
    let reference: Vec<Vec<u32>> = oxrl_greedy_all(&policy, &prompts, 12, &dir)
        .into_iter()
        .map(|mut r| {
            if let Some(end) = r.iter().position(|&t| t == eos) {
                r.truncate(end + 1);
            }
            r
        })
        .collect();
    assert!(
        reference.iter().any(|r| r.last() == Some(&eos)),
        "the demo policy ends its answers: {reference:?}"
    );
    for (result, expected) in results.iter().zip(&reference) {
        assert_eq!(&ids(&result["new_ids"]), expected, "{}", result["prompt"]);
        let answer: Vec<u32> = expected.iter().copied().filter(|&t| t != eos).collect();
        assert_eq!(
            result["text"],
            tokenizer.decode(&answer, true).unwrap().as_str()
        );
    }
    let batch: Vec<Vec<u32>> = out["batch"].as_array().unwrap().iter().map(ids).collect();
    assert_eq!(batch, reference, "the prompts as one padded batch");
}

#[test]
fn the_gguf_package_reads_back_every_weight_in_its_encoding() {
    let dir = temp_dir("export-gguf-read");
    let policy = demo_policy();
    let weights =
        candle_core::safetensors::load(policy.join("model.safetensors"), &Device::Cpu).unwrap();
    let tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(policy.join("tokenizer.json")).unwrap())
            .unwrap();
    for (dtype, matrix_type) in [
        ("f32", "F32"),
        ("f16", "F16"),
        ("bf16", "BF16"),
        ("q8_0", "Q8_0"),
    ] {
        let file = dir.join(format!("policy-{dtype}.gguf"));
        export(&policy, "gguf", dtype, &file);
        let out = peer("gguf_read.py", &[s(&file)], &Value::Null);
        let meta = &out["metadata"];
        assert_eq!(meta["general.architecture"], "qwen3");
        assert_eq!(meta["qwen3.block_count"], 2);
        assert_eq!(meta["qwen3.embedding_length"], 64);
        assert_eq!(meta["qwen3.feed_forward_length"], 192);
        assert_eq!(meta["qwen3.attention.head_count"], 4);
        assert_eq!(meta["qwen3.attention.head_count_kv"], 2);
        assert_eq!(meta["qwen3.attention.key_length"], 16);
        assert_eq!(meta["qwen3.rope.freq_base"], 10000.0);
        assert!(
            (meta["qwen3.attention.layer_norm_rms_epsilon"]
                .as_f64()
                .unwrap()
                - 1e-6)
                .abs()
                < 1e-12
        );
        assert_eq!(meta["tokenizer.ggml.model"], "gpt2");
        assert_eq!(meta["tokenizer.ggml.eos_token_id"], 258);
        let tokens = meta["tokenizer.ggml.tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), 272, "one token per row of the embedding");
        for (token, id) in tokenizer["model"]["vocab"].as_object().unwrap() {
            assert_eq!(tokens[id.as_u64().unwrap() as usize], *token);
        }
        assert_eq!(tokens[258], "<|im_end|>");
        assert_eq!(tokens[271], "[PAD271]");
        assert!(meta["tokenizer.chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>"));

        let tensors = out["tensors"].as_object().unwrap();
        assert_eq!(
            tensors.len(),
            2 + 2 * 11,
            "embeddings, final norm, 11 per layer; tied head"
        );
        for (name, t) in tensors {
            let hf = weights[&hf_name(name)]
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let shape: Vec<usize> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(shape, weights[&hf_name(name)].dims(), "{name}");
            let got: Vec<f32> = floats(&t["values"]).iter().map(|x| *x as f32).collect();
            let expected_type = if shape.len() == 1 { "F32" } else { matrix_type };
            assert_eq!(t["type"], expected_type, "{dtype}: {name}");
            match expected_type {
                "F32" => assert_eq!(got, hf, "{name}"),
                "F16" => {
                    let rounded: Vec<f32> = hf
                        .iter()
                        .map(|x| half::f16::from_f32(*x).to_f32())
                        .collect();
                    assert_eq!(got, rounded, "{name}");
                }
                "BF16" => {
                    let rounded: Vec<f32> = hf
                        .iter()
                        .map(|x| half::bf16::from_f32(*x).to_f32())
                        .collect();
                    assert_eq!(got, rounded, "{name}");
                }
                _ => {
                    // Q8_0 as ggml's reference quantizer defines it: per block of 32, the
                    // scale d = max|x|/127 stored as f16, each value round(x/d) as an int8.
                    for (block, (g, w)) in got.chunks(32).zip(hf.chunks(32)).enumerate() {
                        let d = w.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
                        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                        let d16 = half::f16::from_f32(d).to_f32();
                        for (a, x) in g.iter().zip(w) {
                            let q = (x * inv).round();
                            assert!((-127.0..=127.0).contains(&q));
                            assert_eq!(*a, q * d16, "{name} block {block}: {x}");
                            assert!(
                                (a - x).abs() <= d * 0.57,
                                "{name} block {block}: {a} vs {x}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn llama_cpp_decodes_the_gguf_export_as_oxrl_does() {
    let dir = temp_dir("export-gguf-llama");
    let policy = demo_policy();
    peer_python();
    let libdir = repo().join(".venv/llama.cpp");
    assert!(
        libdir.join("libllama.v0.5.0.so").exists(),
        "llama.cpp's library is missing from {}: run .ci/python-env",
        libdir.display()
    );
    // Chat prompts the demo was trained on: "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n".
    let tokenizer = oxrl_models::Tokenizer::from_dir(&policy).unwrap();
    let prompts: Vec<Vec<u32>> = ["12+34=", "7+5=", "40+21="]
        .iter()
        .map(|q| {
            tokenizer
                .encode(&format!(
                    "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                ))
                .unwrap()
        })
        .collect();
    let hf16 = dir.join("hf-f16");
    export(&policy, "hf", "f16", &hf16);
    let from_oxrl = oxrl_greedy_all(&policy, &prompts, 12, &dir);
    let from_oxrl_f16 = oxrl_greedy_all(&hf16, &prompts, 12, &dir);
    for (dtype, reference) in [
        ("f32", Some(&from_oxrl)),
        // f16: oxrl decodes the checkpoint rounded to f16 (in f32, as llama.cpp does).
        ("f16", Some(&from_oxrl_f16)),
        ("q8_0", None),
    ] {
        let file = dir.join(format!("policy-{dtype}.gguf"));
        export(&policy, "gguf", dtype, &file);
        let request =
            json!({"libdir": libdir, "gguf": file, "prompts": prompts, "max_new_tokens": 12});
        let llama: Vec<Vec<u32>> = peer("llama_greedy.py", &[], &request)
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        assert_eq!(llama.len(), prompts.len());
        assert!(llama.iter().all(|r| r.len() == 12), "{dtype}: {llama:?}");
        if let Some(reference) = reference {
            assert_eq!(&llama, reference, "{dtype}: llama.cpp vs oxrl generate");
        }
    }
}

#[test]
fn export_refuses_what_a_format_cannot_hold_and_says_why() {
    let dir = temp_dir("export-refusals");
    let run = |args: &[&str]| {
        let r = Command::new(env!("CARGO_BIN_EXE_oxrl"))
            .args(args)
            .output()
            .unwrap();
        assert!(!r.status.success(), "oxrl {args:?} succeeded");
        String::from_utf8_lossy(&r.stderr).to_string()
    };
    let tiny = fixture("qwen3-tiny");
    let vl = fixture("qwen3-vl-tiny");
    let out = dir.join("out");
    let err = run(&[
        "export",
        "--model",
        s(&tiny),
        "--format",
        "onnx",
        "--dtype",
        "q8_0",
        "--output",
        s(&out),
    ]);
    assert!(err.contains("q8_0 is a GGUF encoding"), "{err}");
    // qwen3-tiny has no tokenizer, which a GGUF file must carry.
    let err = run(&[
        "export",
        "--model",
        s(&tiny),
        "--format",
        "gguf",
        "--output",
        s(&dir.join("t.gguf")),
    ]);
    assert!(
        err.contains("tokenizer.json") && err.contains("GGUF carries the tokenizer"),
        "{err}"
    );
    let err = run(&[
        "export",
        "--model",
        s(&vl),
        "--format",
        "gguf",
        "--output",
        s(&dir.join("v.gguf")),
    ]);
    assert!(err.contains("Qwen3-VL"), "{err}");
    // Nothing was left behind under the output names, nor half-written beside them.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
