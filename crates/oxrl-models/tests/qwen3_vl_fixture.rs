//! Qwen3-VL and its image processor against the transformers reference outputs in
//! `../shared/fixtures/qwen3-vl-tiny/`: pixel values, vision-tower and DeepStack outputs, MRoPE
//! positions, logits and response log-probs; the KV-cache path and gradients against them.

mod common;

use candle_core::{DType, Device, Tensor};
use oxrl_fixtures::{fixture, floats, ids, jsonl};
use oxrl_models::image::process;
use oxrl_models::{CacheKind, ImageSource, ProcessedImage, Qwen3, ScoreRequest};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;

fn tiny_vl() -> Qwen3 {
    Qwen3::load(&fixture("qwen3-vl-tiny"), DType::F32, &Device::Cpu).unwrap()
}

fn image(model: &Qwen3, name: &str) -> Arc<ProcessedImage> {
    let src = ImageSource::Path(fixture("qwen3-vl-tiny").join(name));
    let processor = &model.vision.as_ref().unwrap().processor;
    Arc::new(process(&src.load().unwrap(), processor).unwrap())
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The fixture cases as score requests (images processed, each single pad expanded).
fn requests(model: &Qwen3) -> (Vec<ScoreRequest>, Vec<Vec<f64>>) {
    let tokens = model.vision.as_ref().unwrap().tokens;
    let cases = jsonl(&fixture("qwen3-vl-tiny/cases.jsonl"));
    let mut reqs = Vec::new();
    for c in &cases {
        let images: Vec<Arc<ProcessedImage>> = c
            .get("images")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|n| image(model, n.as_str().unwrap()))
                    .collect()
            })
            .unwrap_or_default();
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        reqs.push(ScoreRequest {
            prompt_ids: tokens
                .expand_image_pads(&ids(&c["prompt_ids"]), &grids)
                .unwrap(),
            response_ids: ids(&c["response_ids"]),
            temperature: c.get("temperature").and_then(Value::as_f64).unwrap_or(1.0),
            images,
        });
    }
    let want = cases
        .iter()
        .map(|c| floats(&c["expected_logprobs"]))
        .collect();
    (reqs, want)
}

#[test]
fn pixel_values_match_the_pil_backend_within_1e_6() {
    let model = tiny_vl();
    let dir = fixture("qwen3-vl-tiny");
    for case in jsonl(&dir.join("processor_cases.jsonl")) {
        let name = case["image"].as_str().unwrap();
        let got = image(&model, name);
        let grid: Vec<usize> = ids(&case["image_grid_thw"])
            .iter()
            .map(|&x| x as usize)
            .collect();
        assert_eq!(got.grid_thw.to_vec(), grid, "{name}");
        let file = dir.join(case["pixel_values_file"].as_str().unwrap());
        let want = &candle_core::safetensors::load(file, &Device::Cpu).unwrap()["pixel_values"];
        let got = Tensor::from_slice(&got.pixel_values, want.dims(), &Device::Cpu).unwrap();
        let d = max_abs_diff(&got, want);
        assert!(d <= 1e-6, "{name}: max |Δ| {d}");
    }
}

#[test]
fn vision_tower_positions_and_logits_match_transformers() {
    let model = tiny_vl();
    let expected =
        candle_core::safetensors::load(fixture("qwen3-vl-tiny/expected.safetensors"), &Device::Cpu)
            .unwrap();
    let (reqs, _) = requests(&model);
    let case = &reqs[0];
    let all: Vec<u32> = case
        .prompt_ids
        .iter()
        .chain(&case.response_ids)
        .copied()
        .collect();
    let want_ids: Vec<u32> = expected["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(all, want_ids, "expanded input ids");

    let vision = model.vision.as_ref().unwrap();
    let grids: Vec<[usize; 3]> = case.images.iter().map(|i| i.grid_thw).collect();
    let want_grids: Vec<Vec<i64>> = expected["image_grid_thw"].to_vec2().unwrap();
    let grids_i64: Vec<Vec<i64>> = grids
        .iter()
        .map(|g| g.iter().map(|&x| x as i64).collect())
        .collect();
    assert_eq!(grids_i64, want_grids);
    let pixels: Vec<f32> = case
        .images
        .iter()
        .flat_map(|i| i.pixel_values.clone())
        .collect();
    let pixels = Tensor::from_vec(pixels, expected["pixel_values"].dims(), &Device::Cpu).unwrap();
    assert!(max_abs_diff(&pixels, &expected["pixel_values"]) <= 1e-6);

    let out = vision.tower.forward(&pixels, &grids).unwrap();
    let d = max_abs_diff(&out.embeds, &expected["image_embeds"]);
    assert!(d <= 1e-4, "image embeds: max |Δ| {d}");
    assert_eq!(out.deepstack.len(), 2);
    for (k, f) in out.deepstack.iter().enumerate() {
        let d = max_abs_diff(f, &expected[&format!("deepstack_features.{k}")]);
        assert!(d <= 1e-4, "deepstack feature {k}: max |Δ| {d}");
    }

    let (positions, delta) = vision.tokens.rope_index(&all, &grids).unwrap();
    let want_pos: Vec<Vec<i64>> = expected["position_ids"].to_vec2().unwrap();
    for axis in 0..3 {
        let got: Vec<i64> = positions.iter().map(|p| p[axis] as i64).collect();
        assert_eq!(got, want_pos[axis], "position row {axis}");
    }
    let want_delta: Vec<i64> = expected["rope_deltas"]
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(delta, want_delta[0]);

    let logits = model
        .forward_with_images(&case.prompt_ids, &case.response_ids, &case.images)
        .unwrap();
    let d = max_abs_diff(&logits, &expected["logits"]);
    assert!(d <= 1e-4, "logits: max |Δ| {d}");
}

#[test]
fn batched_logprobs_match_transformers_within_1e_4() {
    let model = tiny_vl();
    let (reqs, want) = requests(&model);
    assert_eq!(reqs.len(), 6);
    let got = model.score_batch(&reqs).unwrap();
    for (n, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "case {n}");
        for (a, b) in g.iter().zip(w) {
            assert!((*a as f64 - b).abs() <= 1e-4, "case {n}: {a} vs {b}");
        }
    }
}

/// The KV-cache path (image prompts prefilled together, then decoded one token at a time with
/// the position offset after the images) gives the training path's logits, with host and
/// pooled caches.
#[test]
fn cached_path_equals_training_path_with_images() {
    for kind in [CacheKind::Host, CacheKind::Pooled] {
        cached_path_equals_training_path_with_images_with(kind);
    }
}

fn cached_path_equals_training_path_with_images_with(kind: CacheKind) {
    let mut model = tiny_vl();
    model.kv_cache = kind;
    let (reqs, _) = requests(&model);
    let mut caches: Vec<_> = reqs.iter().map(|_| model.new_cache()).collect();
    let prompts: Vec<&[u32]> = reqs.iter().map(|r| r.prompt_ids.as_slice()).collect();
    let images: Vec<&[Arc<ProcessedImage>]> = reqs.iter().map(|r| r.images.as_slice()).collect();
    let mut cached: Vec<Vec<Vec<f32>>> = vec![Vec::new(); reqs.len()];
    let first = model
        .forward_cached_with(
            &prompts,
            &images,
            &mut caches.iter_mut().collect::<Vec<_>>(),
        )
        .unwrap()
        .to_tensor()
        .unwrap();
    for (i, row) in first.to_vec2::<f32>().unwrap().into_iter().enumerate() {
        cached[i].push(row);
    }
    let steps = reqs.iter().map(|r| r.response_ids.len()).min().unwrap() - 1;
    for k in 0..steps {
        let chunks: Vec<&[u32]> = reqs.iter().map(|r| &r.response_ids[k..k + 1]).collect();
        let logits = model
            .forward_cached(&chunks, &mut caches.iter_mut().collect::<Vec<_>>())
            .unwrap()
            .to_tensor()
            .unwrap();
        for (i, row) in logits.to_vec2::<f32>().unwrap().into_iter().enumerate() {
            cached[i].push(row);
        }
    }
    for (n, (r, rows)) in reqs.iter().zip(&cached).enumerate() {
        let full = model
            .forward_with_images(&r.prompt_ids, &r.response_ids, &r.images)
            .unwrap();
        let want = full.narrow(0, r.prompt_ids.len() - 1, rows.len()).unwrap();
        let got = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        let d = max_abs_diff(&got, &want);
        assert!(d <= 1e-4, "{kind:?} case {n}: max |Δ| {d}");
    }
}

/// Every trainable parameter, the vision tower's included, gets a finite, non-zero gradient
/// from the response log-probs of image prompts.
#[test]
fn every_parameter_gets_a_finite_nonzero_gradient_through_the_vision_tower() {
    let mut model = tiny_vl();
    let vars = model.make_trainable().unwrap();
    assert!(vars.iter().any(|(n, _)| n.starts_with("model.visual.")));
    assert!(vars
        .iter()
        .any(|(n, _)| n.starts_with("model.language_model.")));
    let (reqs, _) = requests(&model);
    let out = model
        .response_logprobs(&reqs[..3], oxrl_models::Entropy::None)
        .unwrap();
    let grads = out
        .logprobs
        .sum_all()
        .unwrap()
        .neg()
        .unwrap()
        .backward()
        .unwrap();
    for (name, var) in &vars {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{name}: non-finite gradient"
        );
        assert!(v.iter().any(|x| *x != 0.0), "{name}: all-zero gradient");
    }
}

/// Saving writes the checkpoint names transformers reads (`model.visual.*`,
/// `model.language_model.*`, the Conv3d kernel shape), and loading it back gives the same numbers.
#[test]
fn save_and_load_round_trip() {
    let model = tiny_vl();
    let (reqs, _) = requests(&model);
    let want = model.score_batch(&reqs).unwrap();
    let dir = oxrl_fixtures::temp_dir("vl-save");
    model
        .save(&dir.join("ckpt"), Some(&fixture("qwen3-vl-tiny")))
        .unwrap();
    let original: HashMap<String, Tensor> =
        candle_core::safetensors::load(fixture("qwen3-vl-tiny/model.safetensors"), &Device::Cpu)
            .unwrap();
    let saved =
        candle_core::safetensors::load(dir.join("ckpt/model.safetensors"), &Device::Cpu).unwrap();
    let mut a: Vec<_> = original
        .iter()
        .map(|(k, v)| (k.clone(), v.dims().to_vec()))
        .collect();
    let mut b: Vec<_> = saved
        .iter()
        .map(|(k, v)| (k.clone(), v.dims().to_vec()))
        .collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    assert!(dir.join("ckpt/preprocessor_config.json").exists());
    let back = Qwen3::load(&dir.join("ckpt"), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.score_batch(&reqs).unwrap(), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_image_inputs_are_errors_that_say_why() {
    let model = tiny_vl();
    let (reqs, _) = requests(&model);
    let mut missing = reqs[0].clone();
    missing.images.pop();
    let e = model.score_batch(&[missing]).unwrap_err().to_string();
    assert!(e.contains("image tokens"), "{e}");
    let text = Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    let mut with_image = ScoreRequest::text(vec![1, 2], vec![3], 1.0);
    with_image.images.push(reqs[0].images[0].clone());
    let e = text.score_batch(&[with_image]).unwrap_err().to_string();
    assert!(e.contains("no vision tower"), "{e}");
}

/// An image pad the policy generates in its response is text: it scores, and it changes
/// nothing before it.
#[test]
fn a_generated_image_pad_is_text() {
    let model = tiny_vl();
    let (reqs, _) = requests(&model);
    let pad = model.vision.as_ref().unwrap().tokens.image_token_id;
    let mut with_pad = reqs[0].clone();
    with_pad.response_ids.extend([pad, pad, 7]);
    let got = model.score_batch(&[reqs[0].clone(), with_pad]).unwrap();
    assert_eq!(got[1].len(), got[0].len() + 3);
    for (a, b) in got[0].iter().zip(&got[1]) {
        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
    }
    assert!(got[1].iter().all(|x| x.is_finite()));
}

/// Gradient checkpointing per layer and the chunked lm_head give full backprop's gradients,
/// the vision tower's too (its image embeddings and DeepStack features enter the checkpointed
/// layers as leaves).
#[test]
fn checkpointed_and_chunked_gradients_equal_full_backprop_through_the_vision_tower() {
    let model = tiny_vl();
    let (reqs, _) = requests(&model);
    common::assert_memory_savers_match(tiny_vl, &reqs);
}
