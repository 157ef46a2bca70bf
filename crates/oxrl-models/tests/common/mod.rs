//! Helpers shared by the model tests.

use candle_core::Tensor;
use oxrl_models::{Entropy, Qwen3, ScoreRequest};

/// Every parameter's gradient (by name; empty where the loss does not reach it) of a weighted
/// sum of the response log-probs of `reqs`, with or without gradient checkpointing.
fn gradients(
    mut model: Qwen3,
    reqs: &[ScoreRequest],
    checkpointing: bool,
) -> Vec<(String, Vec<f32>)> {
    model.gradient_checkpointing = checkpointing;
    let vars = model.make_trainable().unwrap();
    let out = model.response_logprobs(reqs, Entropy::None).unwrap();
    assert_eq!(out.checkpoints.is_some(), checkpointing);
    let n = out.logprobs.dim(0).unwrap();
    // Weights of both signs, so no gradient is a plain sum.
    let w: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0).collect();
    let w = Tensor::from_vec(w, n, out.logprobs.device()).unwrap();
    let loss = (&out.logprobs * w).unwrap().sum_all().unwrap();
    let grads = out.backward(&loss).unwrap();
    vars.iter()
        .map(|(name, v)| {
            let g = grads
                .get(v.as_tensor())
                .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            (name.clone(), g.unwrap_or_default())
        })
        .collect()
}

/// Gradient checkpointing gives full backprop's gradient for every parameter: bit-identical,
/// or within 1e-6 of the parameter's largest gradient where a sum's order changes. Returns how
/// many parameters were bit-identical, of how many.
pub fn assert_checkpointed_gradients_match(
    load: impl Fn() -> Qwen3,
    reqs: &[ScoreRequest],
) -> (usize, usize) {
    let (full, checkpointed) = (
        gradients(load(), reqs, false),
        gradients(load(), reqs, true),
    );
    let mut identical = 0;
    for ((name, a), (_, b)) in full.iter().zip(&checkpointed) {
        assert!(!a.is_empty(), "{name}: no gradient in full backprop");
        assert_eq!(a.len(), b.len(), "{name}: checkpointing lost the gradient");
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
        assert!(
            worst <= 1e-6 * scale,
            "{name}: max |Δ| {worst} against max |g| {scale}"
        );
        identical += usize::from(a == b);
    }
    eprintln!(
        "{identical} of {} parameters' gradients bit-identical",
        full.len()
    );
    (identical, full.len())
}
