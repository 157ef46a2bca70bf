//! Continuous batching on the tiny Qwen3 fixture: a group that joins a running batch samples
//! exactly what it samples alone, a cancelled group leaves at once, and a weight version
//! change mid-sequence shows in the sequence's version spans.

use candle_core::{DType, Device};
use oxrl_fixtures::{fixture, ids, jsonl};
use oxrl_models::Qwen3;
use oxrl_rollout::{
    Batcher, Completion, EngineError, Group, GroupSink, SamplerConfig, SamplingParams, VersionSpan,
    WeightVersion,
};
use std::sync::{Arc, Mutex};

fn batcher() -> Batcher {
    let model = Arc::new(Qwen3::load(&fixture("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap());
    Batcher::new(model, None, vec![])
}

fn prompts() -> Vec<Vec<u32>> {
    jsonl(&fixture("qwen3-tiny/cases.jsonl"))
        .iter()
        .map(|c| ids(&c["prompt_ids"]))
        .collect()
}

fn params(seed: u64) -> Arc<SamplingParams> {
    Arc::new(SamplingParams {
        n: 3,
        max_new_tokens: 10,
        sampler: SamplerConfig {
            temperature: 0.9,
            top_k: 40,
            ..Default::default()
        },
        seed,
        ignore_eos: true,
        ..Default::default()
    })
}

type Finished = Arc<Mutex<Vec<(usize, Completion, Vec<VersionSpan>)>>>;

/// Records finished samples; cancels the group after `cancel_after` tokens when set.
struct Record {
    finished: Finished,
    tokens: usize,
    cancel_after: Option<usize>,
}

impl GroupSink for Record {
    fn token(&mut self, _sample: usize, _token: u32, _logprob: f32) -> bool {
        self.tokens += 1;
        self.cancel_after.is_none_or(|c| self.tokens < c)
    }

    fn finished(&mut self, sample: usize, completion: Completion, versions: Vec<VersionSpan>) {
        self.finished
            .lock()
            .unwrap()
            .push((sample, completion, versions));
    }

    fn failed(&mut self, error: &EngineError) {
        panic!("unexpected failure: {error}");
    }
}

fn group(prompt: &[u32], seed: u64, cancel_after: Option<usize>) -> (Group, Finished) {
    let finished: Finished = Default::default();
    let g = Group {
        prompt: prompt.to_vec(),
        images: Vec::new(),
        params: params(seed),
        first_stream: 0,
        sink: Box::new(Record {
            finished: finished.clone(),
            tokens: 0,
            cancel_after,
        }),
    };
    (g, finished)
}

fn by_sample(f: &Finished) -> Vec<Completion> {
    let mut v = f.lock().unwrap().clone();
    v.sort_by_key(|(s, _, _)| *s);
    v.into_iter().map(|(_, c, _)| c).collect()
}

fn run_alone(prompt: &[u32], seed: u64) -> Vec<Completion> {
    let mut b = batcher();
    let (g, f) = group(prompt, seed, None);
    b.submit(g);
    while !b.is_idle() {
        b.step().unwrap();
    }
    by_sample(&f)
}

#[test]
fn a_group_joining_mid_run_samples_what_it_samples_alone() {
    let p = prompts();
    let mut b = batcher();
    let (first, first_done) = group(&p[0], 7, None);
    b.submit(first);
    for _ in 0..4 {
        b.step().unwrap();
    }
    assert_eq!(b.running(), 3, "the first group is decoding");
    let (second, second_done) = group(&p[1], 8, None);
    b.submit(second);
    b.step().unwrap();
    assert_eq!(b.running(), 6, "the second group joined the running batch");
    while !b.is_idle() {
        b.step().unwrap();
    }
    for (got, want) in [
        (by_sample(&first_done), run_alone(&p[0], 7)),
        (by_sample(&second_done), run_alone(&p[1], 8)),
    ] {
        assert_eq!(got.len(), 3);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.response_ids, w.response_ids);
            for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }
}

#[test]
fn a_cancelled_group_leaves_the_batch_at_once() {
    let p = prompts();
    let mut b = batcher();
    let (stays, stays_done) = group(&p[0], 1, None);
    let (goes, goes_done) = group(&p[1], 2, Some(4));
    b.submit(stays);
    b.submit(goes);
    b.step().unwrap();
    assert_eq!(b.running(), 6);
    b.step().unwrap();
    assert_eq!(
        b.running(),
        3,
        "the group that said stop after 4 tokens has left"
    );
    while !b.is_idle() {
        b.step().unwrap();
    }
    assert!(goes_done.lock().unwrap().is_empty());
    assert_eq!(stays_done.lock().unwrap().len(), 3);
}

#[test]
fn a_version_change_mid_sequence_splits_its_spans() {
    let p = prompts();
    let mut b = batcher();
    let (g, done) = group(&p[0], 3, None);
    b.submit(g);
    for _ in 0..4 {
        b.step().unwrap();
    }
    b.set_version(WeightVersion(5)).unwrap();
    while !b.is_idle() {
        b.step().unwrap();
    }
    assert!(
        b.set_version(WeightVersion(4)).is_err(),
        "versions only grow"
    );
    for (_, c, spans) in done.lock().unwrap().iter() {
        assert_eq!(
            spans,
            &[
                VersionSpan {
                    version: WeightVersion(0),
                    start: 0,
                    end: 4
                },
                VersionSpan {
                    version: WeightVersion(5),
                    start: 4,
                    end: 10
                },
            ]
        );
        assert_eq!(
            c.weight_version,
            WeightVersion(0),
            "as old as its oldest token"
        );
    }
}
