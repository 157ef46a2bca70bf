//! LoRA on qwen3-tiny and qwen3-vl-tiny: what adapters change and what they leave alone, PEFT's
//! file layout, and their gradients (only the adapters train; layer checkpointing and chunked
//! lm_head give the plain path's gradients). The real PEFT package checks the same files in
//! `crates/oxrl/tests/peft_peer.rs`.

mod common;

use candle_core::{DType, Device, Tensor};
use oxrl_fixtures::{fixture, ids, jsonl, temp_dir};
use oxrl_models::{LoraConfig, LoraInit, Qwen3, ScoreRequest, LORA_TARGETS};
use serde_json::Value;

fn tiny() -> Qwen3 {
    Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap()
}

fn requests() -> Vec<ScoreRequest> {
    jsonl(&fixture("qwen3-tiny/cases.jsonl"))
        .iter()
        .map(|c| ScoreRequest::text(ids(&c["prompt_ids"]), ids(&c["response_ids"]), 1.0))
        .collect()
}

fn config(targets: &[&str]) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        init: LoraInit::Kaiming,
        rslora: false,
    }
}

/// Gives every adapter a non-zero `B` (fresh adapters start at zero and change nothing).
fn perturb(model: &mut Qwen3) {
    for layer in &mut model.model.layers {
        let adapters = layer
            .self_attn
            .lora
            .iter_mut()
            .chain(layer.mlp.lora.iter_mut());
        for (k, adapter) in adapters.flatten().enumerate() {
            let (out, r) = adapter.b.dims2().unwrap();
            let v: Vec<f32> = (0..out * r)
                .map(|i| (((i + k) * 37 % 11) as f32 - 5.0) * 0.02)
                .collect();
            adapter.b = Tensor::from_vec(v, (out, r), &Device::Cpu).unwrap();
        }
    }
}

fn adapted() -> Qwen3 {
    let mut model = tiny();
    model.attach_lora(&config(&LORA_TARGETS), 7).unwrap();
    perturb(&mut model);
    model
}

fn scores(model: &Qwen3) -> Vec<Vec<f32>> {
    model.score_batch(&requests()).unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn adapters_start_as_a_no_op_and_switch_off_to_the_base_model() {
    let base = scores(&tiny());
    let mut model = tiny();
    model.attach_lora(&config(&LORA_TARGETS), 7).unwrap();
    assert_eq!(scores(&model), base, "B starts at zero: nothing changes");
    perturb(&mut model);
    let on = scores(&model);
    assert!(
        max_diff(&on, &base) > 1e-3,
        "a trained B changes the scores"
    );
    model.set_adapters_enabled(false);
    assert_eq!(
        scores(&model),
        base,
        "adapters off: the base model, bit for bit"
    );
    model.set_adapters_enabled(true);
    assert_eq!(scores(&model), on);
    // The engine's KV-cache path applies the adapters too: greedy decoding follows them.
    let detached = model.detached();
    assert_eq!(scores(&detached), on);
    // Merged into the weights, the plain model scores as the adapted one.
    model.merge_adapters().unwrap();
    assert!(model.lora().is_none());
    let merged = scores(&model);
    assert!(max_diff(&merged, &on) < 1e-5, "{}", max_diff(&merged, &on));
}

#[test]
fn only_some_targets_get_adapters() {
    let mut model = tiny();
    model
        .attach_lora(&config(&["q_proj", "down_proj"]), 7)
        .unwrap();
    let names: Vec<String> = model
        .adapter_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let layers = model.model.layers.len();
    assert_eq!(names.len(), layers * 2 * 2);
    assert_eq!(
        names[..4],
        [
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
            "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
        ]
    );
    // PEFT's Kaiming-uniform A: inside ±1/√in, and not all zero.
    let a = model.model.layers[0].self_attn.lora[0].as_ref().unwrap();
    let bound = 1.0 / (model.config.hidden_size as f32).sqrt();
    let values = a.a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(values.iter().all(|v| v.abs() <= bound));
    assert!(values.iter().any(|v| v.abs() > bound / 2.0));
    assert_eq!(
        a.b.dims(),
        &[model.config.num_attention_heads * model.config.head_dim, 4]
    );
}

#[test]
fn an_adapter_round_trips_through_pefts_files() {
    let model = adapted();
    let dir = temp_dir("lora-round-trip");
    let out = dir.join("adapter");
    model.save_adapter(&out, "qwen3-tiny").unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert_eq!(config["target_modules"].as_array().unwrap().len(), 7);
    let stored =
        candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    assert_eq!(stored.len(), model.model.layers.len() * 7 * 2);
    let mut loaded = tiny();
    loaded.load_adapter(&out).unwrap();
    assert_eq!(scores(&loaded), scores(&model));
    assert_eq!(loaded.lora(), model.lora());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Adapters PEFT would apply differently, or that touch what oxrl does not adapt, are refused
/// with the file and the key.
#[test]
fn adapters_oxrl_cannot_apply_are_refused_by_name() {
    let dir = temp_dir("lora-refused");
    let good = dir.join("good");
    adapted().save_adapter(&good, "qwen3-tiny").unwrap();
    let config_text = std::fs::read_to_string(good.join("adapter_config.json")).unwrap();
    let with_config = |name: &str, edit: &dyn Fn(&mut Value)| {
        let out = dir.join(name);
        std::fs::create_dir_all(&out).unwrap();
        std::fs::copy(
            good.join("adapter_model.safetensors"),
            out.join("adapter_model.safetensors"),
        )
        .unwrap();
        let mut v: Value = serde_json::from_str(&config_text).unwrap();
        edit(&mut v);
        std::fs::write(out.join("adapter_config.json"), v.to_string()).unwrap();
        let err = tiny().load_adapter(&out).unwrap_err().to_string();
        assert!(err.contains("adapter_config.json"), "{err}");
        err
    };
    assert!(with_config("dora", &|v| v["use_dora"] = true.into()).contains("use_dora"));
    assert!(with_config("bias", &|v| v["bias"] = "all".into()).contains("bias"));
    assert!(with_config("ia3", &|v| v["peft_type"] = "IA3".into()).contains("peft_type"));
    assert!(with_config("no-r", &|v| v["r"] = Value::Null).contains("`r`"));

    // A module outside the language model's projections (here: the embedding).
    let extra = dir.join("extra");
    let mut tensors: std::collections::HashMap<String, Tensor> =
        candle_core::safetensors::load(good.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    tensors.insert(
        "base_model.model.model.embed_tokens.lora_A.weight".into(),
        Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap(),
    );
    std::fs::create_dir_all(&extra).unwrap();
    candle_core::safetensors::save(&tensors, extra.join("adapter_model.safetensors")).unwrap();
    std::fs::write(extra.join("adapter_config.json"), &config_text).unwrap();
    let err = tiny().load_adapter(&extra).unwrap_err().to_string();
    assert!(err.contains("embed_tokens.lora_A.weight"), "{err}");

    // A rank that does not match the config.
    let mut v: Value = serde_json::from_str(&config_text).unwrap();
    v["r"] = 2.into();
    std::fs::write(good.join("adapter_config.json"), v.to_string()).unwrap();
    let err = tiny().load_adapter(&good).unwrap_err().to_string();
    assert!(
        err.contains("lora_A.weight") && err.contains("[4, 64]"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Only the adapters are trainable; the base weights get no gradient buffers. Layer
/// checkpointing and chunked lm_head give the adapters the plain path's gradients.
#[test]
fn only_adapters_train_and_the_memory_savers_keep_their_gradients() {
    let mut model = adapted();
    let vars = model.make_trainable().unwrap();
    assert_eq!(vars.len(), model.model.layers.len() * 7 * 2);
    assert!(vars
        .iter()
        .all(|(n, _)| n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight")));
    assert!(!model.model.layers[0].self_attn.q_proj.is_variable());
    let out = model
        .response_logprobs(&requests(), oxrl_models::Entropy::None)
        .unwrap();
    let loss = out.logprobs.sum_all().unwrap();
    let grads = out.backward(&loss).unwrap();
    let trained: std::collections::HashSet<_> =
        vars.iter().map(|(_, v)| v.as_tensor().id()).collect();
    // Beside the adapters' gradients the backward leaves those of untracked leaves it met:
    // broadcast norm weights and rotary tables (3-D and up). A frozen weight's gradient, or
    // that of an untracked input to an adapter, would be a 2-D leaf.
    let weight_sized = grads
        .get_ids()
        .filter(|id| !trained.contains(id))
        .filter(|id| grads.get_id(**id).unwrap().dims().len() == 2)
        .count();
    assert_eq!(weight_sized, 0, "a frozen weight got a gradient buffer");
    for (name, var) in &vars {
        assert!(grads.get(var.as_tensor()).is_some(), "{name}: no gradient");
    }
    common::assert_memory_savers_match(adapted, &requests());
}

fn adapted_with_dropout() -> Qwen3 {
    let mut model = tiny();
    let lora = LoraConfig {
        dropout: 0.3,
        ..config(&LORA_TARGETS)
    };
    model.attach_lora(&lora, 7).unwrap();
    perturb(&mut model);
    model
}

/// LoRA dropout acts in the training forward only, draws new masks per forward, and the
/// checkpointed backward replays the forward's masks (its gradients stay bit-identical).
#[test]
fn dropout_acts_only_while_training_and_checkpointing_replays_its_masks() {
    let mut model = adapted_with_dropout();
    assert_eq!(
        scores(&model),
        scores(&adapted()),
        "scoring is eval mode: no dropout"
    );
    model.make_trainable().unwrap();
    let train = |m: &Qwen3| {
        let out = m
            .response_logprobs(&requests(), oxrl_models::Entropy::None)
            .unwrap();
        out.logprobs.to_vec1::<f32>().unwrap()
    };
    let (first, second) = (train(&model), train(&model));
    let eval: Vec<f32> = scores(&model).concat();
    let differ = |a: &[f32], b: &[f32]| a.iter().zip(b).any(|(x, y)| (x - y).abs() > 1e-4);
    assert!(differ(&first, &eval), "no dropout in the training forward");
    assert!(
        differ(&first, &second),
        "the second forward reused the masks"
    );
    common::assert_memory_savers_match(adapted_with_dropout, &requests());
}

#[test]
fn a_vision_language_model_adapts_its_language_model_under_pefts_names() {
    let mut model = Qwen3::load(&fixture("qwen3-vl-tiny"), DType::F32, &Device::Cpu).unwrap();
    model.attach_lora(&config(&["v_proj"]), 1).unwrap();
    let names: Vec<String> = model
        .adapter_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names[0],
        "base_model.model.model.language_model.layers.0.self_attn.v_proj.lora_A.weight"
    );
    assert!(model.make_trainable().unwrap().len() == names.len());
}

#[test]
fn bad_configurations_are_refused_before_any_weight_changes() {
    let mut model = tiny();
    for (bad, what) in [
        (
            LoraConfig {
                rank: 0,
                ..config(&["q_proj"])
            },
            "rank",
        ),
        (
            LoraConfig {
                alpha: -1.0,
                ..config(&["q_proj"])
            },
            "alpha",
        ),
        (
            LoraConfig {
                dropout: 1.0,
                ..config(&["q_proj"])
            },
            "dropout",
        ),
        (config(&["qkv"]), "qkv"),
        (config(&[]), "target_modules"),
    ] {
        let err = model.attach_lora(&bad, 0).unwrap_err().to_string();
        assert!(err.contains(what), "{err}");
    }
    assert!(model.lora().is_none());
    model.attach_lora(&config(&["q_proj"]), 0).unwrap();
    assert!(model.attach_lora(&config(&["q_proj"]), 0).is_err());
}
