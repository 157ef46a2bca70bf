//! One GRPO update step against verl's numbers in `../shared/fixtures/grpo-step/`, with the
//! tolerances its README states.

use candle_core::{DType, Device};
use oxrl_algo::{AdvantageConfig, KlEstimator, LossAgg, PolicyLossConfig};
use oxrl_fixtures::fixture;
use oxrl_models::Qwen3;
use oxrl_train::{
    learn, read_trajectories, AdamWConfig, AlgorithmConfig, Learned, LrSchedule, OldLogprobs,
    PhaseTimes, PolicyTrainer, UpdateConfig,
};
use serde_json::Value;

fn algorithm() -> AlgorithmConfig {
    AlgorithmConfig {
        advantage: AdvantageConfig {
            eps: 1e-6,
            ..Default::default()
        },
        policy_loss: PolicyLossConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            ..Default::default()
        },
        kl_coef: 0.01,
        kl_estimator: KlEstimator::K3,
        loss_agg: LossAgg::TokenMean,
        kl_loss_agg: LossAgg::TokenMean,
        loss_scale_factor: 1.0,
        old_logprobs: OldLogprobs::Rollout,
        entropy_coef: 0.0,
        overlong_filter: false,
        rollout_correction: None,
        kl_in_reward: None,
    }
}

fn update(micro_batch_size: usize) -> UpdateConfig {
    UpdateConfig {
        temperature: 1.0,
        mini_batch_size: None,
        micro_batch_size,
        ppo_epochs: 1,
        max_grad_norm: 1.0,
        optimizer: AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        },
        lr_schedule: LrSchedule::Constant,
        warmup_steps: 0,
        total_steps: 1,
    }
}

/// The fixture's policy and reference computing in `dtype`, with the f32 master weights read
/// from the checkpoint.
fn trainer(dtype: DType, micro_batch_size: usize) -> PolicyTrainer {
    saving_trainer(dtype, micro_batch_size, Saving::default())
}

/// Memory savers of the training path: layer checkpointing, lm_head in chunks of rows.
#[derive(Debug, Clone, Copy, Default)]
struct Saving {
    checkpointing: bool,
    chunk_rows: Option<usize>,
}

/// [`trainer`], with the memory savers asked for.
fn saving_trainer(dtype: DType, micro_batch_size: usize, saving: Saving) -> PolicyTrainer {
    let dir = fixture("grpo-step");
    let mut policy = Qwen3::load(&dir.join("policy"), dtype, &Device::Cpu).unwrap();
    policy.gradient_checkpointing = saving.checkpointing;
    if let Some(rows) = saving.chunk_rows {
        policy.logit_chunk_elements = rows * policy.config.vocab_size;
    }
    let reference = Qwen3::load(&dir.join("ref"), dtype, &Device::Cpu).unwrap();
    let mut trainer = PolicyTrainer::new(
        Box::new(policy),
        Some(Box::new(reference)),
        algorithm(),
        update(micro_batch_size),
    )
    .unwrap();
    trainer.master_weights_from(&dir.join("policy")).unwrap();
    trainer
}

/// One step on the fixture's rollouts.
fn step(trainer: &mut PolicyTrainer) -> Learned {
    let trajs = read_trajectories(&fixture("grpo-step/rollouts.jsonl")).unwrap();
    learn(trainer, &trajs, &mut PhaseTimes::default()).unwrap()
}

fn run(micro_batch_size: usize) -> (PolicyTrainer, Learned) {
    run_saving(micro_batch_size, Saving::default())
}

fn run_saving(micro_batch_size: usize, saving: Saving) -> (PolicyTrainer, Learned) {
    let mut trainer = saving_trainer(DType::F32, micro_batch_size, saving);
    let learned = step(&mut trainer);
    (trainer, learned)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("grpo-step/expected.json")).unwrap())
        .unwrap()
}

fn rel_close(got: f64, want: f64, rel: f64, abs: f64, what: &str) {
    let tol = (rel * want.abs()).max(abs);
    assert!(
        (got - want).abs() <= tol,
        "{what}: {got} vs {want} (tolerance {tol})"
    );
}

fn per_token(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

/// The step matches verl's, plain, with gradient checkpointing, and with checkpointing and the
/// lm_head + log-probs in chunks of 5 rows.
#[test]
fn grpo_step_matches_verl() {
    for (checkpointing, chunk_rows) in [(false, None), (true, None), (true, Some(5))] {
        step_matches_verl(Saving {
            checkpointing,
            chunk_rows,
        });
    }
}

fn step_matches_verl(saving: Saving) {
    let want = expected();
    let (trainer, learned) = run_saving(12, saving);
    let report = &learned.report;
    for (row, w) in learned
        .advantages
        .iter()
        .zip(want["advantages"].as_array().unwrap())
    {
        // GRPO gives every token of a response its sequence's advantage.
        for g in row {
            assert!(
                (g - w.as_f64().unwrap()).abs() <= 1e-6,
                "advantage {g} vs {w}"
            );
        }
    }
    for (name, got) in [
        ("logprobs", &report.logprobs),
        ("ref_logprobs", learned.reference.as_ref().unwrap()),
    ] {
        for (g, w) in got
            .iter()
            .flatten()
            .zip(per_token(&want[name]).iter().flatten())
        {
            assert!((*g as f64 - w).abs() <= 1e-4, "{name}: {g} vs {w}");
        }
    }
    for (g, w) in report
        .ratios
        .iter()
        .flatten()
        .zip(per_token(&want["ratio"]).iter().flatten())
    {
        rel_close(*g as f64, *w, 1e-4, 0.0, "ratio");
    }
    let m = &report.metrics;
    for key in ["pg_loss", "kl", "loss"] {
        rel_close(m[key], want[key].as_f64().unwrap(), 1e-4, 1e-6, key);
    }
    rel_close(
        m["grad_norm"],
        want["grad_norm"].as_f64().unwrap(),
        1e-4,
        0.0,
        "grad_norm",
    );
    assert!((m["pg_clipfrac"] - want["pg_clipfrac"].as_f64().unwrap()).abs() <= 1e-6);
    assert_eq!(
        (m["pg_clipfrac"] * 78.0).round() as u64,
        want["pg_clipped_tokens"].as_u64().unwrap()
    );
    assert_eq!(m["pg_clipfrac_lower"], 0.0);
    let per_param = want["grad_norm_per_param"].as_object().unwrap();
    assert_eq!(per_param.len(), report.grad_norm_per_param.len());
    for (name, norm) in &report.grad_norm_per_param {
        rel_close(*norm, per_param[name].as_f64().unwrap(), 1e-3, 0.0, name);
    }
    // The parameters after the step, in named_parameters() order.
    let after = want["params_after_step"].as_array().unwrap();
    let params = trainer.policy.named_parameters().unwrap();
    assert_eq!(params.len(), after.len());
    for ((name, t), w) in params.iter().zip(after) {
        assert_eq!(name, w["name"].as_str().unwrap());
        let v: Vec<f64> = t
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        let sum: f64 = v.iter().sum();
        let l2 = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            (sum - w["sum"].as_f64().unwrap()).abs() <= 2e-4,
            "{name}: sum {sum} vs {}",
            w["sum"]
        );
        rel_close(
            l2,
            w["l2"].as_f64().unwrap(),
            1e-6,
            0.0,
            &format!("{name} l2"),
        );
    }
    let full = want["full_values_after_step"].as_object().unwrap();
    for (name, values) in full {
        let t = &params.iter().find(|(n, _)| n == name).unwrap().1;
        let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (g, w) in got.iter().zip(values.as_array().unwrap()) {
            assert!(
                (*g as f64 - w.as_f64().unwrap()).abs() <= 2e-6,
                "{name}: {g} vs {w}"
            );
        }
    }
}

/// The same step split into micro-batches of 5 (5 + 5 + 2 trajectories, groups cut across
/// micro-batches) gives the same loss, gradient norm and weights.
#[test]
fn micro_batching_does_not_change_the_step() {
    let (whole_trainer, whole) = run(12);
    let (split_trainer, split) = run(5);
    for key in ["loss", "pg_loss", "kl", "grad_norm", "pg_clipfrac"] {
        rel_close(
            split.report.metrics[key],
            whole.report.metrics[key],
            1e-5,
            1e-7,
            key,
        );
    }
    for ((n, a), (_, b)) in whole_trainer
        .policy
        .named_parameters()
        .unwrap()
        .iter()
        .zip(split_trainer.policy.named_parameters().unwrap())
    {
        let d = (a - &b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d <= 1e-6, "{n}: {d}");
    }
}

/// bf16 mixed precision (bf16 weights and activations; f32 master weights from the checkpoint,
/// moments, norms, softmax and log-probs) against the f32 step that matches verl. The loss
/// terms move by bf16's rounding of the activations; the update moves each master weight by
/// about lr·sign(g) in both, so the two updates agree wherever the gradient's sign survives
/// bf16. Tolerances (README, "bf16"): loss terms and grad_norm within 1% of the f32 step (measured: 0.2–0.3%); the
/// updates' cosine similarity ≥ 0.95; no master weight further than 2.1·lr from the f32 one.
#[test]
fn bf16_step_stays_close_to_the_f32_step() {
    let (f32_trainer, f32_step) = run(12);
    let mut trainer = trainer(DType::BF16, 12);
    let before = trainer.optimizer.state().unwrap();
    let bf16_step = step(&mut trainer);
    for key in ["loss", "pg_loss", "kl", "grad_norm"] {
        let (got, want) = (bf16_step.report.metrics[key], f32_step.report.metrics[key]);
        eprintln!(
            "{key}: bf16 {got} f32 {want} rel {}",
            (got - want).abs() / want.abs()
        );
        rel_close(got, want, 0.01, 0.0, key);
    }
    let (after_bf16, after_f32) = (
        trainer.optimizer.state().unwrap(),
        f32_trainer.optimizer.state().unwrap(),
    );
    let (mut dot, mut nb, mut nf, mut worst) = (0f64, 0f64, 0f64, 0f64);
    for ((b0, b1), f1) in before.iter().zip(&after_bf16).zip(&after_f32) {
        for ((w0, wb), wf) in b0.master.iter().zip(&b1.master).zip(&f1.master) {
            let (db, df) = ((wb - w0) as f64, (wf - w0) as f64);
            dot += db * df;
            nb += db * db;
            nf += df * df;
            worst = worst.max((wb - wf).abs() as f64);
        }
    }
    let cosine = dot / (nb.sqrt() * nf.sqrt());
    eprintln!("update cosine {cosine}, largest master difference {worst}");
    assert!(cosine >= 0.95, "update cosine {cosine}");
    assert!(worst <= 2.1e-3, "largest master difference {worst}");
    // The policy computes with the masters' bf16 rounding.
    for ((name, t), p) in trainer
        .policy
        .named_parameters()
        .unwrap()
        .iter()
        .zip(&after_bf16)
    {
        assert_eq!(t.dtype(), DType::BF16, "{name}");
        let rounded = candle_core::Tensor::from_slice(&p.master, t.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let same = t.eq(&rounded).unwrap().to_dtype(DType::F32).unwrap();
        let same = same.mean_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(same, 1.0, "{name}");
    }
}

/// A bf16 policy's f32 masters are the checkpoint's f32 values exactly, read shard by shard
/// from a sharded checkpoint as from a single file.
#[test]
fn bf16_master_weights_are_the_checkpoints_f32_values_from_shards_too() {
    let dir = fixture("grpo-step").join("policy");
    let f32_policy = Qwen3::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let sharded = oxrl_fixtures::temp_dir("masters-sharded");
    f32_policy
        .save_with(&sharded, None, 20_000, &|_| Ok(()))
        .unwrap();
    assert!(sharded.join("model.safetensors.index.json").exists());
    let masters = |from: &std::path::Path| {
        let load = || Box::new(Qwen3::load(&dir, DType::BF16, &Device::Cpu).unwrap());
        let mut trainer =
            PolicyTrainer::new(load(), Some(load()), algorithm(), update(12)).unwrap();
        trainer.master_weights_from(from).unwrap();
        trainer.optimizer.state().unwrap()
    };
    let (single, shards) = (masters(&dir), masters(&sharded));
    let want: Vec<_> = f32_policy.named_parameters();
    assert_eq!(single.len(), want.len());
    for (((name, w), a), b) in want.iter().zip(&single).zip(&shards) {
        let w = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a.master, w, "{name} from the single file");
        assert_eq!(b.master, w, "{name} from the shards");
    }
}

/// REINFORCE++ with γ < 1 gives each token its own advantage, and those reach the loss: the
/// step's pg_loss is the token mean of −min(ρ·A_t, clip(ρ)·A_t) over the per-token A_t.
#[test]
fn per_token_advantages_reach_the_policy_loss() {
    let mut trainer = trainer(DType::F32, 4);
    trainer.algorithm.advantage = AdvantageConfig {
        estimator: oxrl_algo::AdvantageEstimator::ReinforcePlusPlus,
        gamma: 0.5,
        ..Default::default()
    };
    let trajs = read_trajectories(&fixture("grpo-step/rollouts.jsonl")).unwrap();
    let learned = learn(&mut trainer, &trajs, &mut PhaseTimes::default()).unwrap();
    let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
    let lens: Vec<usize> = trajs.iter().map(|t| t.response_ids.len()).collect();
    let want = oxrl_algo::returns::reinforce_plus_plus(
        &oxrl_algo::returns::outcome_token_rewards(&rewards, &lens),
        0.5,
    );
    assert_eq!(learned.advantages, want.advantages);
    assert!(
        learned
            .advantages
            .iter()
            .any(|row| row.iter().any(|a| *a != row[0])),
        "γ = 0.5 should vary the advantages within a response"
    );
    assert_pg_loss_by_hand(&learned, None);
}

/// pg_loss is the token mean of −min(ρA, clip(ρ, 0.8, 1.28)·A) over the tokens `keep` says
/// (every token without it), from the update's own ratios and advantages.
fn assert_pg_loss_by_hand(learned: &Learned, keep: Option<&[Vec<bool>]>) {
    let (mut sum, mut n) = (0.0, 0.0);
    for (i, (ratios, adv)) in learned
        .report
        .ratios
        .iter()
        .zip(&learned.advantages)
        .enumerate()
    {
        for (k, (&rho, &a)) in ratios.iter().zip(adv).enumerate() {
            if keep.is_some_and(|keep| !keep[i][k]) {
                continue;
            }
            let rho = rho as f64;
            sum += -(rho * a).min(rho.clamp(1.0 - 0.2, 1.0 + 0.28) * a);
            n += 1.0;
        }
    }
    rel_close(
        learned.report.metrics["pg_loss"],
        sum / n,
        1e-5,
        1e-7,
        "pg_loss",
    );
}

/// Rollout correction on the fixture's step, with the engine's log-probs pushed off the
/// trainer's by a fixed pattern (+0.6, −0.3, +0.1, 0 per token): with token IS weights capped
/// at 1.2 and the token ratio kept within [1/1.5, 1.5], the +0.6 tokens (ratio 0.55) leave the
/// loss, the −0.3 ones (ratio 1.35) weigh 1.2, and pg_loss is the IS-weighted token mean over
/// the kept tokens only.
#[test]
fn rollout_correction_weights_and_masks_reach_the_loss() {
    use oxrl_algo::rollout_corr::{IsConfig, RejectRule, RolloutCorrectionConfig};
    let mut trainer = trainer(DType::F32, 4);
    trainer.algorithm.old_logprobs = OldLogprobs::Recompute;
    trainer.algorithm.rollout_correction = Some(RolloutCorrectionConfig {
        is: Some(IsConfig::parse("token", "1.2").unwrap()),
        rules: vec![RejectRule::parse("token_k1", "1.5").unwrap()],
    });
    let mut trajs = read_trajectories(&fixture("grpo-step/rollouts.jsonl")).unwrap();
    // The engine's log-prob of each token: the trainer's own, shifted.
    let trainers = trainer.old_logprobs(&trajs).unwrap().logprobs;
    let shift = [0.6f32, -0.3, 0.1, 0.0];
    for (i, t) in trajs.iter_mut().enumerate() {
        for (j, lp) in t.rollout_logprobs.iter_mut().enumerate() {
            *lp = trainers[i][j] + shift[(i + j) % 4];
        }
    }
    let learned = learn(&mut trainer, &trajs, &mut PhaseTimes::default()).unwrap();
    let c = learned
        .old
        .correction
        .as_ref()
        .expect("rollout correction ran");
    let (weights, keep) = (c.weights.as_ref().unwrap(), c.keep.as_ref().unwrap());
    let (mut sum, mut kept, mut capped, mut dropped) = (0.0, 0.0, 0, 0);
    for (i, t) in trajs.iter().enumerate() {
        for j in 0..t.response_ids.len() {
            match (i + j) % 4 {
                // +0.6
                0 => assert!(!keep[i][j], "traj {i} token {j} kept"),
                // −0.3
                1 => {
                    assert!(keep[i][j]);
                    assert!((weights[i][j] - 1.2).abs() < 1e-12);
                }
                _ => assert!(keep[i][j]),
            }
            capped += (weights[i][j] == 1.2) as usize;
            dropped += !keep[i][j] as usize;
            if keep[i][j] {
                let (rho, a) = (learned.report.ratios[i][j] as f64, learned.advantages[i][j]);
                sum += -weights[i][j] * (rho * a).min(rho.clamp(1.0 - 0.2, 1.0 + 0.28) * a);
                kept += 1.0;
            }
        }
    }
    assert!(capped > 0 && dropped > 0);
    let m = &learned.report.metrics;
    rel_close(m["pg_loss"], sum / kept, 1e-5, 1e-7, "pg_loss");
    let tokens = trajs.iter().map(|t| t.response_ids.len()).sum::<usize>() as f64;
    rel_close(
        m["rollout_corr/rollout_rs_masked_fraction"],
        dropped as f64 / tokens,
        1e-12,
        1e-12,
        "rollout_rs_masked_fraction",
    );
    for key in [
        "rollout_corr/rollout_is_mean",
        "rollout_corr/kl",
        "rollout_corr/chi2_token",
    ] {
        assert!(m[key].is_finite(), "{key}");
    }

    // The engine's own numbers as logp_old leave nothing to correct: refused by name.
    trainer.algorithm.old_logprobs = OldLogprobs::Rollout;
    let e = learn(&mut trainer, &trajs, &mut PhaseTimes::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("old_logprobs = \"recompute\""), "{e}");
}

/// PPO's critic on the fixture's policy checkpoint (a fresh value head from `seed`).
fn critic(micro_batch_size: usize, lr: f64) -> oxrl_train::critic::Critic {
    let dir = fixture("grpo-step").join("policy");
    let config = oxrl_train::critic::CriticConfig {
        path: dir.display().to_string(),
        optimizer: AdamWConfig {
            lr,
            ..update(1).optimizer
        },
        value_clip: Some(0.5),
        ppo_epochs: 1,
        mini_batch_size: None,
        micro_batch_size,
        max_grad_norm: 1.0,
        loss_agg: LossAgg::TokenMean,
        warmup_steps: 0,
    };
    oxrl_train::critic::Critic::load(config, &dir, DType::F32, &Device::Cpu, 7).unwrap()
}

/// ½·mean over tokens of (V − R)².
fn half_mse(values: &[Vec<f64>], returns: &[Vec<f64>]) -> f64 {
    let pairs: Vec<(f64, f64)> = values
        .iter()
        .flatten()
        .copied()
        .zip(returns.iter().flatten().copied())
        .collect();
    pairs
        .iter()
        .map(|(v, r)| 0.5 * (v - r).powi(2))
        .sum::<f64>()
        / pairs.len() as f64
}

/// A PPO step: GAE bootstraps from the critic's values as they were before the step, the
/// critic's first forward sees exactly those values (so nothing is clipped), its loss is the
/// half squared error to the returns, and the critic's own updates then bring it down.
#[test]
fn ppo_step_bootstraps_gae_from_the_critic_and_fits_the_returns() {
    let mut trainer = trainer(DType::F32, 4);
    trainer.algorithm.advantage = AdvantageConfig {
        estimator: oxrl_algo::AdvantageEstimator::Gae,
        gamma: 1.0,
        lam: 0.95,
        ..Default::default()
    };
    trainer.critic = Some(critic(3, 1e-3));
    let trajs = read_trajectories(&fixture("grpo-step/rollouts.jsonl")).unwrap();
    let before = trainer.critic.as_ref().unwrap().values(&trajs).unwrap();
    let learned = learn(&mut trainer, &trajs, &mut PhaseTimes::default()).unwrap();
    let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
    let lens: Vec<usize> = trajs.iter().map(|t| t.response_ids.len()).collect();
    let want = oxrl_algo::returns::gae(
        &oxrl_algo::returns::outcome_token_rewards(&rewards, &lens),
        &before,
        1.0,
        0.95,
    );
    assert_eq!(learned.advantages, want.advantages);
    let m = &learned.report.metrics;
    let tokens: usize = lens.iter().sum();
    let mean_v = before.iter().flatten().sum::<f64>() / tokens as f64;
    rel_close(
        m["critic/vpred_mean"],
        mean_v,
        1e-5,
        1e-6,
        "critic/vpred_mean",
    );
    rel_close(
        m["critic/vf_loss"],
        half_mse(&before, &want.returns),
        1e-5,
        1e-7,
        "critic/vf_loss",
    );
    assert_eq!(m["critic/vf_clipfrac"], 0.0);
    let ev = oxrl_algo::value_loss::explained_variance(&want.returns, &before).unwrap();
    assert_eq!(m["critic/vf_explained_var"], ev);
    assert!(m.contains_key("pg_loss") && m.contains_key("critic/grad_norm"));
    // Further critic updates on the same targets keep lowering the value loss.
    let critic = trainer.critic.as_mut().unwrap();
    let first = half_mse(&before, &want.returns);
    for _ in 0..4 {
        let now = critic.values(&trajs).unwrap();
        critic.update(&trajs, &now, &want.returns).unwrap();
    }
    let after = half_mse(&critic.values(&trajs).unwrap(), &want.returns);
    assert!(after < 0.5 * first, "value loss {first} → {after}");
}

/// The critic's checkpoint (`critic/` of a training checkpoint) brings back the same values and,
/// with the optimizer state, the same next update.
#[test]
fn a_saved_critic_resumes_its_values_and_its_optimizer() {
    let trajs = read_trajectories(&fixture("grpo-step/rollouts.jsonl")).unwrap();
    let mut original = critic(4, 1e-3);
    let values = original.values(&trajs).unwrap();
    let returns: Vec<Vec<f64>> = values
        .iter()
        .map(|r| r.iter().map(|v| v + 1.0).collect())
        .collect();
    original.update(&trajs, &values, &returns).unwrap();
    let tmp = oxrl_fixtures::temp_dir("critic-resume");
    original.save_into(&tmp).unwrap();
    let dir = tmp.join(oxrl_train::critic::CRITIC_DIR);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "Qwen3ForTokenClassification");
    assert_eq!(config["num_labels"], 1);
    let mut resumed = oxrl_train::critic::Critic::load(
        original.config.clone(),
        &dir,
        DType::F32,
        &Device::Cpu,
        99,
    )
    .unwrap();
    resumed
        .restore_optimizer(&tmp, original.optimizer_steps())
        .unwrap();
    let now = original.values(&trajs).unwrap();
    assert_eq!(resumed.values(&trajs).unwrap(), now);
    original.update(&trajs, &now, &returns).unwrap();
    resumed.update(&trajs, &now, &returns).unwrap();
    assert_eq!(
        resumed.values(&trajs).unwrap(),
        original.values(&trajs).unwrap()
    );
}

/// `use_kl_in_reward`: every token's reward gets −β·k1(logp_old, logp_ref), the estimator sees
/// those per-token rewards, there is no KL loss term, and the adaptive controller moves β for
/// the next step.
#[test]
fn kl_in_reward_penalises_each_token_instead_of_the_loss() {
    use oxrl_algo::kl_reward::{KlControl, KlInReward};
    let mut trainer = trainer(DType::F32, 4);
    trainer.algorithm.advantage = AdvantageConfig {
        estimator: oxrl_algo::AdvantageEstimator::ReinforcePlusPlus,
        ..Default::default()
    };
    let control = KlControl::Adaptive {
        target: 1e-4,
        horizon: 100.0,
    };
    trainer.algorithm.kl_in_reward = Some(KlInReward {
        coef: 0.5,
        control,
        estimator: KlEstimator::K1,
    });
    let trajs = read_trajectories(&fixture("grpo-step/rollouts.jsonl")).unwrap();
    let learned = learn(&mut trainer, &trajs, &mut PhaseTimes::default()).unwrap();
    let reference = learned.reference.as_ref().unwrap();
    let penalties: Vec<Vec<f64>> = learned
        .old
        .logprobs
        .iter()
        .zip(reference)
        .map(|(o, r)| {
            o.iter()
                .zip(r)
                .map(|(o, r)| -0.5 * (o - r) as f64)
                .collect()
        })
        .collect();
    assert!(
        penalties.iter().flatten().any(|p| p.abs() > 1e-6),
        "the policy and reference differ"
    );
    let rewards: Vec<f64> = trajs.iter().map(|t| t.reward).collect();
    let uids: Vec<&str> = trajs.iter().map(|t| t.uid.as_str()).collect();
    let lens: Vec<usize> = trajs.iter().map(|t| t.response_ids.len()).collect();
    let inputs = oxrl_algo::AdvantageInputs {
        rewards: &rewards,
        uids: &uids,
        token_counts: &lens,
        token_penalties: Some(&penalties),
        values: None,
    };
    let want = oxrl_algo::estimate_advantages(&inputs, &trainer.algorithm.advantage).unwrap();
    for (g, w) in learned
        .advantages
        .iter()
        .flatten()
        .zip(want.advantages.iter().flatten())
    {
        assert!((g - w).abs() < 1e-9, "{g} vs {w}");
    }
    let m = &learned.report.metrics;
    assert_eq!(m["kl"], 0.0, "no KL loss term with the KL in the reward");
    assert_eq!(m["reward_kl_penalty_coeff"], 0.5);
    let kl = m["reward_kl_penalty"];
    let error = (kl / 1e-4 - 1.0).clamp(-0.2, 0.2);
    let beta = trainer.algorithm.kl_in_reward.as_ref().unwrap().coef;
    rel_close(
        beta,
        0.5 * (1.0 + error * trajs.len() as f64 / 100.0),
        1e-12,
        0.0,
        "β",
    );
}

/// A multi-turn episode's environment tokens (`loss_mask` false) leave the loss: pg_loss is the
/// token mean over the policy's own tokens only. The token-level estimators refuse episodes.
#[test]
fn environment_tokens_stay_out_of_the_loss() {
    let mut trainer = trainer_without_kl();
    let mut trajs = read_trajectories(&fixture("grpo-step/rollouts.jsonl")).unwrap();
    for t in &mut trajs {
        t.loss_mask = (0..t.response_ids.len()).map(|k| k % 3 != 1).collect();
    }
    let learned = learn(&mut trainer, &trajs, &mut PhaseTimes::default()).unwrap();
    let masks: Vec<Vec<bool>> = trajs.iter().map(|t| t.loss_mask.clone()).collect();
    assert_pg_loss_by_hand(&learned, Some(&masks));
    let mut trainer = trainer_without_kl();
    trainer.algorithm.advantage.estimator = oxrl_algo::AdvantageEstimator::ReinforcePlusPlus;
    let e = learn(&mut trainer, &trajs, &mut PhaseTimes::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("multi-turn episode") && e.contains("reinforce_plus_plus"),
        "{e}"
    );
    trajs[0].loss_mask.pop();
    let e = learn(
        &mut trainer_without_kl(),
        &trajs,
        &mut PhaseTimes::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("loss_mask has"), "{e}");
}

fn trainer_without_kl() -> PolicyTrainer {
    let mut trainer = trainer(DType::F32, 4);
    trainer.algorithm.kl_coef = 0.0;
    trainer.reference = None;
    trainer
}
