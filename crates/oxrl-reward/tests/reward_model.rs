//! The reward-model reward function on a tiny random `Qwen3ForSequenceClassification` written
//! with the project's save path beside the demo policy's tokenizer: it scores `prompt +
//! response`, batches change nothing, and running normalisation, scale and shift apply.

use candle_core::{DType, Device};
use oxrl_fixtures::temp_dir;
use oxrl_models::{Qwen3RewardModel, Tokenizer};
use oxrl_reward::{
    Normalize, RewardFn, RewardInput, RewardModel, RewardModelSpec, RewardSet, WeightedReward,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn demo_policy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/arithmetic/policy")
}

/// A random reward model with the demo tokenizer's vocabulary (272), pad id 256.
fn checkpoint(name: &str) -> PathBuf {
    let dir = temp_dir(name).join("rm");
    let config = serde_json::json!({"vocab_size": 272, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 128, "rope_theta": 10000.0, "tie_word_embeddings": true,
        "num_labels": 1, "pad_token_id": 256});
    let rm = Qwen3RewardModel::random(config, 3, DType::F32, &Device::Cpu).unwrap();
    rm.save(&dir, Some(&demo_policy())).unwrap();
    dir
}

fn inputs() -> Vec<RewardInput> {
    ["1+1=2", "1+1=3", "2+2=4", "7", "9+0=9"]
        .iter()
        .map(|t| {
            let (prompt, response) = t.split_at(t.len().min(4));
            RewardInput {
                prompt: prompt.into(),
                response: response.into(),
                row: Default::default(),
                response_tokens: response.len(),
            }
        })
        .collect()
}

/// What the model itself says for `prompt + response`, one sequence at a time.
fn direct(dir: &Path) -> Vec<f64> {
    let rm = Qwen3RewardModel::load(dir, DType::F32, &Device::Cpu).unwrap();
    let tok = Tokenizer::from_dir(dir).unwrap();
    inputs()
        .iter()
        .map(|i| {
            let ids = tok.encode(&format!("{}{}", i.prompt, i.response)).unwrap();
            f64::from(rm.score_batch(&[ids]).unwrap()[0][0])
        })
        .collect()
}

#[test]
fn scores_are_the_models_and_do_not_depend_on_batching() {
    let dir = checkpoint("rm-reward");
    let want = direct(&dir);
    for batch_size in [1, 2, 5] {
        let spec = RewardModelSpec {
            batch_size,
            ..RewardModelSpec::new("rm")
        };
        let set = RewardSet {
            functions: vec![WeightedReward {
                name: "rm".into(),
                weight: 1.0,
                function: Arc::new(RewardModel::load(&dir, spec, &Device::Cpu).unwrap()),
            }],
            failure_score: 0.0,
            timeout: Duration::from_secs(30),
        };
        let out = set.score(&inputs());
        assert_eq!(out.failures[0].1, 0);
        for (got, want) in out.total.iter().zip(&want) {
            assert!(
                (got - want).abs() < 1e-5,
                "batch {batch_size}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn running_normalisation_then_scale_and_shift() {
    let dir = checkpoint("rm-normalise");
    let raw = direct(&dir);
    let spec = RewardModelSpec {
        batch_size: 8,
        normalize: Normalize::Running,
        scale: 2.0,
        shift: 1.0,
        ..RewardModelSpec::new("rm")
    };
    let rm = RewardModel::load(&dir, spec, &Device::Cpu).unwrap();
    let got: Vec<f64> = rm
        .score_batch(&inputs())
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let n = raw.len() as f64;
    let mean = raw.iter().sum::<f64>() / n;
    let std = (raw.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    for (g, r) in got.iter().zip(&raw) {
        assert!((g - (2.0 * (r - mean) / std + 1.0)).abs() < 1e-6, "{g} {r}");
    }
    // The statistics carry over: the same batch again is normalised by the same mean and std
    // (every value is seen twice), so the scores repeat.
    let again: Vec<f64> = rm
        .score_batch(&inputs())
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for (a, g) in again.iter().zip(&got) {
        assert!((a - g).abs() < 1e-6);
    }
}

#[test]
fn a_classifier_with_two_labels_is_refused() {
    let dir = checkpoint("rm-two-labels");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["num_labels"] = 2.into();
    let model = Qwen3RewardModel::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
    let two = dir.with_file_name("rm2");
    model.save(&two, Some(&demo_policy())).unwrap();
    let e = RewardModel::load(&two, RewardModelSpec::new("rm2"), &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("num_labels"), "{e}");
}
