//! Qwen3 against the transformers reference outputs in `../shared/fixtures/qwen3-tiny/`, and the
//! two forward paths, saving and gradients against each other.

mod common;

use candle_core::{DType, Device, Tensor, D};
use oxrl_fixtures::{fixture, floats, ids, jsonl, temp_dir};
use oxrl_models::{CacheKind, KvCache, Qwen3, ScoreRequest};
use serde_json::Value;

fn tiny() -> Qwen3 {
    Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap()
}

fn requests() -> (Vec<ScoreRequest>, Vec<Vec<f64>>) {
    let cases = jsonl(&fixture("qwen3-tiny/cases.jsonl"));
    let reqs = cases
        .iter()
        .map(|c| ScoreRequest {
            prompt_ids: ids(&c["prompt_ids"]),
            response_ids: ids(&c["response_ids"]),
            temperature: c.get("temperature").and_then(Value::as_f64).unwrap_or(1.0),
            images: Vec::new(),
        })
        .collect();
    (
        reqs,
        cases
            .iter()
            .map(|c| floats(&c["expected_logprobs"]))
            .collect(),
    )
}

#[test]
fn batched_logprobs_match_transformers_within_1e_4() {
    let (reqs, want) = requests();
    assert_eq!(reqs.len(), 5);
    let got = tiny().score_batch(&reqs).unwrap();
    for (n, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "case {n}");
        for (a, b) in g.iter().zip(w) {
            assert!((*a as f64 - b).abs() <= 1e-4, "case {n}: {a} vs {b}");
        }
    }
}

#[test]
fn logits_match_transformers_within_1e_4() {
    let dir = fixture("qwen3-tiny");
    let expected =
        candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu).unwrap();
    let input = expected["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let got = tiny().forward(&input).unwrap().squeeze(0).unwrap();
    let diff = (got - &expected["logits"])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    assert!(diff.to_scalar::<f32>().unwrap() <= 1e-4);
}

#[test]
fn greedy_path_matches_transformers() {
    let model = tiny();
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3-tiny/greedy.json")).unwrap())
            .unwrap();
    let mut seq = ids(&g["prompt_ids"]);
    let n = g["max_new_tokens"].as_u64().unwrap() as usize;
    let mut new = Vec::new();
    for _ in 0..n {
        let input = Tensor::new(seq.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model.forward(&input).unwrap().squeeze(0).unwrap();
        let next = logits
            .get(seq.len() - 1)
            .unwrap()
            .argmax(D::Minus1)
            .unwrap();
        let next = next.to_scalar::<u32>().unwrap();
        seq.push(next);
        new.push(next);
    }
    assert_eq!(new, ids(&g["expected_ids"]));
}

/// The KV-cache path (prompts of different lengths prefilled together, then decoded one token at
/// a time) gives the training path's logits at every position, with host and pooled caches.
#[test]
fn cached_path_equals_training_path() {
    for kind in [CacheKind::Host, CacheKind::Pooled] {
        cached_path_equals_training_path_with(kind);
    }
}

fn cached_path_equals_training_path_with(kind: CacheKind) {
    let mut model = tiny();
    model.kv_cache = kind;
    let (reqs, _) = requests();
    let mut caches: Vec<_> = reqs.iter().map(|_| model.new_cache()).collect();
    let prompts: Vec<&[u32]> = reqs.iter().map(|r| r.prompt_ids.as_slice()).collect();
    let mut all_logits = vec![Vec::new(); reqs.len()];
    let first = model
        .forward_cached(&prompts, &mut caches.iter_mut().collect::<Vec<_>>())
        .unwrap()
        .to_tensor()
        .unwrap();
    for (i, l) in all_logits.iter_mut().enumerate() {
        l.push(first.get(i).unwrap());
    }
    let steps = reqs.iter().map(|r| r.response_ids.len()).min().unwrap();
    for step in 0..steps - 1 {
        let tokens: Vec<[u32; 1]> = reqs.iter().map(|r| [r.response_ids[step]]).collect();
        let chunks: Vec<&[u32]> = tokens.iter().map(|t| t.as_slice()).collect();
        let logits = model
            .forward_cached(&chunks, &mut caches.iter_mut().collect::<Vec<_>>())
            .unwrap()
            .to_tensor()
            .unwrap();
        for (i, l) in all_logits.iter_mut().enumerate() {
            l.push(logits.get(i).unwrap());
        }
    }
    for (r, cached) in reqs.iter().zip(&all_logits) {
        let ids: Vec<u32> = r
            .prompt_ids
            .iter()
            .chain(&r.response_ids)
            .copied()
            .collect();
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let full = model.forward(&input).unwrap().squeeze(0).unwrap();
        for (k, c) in cached.iter().enumerate() {
            let want = full.get(r.prompt_ids.len() - 1 + k).unwrap();
            let diff = (c - want).unwrap().abs().unwrap().max_all().unwrap();
            assert!(
                diff.to_scalar::<f32>().unwrap() < 1e-5,
                "{kind:?} position {k}"
            );
        }
    }
}

/// One engine-like schedule on caches of `kind`: prompts prefilled together, one forked into
/// ten samples (past the pool's first 8 slots), a sequence dropped and a new prompt admitted in
/// its place, then decoding past 64 positions (the pool's first capacity). Returns every step's
/// logits.
fn schedule(kind: CacheKind) -> Vec<Vec<Vec<f32>>> {
    let mut model = tiny();
    model.kv_cache = kind;
    let (reqs, _) = requests();
    let logits = |caches: &mut [KvCache], chunks: &[&[u32]]| {
        let out = model
            .forward_cached(chunks, &mut caches.iter_mut().collect::<Vec<_>>())
            .unwrap();
        out.to_tensor().unwrap().to_vec2::<f32>().unwrap()
    };
    let mut steps = Vec::new();
    let prompts: Vec<&[u32]> = reqs[..2].iter().map(|r| r.prompt_ids.as_slice()).collect();
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| model.new_cache()).collect();
    steps.push(logits(&mut caches, &prompts));
    for _ in 0..9 {
        let fork = caches[0].fork().unwrap();
        caches.push(fork);
    }
    // Every sample decodes a token of its own, so forks diverge from their source.
    let token = |i: usize, step: usize| ((i * 7919 + step * 104729) % 1000) as u32;
    for step in 0..3 {
        let tokens: Vec<[u32; 1]> = (0..caches.len()).map(|i| [token(i, step)]).collect();
        let chunks: Vec<&[u32]> = tokens.iter().map(|t| t.as_slice()).collect();
        steps.push(logits(&mut caches, &chunks));
    }
    caches.remove(1);
    let mut admitted = vec![model.new_cache()];
    steps.push(logits(&mut admitted, &[reqs[2].prompt_ids.as_slice()]));
    caches.extend(admitted);
    let longest = caches.iter().map(KvCache::len).max().unwrap();
    for step in 3..(3 + 70usize.saturating_sub(longest)) {
        let tokens: Vec<[u32; 1]> = (0..caches.len()).map(|i| [token(i, step)]).collect();
        let chunks: Vec<&[u32]> = tokens.iter().map(|t| t.as_slice()).collect();
        steps.push(logits(&mut caches, &chunks));
    }
    assert!(caches.iter().map(KvCache::len).max().unwrap() >= 70);
    steps
}

/// Pooled caches (the GPU path: one tensor per layer, slots, batched attention) give the host
/// caches' logits through forks, drops, slot reuse and both kinds of pool growth.
#[test]
fn pooled_caches_equal_host_caches_through_forks_drops_and_growth() {
    let (host, pooled) = (schedule(CacheKind::Host), schedule(CacheKind::Pooled));
    assert_eq!(host.len(), pooled.len());
    for (s, (h, p)) in host.iter().zip(&pooled).enumerate() {
        assert_eq!(h.len(), p.len(), "step {s}");
        let d = h
            .iter()
            .flatten()
            .zip(p.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            // A NaN must stay (f32::max would drop it).
            .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
        assert!(d < 1e-5, "step {s}: max |Δ| {d}");
    }
}

/// A step over caches of both kinds is refused, not mixed up.
#[test]
fn mixing_host_and_pooled_caches_is_an_error() {
    let mut model = tiny();
    let host = model.new_cache();
    model.kv_cache = CacheKind::Pooled;
    let pooled = model.new_cache();
    let (mut a, mut b) = (host, pooled);
    let err = model
        .forward_cached(&[&[1, 2], &[3]], &mut [&mut a, &mut b])
        .err()
        .unwrap();
    assert!(err.to_string().contains("mixes host and pooled"), "{err}");
}

#[test]
fn save_load_round_trip_reproduces_logprobs_single_and_sharded() {
    let model = tiny();
    let (reqs, _) = requests();
    let want = model.score_batch(&reqs).unwrap();
    let root = temp_dir("roundtrip");
    let single = root.join("single");
    model.save(&single, Some(&fixture("qwen3-tiny"))).unwrap();
    assert!(single.join("model.safetensors").exists());
    assert!(single.join("generation_config.json").exists());
    let sharded = root.join("sharded");
    model.save_sharded(&sharded, None, 400_000).unwrap();
    assert!(sharded.join("model.safetensors.index.json").exists());
    assert!(!sharded.join("model.safetensors").exists());
    for dir in [&single, &sharded] {
        let back = Qwen3::load(dir, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(back.score_batch(&reqs).unwrap(), want, "{}", dir.display());
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["dtype"], "float32");
        assert_eq!(
            config["rope_parameters"]["rope_theta"], 1e6,
            "keys are carried through"
        );
    }
    // Saving over an existing checkpoint replaces it and leaves no temporary directory behind.
    model.save(&single, None).unwrap();
    let names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// bf16 storage loads into f32 compute and stays close to the f32 reference: bf16 keeps 8 bits of
/// mantissa, so per-weight error is ~0.4% and logprobs of this tiny model move by well under 0.1.
#[test]
fn bf16_checkpoint_loads_and_scores_close_to_f32() {
    let model = tiny();
    let (reqs, want) = requests();
    let dir = temp_dir("bf16");
    let mut tensors = std::collections::HashMap::new();
    for (name, t) in model.named_parameters() {
        tensors.insert(name, t.to_dtype(DType::BF16).unwrap());
    }
    let bf16 = Qwen3::from_tensors(
        model.config_json.clone(),
        std::path::Path::new("bf16"),
        tensors,
        DType::BF16,
        &Device::Cpu,
    )
    .unwrap();
    bf16.save(&dir.join("ckpt"), None).unwrap();
    for compute in [DType::F32, DType::BF16] {
        let back = Qwen3::load(&dir.join("ckpt"), compute, &Device::Cpu).unwrap();
        let got = back.score_batch(&reqs).unwrap();
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((*g as f64 - w).abs() < 0.1, "{compute:?}: {g} vs {w}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every trainable parameter gets a finite, non-zero gradient from a loss on the logits: the
/// training path uses no op that silently drops gradients.
#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    for tied in [false, true] {
        let mut model = tiny();
        if tied {
            model.lm_head = model.model.embed_tokens.clone();
            model.tied = true;
        }
        let vars = model.make_trainable().unwrap();
        assert_eq!(vars.len(), 3 * 11 + 2 + usize::from(!tied));
        // The trainer's path: response log-probs and entropies of a right-padded batch.
        let (reqs, _) = requests();
        // Through the fused log-prob kernel alone, and with a differentiable entropy term.
        for entropy in [
            oxrl_models::Entropy::None,
            oxrl_models::Entropy::Differentiable,
        ] {
            let out = model.response_logprobs(&reqs[..2], entropy).unwrap();
            let mut loss = out.logprobs.sum_all().unwrap();
            if let Some(h) = out.entropy {
                loss = (loss + h.sum_all().unwrap()).unwrap();
            }
            let grads = loss.neg().unwrap().backward().unwrap();
            for (name, var) in &vars {
                let g = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{name}: no gradient"));
                let v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(
                    v.iter().all(|x| x.is_finite()),
                    "{name}: non-finite gradient"
                );
                assert!(
                    v.iter().any(|x| *x != 0.0),
                    "{name}: all-zero gradient ({entropy:?})"
                );
            }
        }
    }
}

#[test]
fn bad_ids_are_errors_not_panics() {
    let model = tiny();
    let bad_vocab = ScoreRequest {
        prompt_ids: vec![1, 5000],
        response_ids: vec![2],
        temperature: 1.0,
        images: Vec::new(),
    };
    let e = model.score_batch(&[bad_vocab]).unwrap_err().to_string();
    assert!(e.contains("5000") && e.contains("vocabulary"), "{e}");
    let too_long = ScoreRequest {
        prompt_ids: vec![1; 5000],
        response_ids: vec![2],
        temperature: 1.0,
        images: Vec::new(),
    };
    let e = model.score_batch(&[too_long]).unwrap_err().to_string();
    assert!(e.contains("4096"), "{e}");
    let empty = ScoreRequest {
        prompt_ids: vec![],
        response_ids: vec![2],
        temperature: 1.0,
        images: Vec::new(),
    };
    assert!(model.score_batch(&[empty]).is_err());
}

/// Gradient checkpointing per layer and the chunked lm_head + log-probs (alone, together, and
/// with a differentiable entropy) give full backprop's log-probs and gradients.
#[test]
fn checkpointed_and_chunked_gradients_equal_full_backprop() {
    let (reqs, _) = requests();
    common::assert_memory_savers_match(tiny, &reqs);
}

/// The checkpointed backward hands each decoder layer over (last layer first) as soon as its
/// weights' gradients are final: what ZeRO-2 reduce-scatters and drops there equals full
/// backprop's gradient, and the store no longer holds it afterwards.
#[test]
fn checkpointed_backward_hands_over_each_finished_layer() {
    let (reqs, _) = requests();
    let loss_of = |out: &oxrl_models::BatchLogprobs| {
        let n = out.logprobs.dim(0).unwrap();
        let w: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0).collect();
        let w = Tensor::from_vec(w, n, &Device::Cpu).unwrap();
        (&out.logprobs * &w).unwrap().sum_all().unwrap()
    };
    let mut plain = tiny();
    let plain_vars = plain.make_trainable().unwrap();
    let out = plain
        .response_logprobs(&reqs, oxrl_models::Entropy::None)
        .unwrap();
    let full = out.backward(&loss_of(&out)).unwrap();
    let want: std::collections::HashMap<String, Vec<f32>> = plain_vars
        .iter()
        .filter_map(|(name, v)| {
            let g = full.get(v.as_tensor())?;
            Some((
                name.clone(),
                g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            ))
        })
        .collect();

    let mut model = tiny();
    model.gradient_checkpointing = true;
    let layers = model.config.num_hidden_layers;
    let vars = model.make_trainable().unwrap();
    let out = model
        .response_logprobs(&reqs, oxrl_models::Entropy::None)
        .unwrap();
    let mut handed = Vec::new();
    let store = out
        .backward_with(&loss_of(&out), |l, grads| {
            handed.push(l);
            let prefix = format!(".layers.{l}.");
            for (name, v) in vars.iter().filter(|(n, _)| n.contains(&prefix)) {
                let g = grads
                    .remove(v.as_tensor())
                    .expect("a finished layer's gradient");
                assert_eq!(g.flatten_all()?.to_vec1::<f32>()?, want[name], "{name}");
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(handed, (0..layers).rev().collect::<Vec<_>>());
    for (name, v) in &vars {
        if name.contains(".layers.") {
            assert!(
                store.get(v.as_tensor()).is_none(),
                "{name} left in the store"
            );
        } else if let Some(w) = want.get(name) {
            let g = store.get(v.as_tensor()).expect("the embeddings' gradient");
            assert_eq!(
                &g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                w,
                "{name}"
            );
        }
    }
}
