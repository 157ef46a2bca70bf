//! The Qwen3 sequence-classification reward model on a tiny random checkpoint written with the
//! project's own save path: the head is read at the right token, and padding or batch
//! composition does not change a score.

use candle_core::{DType, Device, Tensor};
use oxrl_fixtures::temp_dir;
use oxrl_models::reward_model::ARCHITECTURE;
use oxrl_models::Qwen3RewardModel;
use serde_json::json;

const PAD: u32 = 0;

fn config() -> serde_json::Value {
    json!({"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": true,
        "num_labels": 1, "pad_token_id": PAD})
}

/// A random reward model saved and loaded back, through a directory of the test's own (`name`):
/// tests run in parallel, and a shared one would be wiped under another test's load.
fn saved(name: &str) -> Qwen3RewardModel {
    let dir = temp_dir(name).join("rm");
    let rm = Qwen3RewardModel::random(config(), 7, DType::F32, &Device::Cpu).unwrap();
    rm.save(&dir, None).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"], json!([ARCHITECTURE]));
    Qwen3RewardModel::load(&dir, DType::F32, &Device::Cpu).unwrap()
}

/// The head applied to the hidden state at `at` of `ids` run alone, unpadded.
fn head_at(rm: &Qwen3RewardModel, ids: &[u32], at: usize) -> f32 {
    let t = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
    let hidden = rm.model.forward_hidden(&t).unwrap();
    rm.head(&hidden.get(0).unwrap().get(at).unwrap()).unwrap()[0]
}

#[test]
fn the_head_reads_the_last_non_pad_token() {
    let rm = saved("reward-model-head");
    assert_eq!((rm.num_labels, rm.pad_token_id), (1, Some(PAD)));
    let seq = vec![3, 9, 4, 27, 5];
    let got = rm.score_batch(std::slice::from_ref(&seq)).unwrap()[0][0];
    assert!((got - head_at(&rm, &seq, 4)).abs() < 1e-6, "{got}");
    assert!(
        (got - head_at(&rm, &seq, 3)).abs() > 1e-4,
        "a different token scores differently"
    );
    // Pad ids at the end of the input itself are skipped, as transformers does.
    let trailing = vec![3, 9, 4, PAD, PAD];
    let got = rm.score_batch(std::slice::from_ref(&trailing)).unwrap()[0][0];
    assert!((got - head_at(&rm, &trailing, 2)).abs() < 1e-6);
    assert_eq!(rm.pooled_index(&[PAD, PAD], 2), 0, "all padding: index 0");
}

#[test]
fn padding_and_batch_composition_do_not_change_scores() {
    let rm = saved("reward-model-padding");
    let seqs = vec![vec![5, 6], vec![7, 8, 9, 10, 11, 12, 13], vec![1, 2, 3, 4]];
    let alone: Vec<f32> = seqs
        .iter()
        .map(|s| rm.score_batch(std::slice::from_ref(s)).unwrap()[0][0])
        .collect();
    let together = rm.score_batch(&seqs).unwrap();
    let reversed = rm
        .score_batch(&seqs.iter().rev().cloned().collect::<Vec<_>>())
        .unwrap();
    for i in 0..3 {
        assert!((together[i][0] - alone[i]).abs() < 1e-5, "{i}");
        assert!((reversed[2 - i][0] - alone[i]).abs() < 1e-5, "{i}");
    }
    assert!(
        (alone[0] - alone[1]).abs() > 1e-4,
        "distinct inputs, distinct scores"
    );
}

#[test]
fn a_causal_lm_checkpoint_or_a_missing_head_is_an_error() {
    let dir = temp_dir("reward-model-errors");
    let rm = Qwen3RewardModel::random(config(), 1, DType::F32, &Device::Cpu).unwrap();
    rm.model.save(&dir.join("lm"), None).unwrap();
    let e = Qwen3RewardModel::load(&dir.join("lm"), DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("score.weight"), "{e}");
    let mut cfg = config();
    cfg["architectures"] = json!(["Qwen3ForCausalLM"]);
    std::fs::write(dir.join("lm/config.json"), cfg.to_string()).unwrap();
    let e = Qwen3RewardModel::load(&dir.join("lm"), DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("architectures") && e.contains(ARCHITECTURE),
        "{e}"
    );
    let too_long = vec![1; 65];
    assert!(rm.score_batch(&[too_long]).is_err());
}
