//! Helpers shared by the model tests.

use candle_core::Tensor;
use oxrl_models::{Entropy, Qwen3, ScoreRequest};

/// How the training path runs: layer checkpointing, and lm_head chunks of this many rows.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub checkpointing: bool,
    pub chunk_rows: Option<usize>,
}

/// The plain training path: whole graph, logits of every row at once.
pub const FULL: Memory = Memory {
    checkpointing: false,
    chunk_rows: None,
};

/// The response log-probs and every parameter's gradient (by name; empty where the loss does
/// not reach it) of a weighted sum of the log-probs (plus, with `entropy`, of the
/// differentiable entropies) of `reqs`.
fn gradients(
    mut model: Qwen3,
    reqs: &[ScoreRequest],
    memory: Memory,
    entropy: bool,
) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    model.gradient_checkpointing = memory.checkpointing;
    if let Some(rows) = memory.chunk_rows {
        model.logit_chunk_elements = rows * model.config.vocab_size;
    }
    let vars = model.make_trainable().unwrap();
    let mode = if entropy {
        Entropy::Differentiable
    } else {
        Entropy::None
    };
    let out = model.response_logprobs(reqs, mode).unwrap();
    assert_eq!(out.checkpoints.is_some(), memory.checkpointing);
    if let (Some(c), Some(v)) = (&out.checkpoints, &model.vision) {
        let images = reqs.iter().any(|r| !r.images.is_empty());
        let depth = v.tower.config.depth;
        assert_eq!(c.tower_blocks(), if images { depth } else { 0 });
    }
    let n = out.logprobs.dim(0).unwrap();
    assert_eq!(out.head.is_some(), memory.chunk_rows.is_some_and(|r| r < n));
    // Weights of both signs, so no gradient is a plain sum.
    let w: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0).collect();
    let w = Tensor::from_vec(w, n, out.logprobs.device()).unwrap();
    let mut loss = (&out.logprobs * &w).unwrap().sum_all().unwrap();
    if entropy {
        let h = out.entropy.as_ref().unwrap();
        loss = (loss + (h * 0.5).unwrap().sum_all().unwrap()).unwrap();
    }
    let grads = out.backward(&loss).unwrap();
    let named = vars
        .iter()
        .map(|(name, v)| {
            let g = grads
                .get(v.as_tensor())
                .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            (name.clone(), g.unwrap_or_default())
        })
        .collect();
    (out.logprobs.to_vec1::<f32>().unwrap(), named)
}

/// `memory` gives the plain training path's log-probs and every parameter's gradient:
/// bit-identical, or within `tolerance` of the parameter's largest gradient where a sum's order
/// changes. Returns how many parameters were bit-identical, of how many.
pub fn assert_gradients_match(
    load: impl Fn() -> Qwen3,
    reqs: &[ScoreRequest],
    memory: Memory,
    entropy: bool,
    tolerance: f32,
) -> (usize, usize) {
    let (full_lp, full) = gradients(load(), reqs, FULL, entropy);
    let (lp, got) = gradients(load(), reqs, memory, entropy);
    for (a, b) in full_lp.iter().zip(&lp) {
        assert!((a - b).abs() <= 1e-6, "{memory:?}: log-prob {a} vs {b}");
    }
    let (mut identical, mut worst_rel) = (0, 0f32);
    for ((name, a), (_, b)) in full.iter().zip(&got) {
        assert!(!a.is_empty(), "{name}: no gradient in full backprop");
        assert_eq!(a.len(), b.len(), "{name}: {memory:?} lost the gradient");
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
        worst_rel = worst_rel.max(worst / scale);
        assert!(
            worst <= tolerance * scale,
            "{name} ({memory:?}): max |Δ| {worst} against max |g| {scale}"
        );
        identical += usize::from(a == b);
    }
    eprintln!(
        "{memory:?}, entropy {entropy}: {identical} of {} parameters' gradients bit-identical, \
         worst |Δ| {worst_rel:.2e} of the parameter's largest",
        full.len()
    );
    (identical, full.len())
}

/// Every memory-saving form of the training path against the plain one. Checkpointing alone
/// recomputes the same ops and sums every gradient in the same order: bit-identical. Chunking
/// lm_head sums its gradient over chunks and multiplies fewer rows at once, which reorders f32
/// sums: within 1e-5 (measured: up to 1.5e-6).
pub fn assert_memory_savers_match(load: impl Fn() -> Qwen3, reqs: &[ScoreRequest]) {
    let checkpointed = Memory {
        checkpointing: true,
        chunk_rows: None,
    };
    let (identical, total) = assert_gradients_match(&load, reqs, checkpointed, false, 0.0);
    assert_eq!(
        identical, total,
        "checkpointing changed some gradient's bits"
    );
    for checkpointing in [false, true] {
        let chunked = Memory {
            checkpointing,
            chunk_rows: Some(3),
        };
        for entropy in [false, true] {
            assert_gradients_match(&load, reqs, chunked, entropy, 1e-5);
        }
    }
}
