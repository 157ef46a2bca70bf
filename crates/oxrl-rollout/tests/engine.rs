//! The local engine on the tiny Qwen3 fixture: greedy against transformers, batching that changes
//! nothing, reproducible seeds, stop rules, and logprobs the trainer can recompute.

use candle_core::{DType, Device};
use oxrl_fixtures::{fixture, ids, jsonl};
use oxrl_models::{CacheKind, Qwen3, ScoreRequest, Tokenizer};
use oxrl_rollout::{
    Engine, EngineError, FinishReason, LocalEngine, SamplerConfig, SamplingParams, WeightVersion,
};
use serde_json::Value;
use std::sync::Arc;

fn tiny() -> Arc<Qwen3> {
    Arc::new(Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap())
}

/// The fixture's prompts: lengths differ, so batching has to handle ragged sequences.
fn prompts() -> Vec<Vec<u32>> {
    jsonl(&fixture("qwen3-tiny/cases.jsonl"))
        .iter()
        .map(|c| ids(&c["prompt_ids"]))
        .collect()
}

fn greedy(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_new_tokens,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn greedy_matches_transformers_generate() {
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3-tiny/greedy.json")).unwrap())
            .unwrap();
    let mut engine = LocalEngine::new(tiny(), None, vec![2]);
    let out = engine
        .generate(&[ids(&g["prompt_ids"])], &greedy(24))
        .unwrap();
    assert_eq!(out[0][0].response_ids, ids(&g["expected_ids"]));
    assert_eq!(out[0][0].finish_reason, FinishReason::Length);
}

#[test]
fn batched_greedy_equals_each_prompt_alone() {
    let model = tiny();
    let prompts = prompts();
    let mut engine = LocalEngine::new(model, None, vec![]);
    let together = engine.generate(&prompts, &greedy(12)).unwrap();
    for (p, want) in prompts.iter().zip(&together) {
        let alone = engine
            .generate(std::slice::from_ref(p), &greedy(12))
            .unwrap();
        assert_eq!(alone[0][0].response_ids, want[0].response_ids);
        for (a, b) in alone[0][0].logprobs.iter().zip(&want[0].logprobs) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        n: 4,
        max_new_tokens: 16,
        sampler: SamplerConfig {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 50,
            ..Default::default()
        },
        seed,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn seeded_sampling_repeats_exactly_whatever_the_batching() {
    let prompts = prompts();
    let mut engine = LocalEngine::new(tiny(), None, vec![]);
    let a = engine.generate(&prompts, &sampled(7)).unwrap();
    let b = engine.generate(&prompts, &sampled(7)).unwrap();
    assert_eq!(a, b);
    // One sequence at a time: a different schedule, the same draws. (Logprobs may differ in the
    // last float bits: a matmul over fewer rows sums in another order.)
    engine.max_num_seqs = 1;
    let one_by_one = engine.generate(&prompts, &sampled(7)).unwrap();
    for (x, y) in a.iter().flatten().zip(one_by_one.iter().flatten()) {
        assert_eq!(x.response_ids, y.response_ids);
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            assert!((p - q).abs() < 1e-5);
        }
    }
    let c = engine.generate(&prompts, &sampled(8)).unwrap();
    assert_ne!(a, c, "another seed draws other tokens");
    // The samples of one prompt differ from each other.
    assert!(a[0]
        .iter()
        .skip(1)
        .any(|s| s.response_ids != a[0][0].response_ids));
}

#[test]
fn a_share_of_the_batch_samples_what_the_whole_batch_would() {
    // A data-parallel rank generates prompts [2, 4) of a step's batch with first_prompt = 2.
    let prompts = prompts();
    assert!(prompts.len() >= 4);
    let mut engine = LocalEngine::new(tiny(), None, vec![]);
    let whole = engine.generate(&prompts[..4], &sampled(7)).unwrap();
    let share = SamplingParams {
        first_prompt: 2,
        ..sampled(7)
    };
    let second_half = engine.generate(&prompts[2..4], &share).unwrap();
    for (x, y) in whole[2..]
        .iter()
        .flatten()
        .zip(second_half.iter().flatten())
    {
        assert_eq!(x.response_ids, y.response_ids);
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            assert!((p - q).abs() < 1e-5);
        }
    }
    // Without the offset the share draws prompts 0 and 1's streams: other tokens.
    let unshifted = engine.generate(&prompts[2..4], &sampled(7)).unwrap();
    assert_ne!(
        unshifted
            .iter()
            .flatten()
            .map(|c| &c.response_ids)
            .collect::<Vec<_>>(),
        whole[2..]
            .iter()
            .flatten()
            .map(|c| &c.response_ids)
            .collect::<Vec<_>>()
    );
}

/// The engine on pooled caches (the GPU layout: one tensor per layer, batched attention) draws
/// the host caches' tokens, with log-probs equal to float noise, also when sequences wait for a
/// slot and take over the slots of finished ones.
#[test]
fn pooled_caches_sample_what_host_caches_sample() {
    let prompts = prompts();
    let mut pooled_model = Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    pooled_model.kv_cache = CacheKind::Pooled;
    for max_num_seqs in [256, 6] {
        let mut host = LocalEngine::new(tiny(), None, vec![]);
        let mut pooled = LocalEngine::new(Arc::new(pooled_model.detached()), None, vec![]);
        host.max_num_seqs = max_num_seqs;
        pooled.max_num_seqs = max_num_seqs;
        let a = host.generate(&prompts, &sampled(7)).unwrap();
        let b = pooled.generate(&prompts, &sampled(7)).unwrap();
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            assert_eq!(
                x.response_ids, y.response_ids,
                "max_num_seqs {max_num_seqs}"
            );
            for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
                assert!((p - q).abs() < 1e-5, "{p} vs {q}");
            }
        }
    }
}

/// Rollout logprobs are those of softmax(logits / T) before truncation: the trainer's recompute
/// of the same tokens gives the same numbers.
#[test]
fn rollout_logprobs_match_the_trainers_recompute() {
    let model = tiny();
    let prompts = prompts();
    let mut engine = LocalEngine::new(model.clone(), None, vec![]);
    let out = engine.generate(&prompts, &sampled(3)).unwrap();
    let mut reqs = Vec::new();
    let mut rollout = Vec::new();
    for (p, samples) in prompts.iter().zip(&out) {
        for c in samples {
            reqs.push(ScoreRequest {
                prompt_ids: p.clone(),
                response_ids: c.response_ids.clone(),
                temperature: 0.8,
                images: Vec::new(),
            });
            rollout.push(c.logprobs.clone());
        }
    }
    let recomputed = model.score_batch(&reqs).unwrap();
    for (r, s) in rollout.iter().flatten().zip(recomputed.iter().flatten()) {
        assert!((r - s).abs() < 1e-4, "{r} vs {s}");
    }
}

#[test]
fn stop_token_ids_end_with_stop_and_keep_the_token() {
    let prompts = prompts();
    let mut engine = LocalEngine::new(tiny(), None, vec![]);
    let free = engine.generate(&prompts[..1], &greedy(12)).unwrap();
    let path = &free[0][0].response_ids;
    let stop_at = path[4];
    let first = path.iter().position(|&t| t == stop_at).unwrap();
    let params = SamplingParams {
        stop_token_ids: vec![stop_at],
        ..greedy(12)
    };
    let out = engine.generate(&prompts[..1], &params).unwrap();
    assert_eq!(out[0][0].finish_reason, FinishReason::Stop);
    assert_eq!(out[0][0].response_ids, path[..=first].to_vec());
    // The model's eos ids stop too, unless ignore_eos.
    let mut eos_engine = LocalEngine::new(tiny(), None, vec![stop_at]);
    let params = SamplingParams {
        ignore_eos: false,
        ..greedy(12)
    };
    assert_eq!(
        eos_engine.generate(&prompts[..1], &params).unwrap()[0][0]
            .response_ids
            .len(),
        first + 1
    );
}

#[test]
fn stop_strings_cut_the_text_before_them() {
    // The tiny model's ids (< 1024) are valid Qwen tokenizer ids, so its output decodes to text.
    let tok = Arc::new(Tokenizer::from_dir(&fixture("qwen3-tokenizer")).unwrap());
    let mut engine = LocalEngine::new(tiny(), Some(tok), vec![]);
    let prompts = prompts();
    let free = engine.generate(&prompts[..1], &greedy(16)).unwrap();
    let text = free[0][0].text.clone().unwrap();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let params = SamplingParams {
        stop_strings: vec![stop.clone()],
        ..greedy(16)
    };
    let out = &engine.generate(&prompts[..1], &params).unwrap()[0][0];
    assert_eq!(out.finish_reason, FinishReason::Stop);
    let at = text.find(&stop).unwrap();
    assert_eq!(out.text.as_deref(), Some(&text[..at]));
    assert!(out.response_ids.len() < free[0][0].response_ids.len());
}

#[test]
fn bad_requests_are_errors() {
    let mut engine = LocalEngine::new(tiny(), None, vec![]);
    let cases: Vec<(Vec<Vec<u32>>, SamplingParams, &str)> = vec![
        (vec![vec![1, 99999]], greedy(4), "vocabulary"),
        (vec![vec![]], greedy(4), "empty"),
        (vec![vec![1]], SamplingParams { n: 0, ..greedy(4) }, "n "),
        (
            vec![vec![1]],
            SamplingParams {
                stop_strings: vec!["x".into()],
                ..greedy(4)
            },
            "tokenizer",
        ),
        (
            vec![vec![1]],
            SamplingParams {
                sampler: SamplerConfig {
                    top_p: 0.0,
                    ..Default::default()
                },
                ..greedy(4)
            },
            "top_p",
        ),
    ];
    for (prompts, params, want) in cases {
        let e = engine.generate(&prompts, &params).unwrap_err().to_string();
        assert!(e.contains(want), "{e} should mention {want}");
    }
}

/// Completions carry the version the last sync named; syncs move it forward (or repeat it),
/// never back.
#[test]
fn completions_carry_the_synced_weight_version() {
    let model = tiny();
    let mut engine = LocalEngine::new(model.clone(), None, vec![]);
    let prompts = prompts();
    let one = &prompts[..1];
    assert_eq!(engine.weight_version(), WeightVersion(0));
    let before = engine.generate(one, &greedy(3)).unwrap();
    assert_eq!(before[0][0].weight_version, WeightVersion(0));
    engine
        .sync_weights(model.as_ref(), WeightVersion(2))
        .unwrap();
    engine
        .sync_weights(model.as_ref(), WeightVersion(2))
        .unwrap();
    let after = engine.generate(one, &greedy(3)).unwrap();
    assert_eq!(after[0][0].weight_version, WeightVersion(2));
    let back = engine.sync_weights(model.as_ref(), WeightVersion(1));
    assert!(matches!(
        back,
        Err(EngineError::VersionBackwards {
            current: WeightVersion(2),
            to: WeightVersion(1)
        })
    ));
    assert_eq!(engine.weight_version(), WeightVersion(2));
}
