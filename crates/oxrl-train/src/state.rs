//! Training checkpoints: a Hugging Face model directory (`checkpoint-<step>/`) that transformers
//! loads unchanged (a LoRA run's: its adapter in PEFT's format, which `PeftModel.from_pretrained`
//! loads onto the base), plus `optimizer.safetensors` (f32 master weights and AdamW moments) and
//! `trainer_state.json` (step, data cursor, seed), all written before the directory appears
//! under its final name, so `--resume` never picks up half a checkpoint.

use crate::data::DataCursor;
use crate::optim::{AdamW, ParamState};
use crate::update::{PolicyTrainer, Result, TrainError};
use candle_core::Tensor;
use oxrl_models::checkpoint::{
    copy_side_files, save_safetensors_synced, write_dir_atomically, write_synced, MAX_SHARD_BYTES,
};
use oxrl_models::{ModelError, HOST};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const TRAINER_STATE: &str = "trainer_state.json";
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Training steps completed.
    pub step: u64,
    pub optimizer_step: u64,
    pub data: DataCursor,
    pub seed: u64,
    /// ZeRO-2: the number of ranks whose parts of the optimizer state the checkpoint holds
    /// (`optimizer-rank-R-of-W.safetensors`); absent when it holds the whole state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_shards: Option<usize>,
    /// PPO: the critic's optimizer steps (its model and optimizer are in `critic/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_optimizer_step: Option<u64>,
    /// The KL-in-reward coefficient β reached (an adaptive controller moves it each step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_reward_coef: Option<f64>,
}

/// Writes `dir/optimizer.safetensors`: each parameter's f32 master weights and AdamW moments as
/// `<name>.master`, `<name>.exp_avg`, `<name>.exp_avg_sq`.
pub fn write_optimizer_state(
    vars: &[(String, candle_core::Var)],
    params: &[ParamState],
    dir: &Path,
) -> Result<()> {
    let mut tensors = HashMap::new();
    for ((name, _), p) in vars.iter().zip(params) {
        for (suffix, data) in [
            ("master", &p.master),
            ("exp_avg", &p.exp_avg),
            ("exp_avg_sq", &p.exp_avg_sq),
        ] {
            let t = Tensor::from_slice(data, data.len(), &HOST)?;
            tensors.insert(format!("{name}.{suffix}"), t);
        }
    }
    save_safetensors_synced(&tensors, &dir.join(OPTIMIZER_STATE))?;
    Ok(())
}

/// Reads what [`write_optimizer_state`] wrote for `vars`, in their order; a missing tensor is
/// an error naming the file and the key.
pub fn read_optimizer_state(
    vars: &[(String, candle_core::Var)],
    dir: &Path,
) -> Result<Vec<ParamState>> {
    let path = dir.join(OPTIMIZER_STATE);
    let mut tensors =
        candle_core::safetensors::load(&path, &HOST).map_err(|source| ModelError::Safetensors {
            path: path.clone(),
            source,
        })?;
    let mut params = Vec::new();
    for (name, _) in vars {
        let mut take = |suffix: &str| -> Result<Vec<f32>> {
            let key = format!("{name}.{suffix}");
            let t = tensors.remove(&key).ok_or_else(|| {
                TrainError::Invalid(format!("{}: missing `{key}`", path.display()))
            })?;
            Ok(t.to_vec1::<f32>()?)
        };
        params.push(ParamState {
            master: take("master")?,
            exp_avg: take("exp_avg")?,
            exp_avg_sq: take("exp_avg_sq")?,
        });
    }
    Ok(params)
}

/// The file rank `rank` of `world` writes its part of the optimizer state to.
pub fn optimizer_shard_file(rank: usize, world: usize) -> String {
    format!("optimizer-rank-{rank}-of-{world}.safetensors")
}

/// Writes this rank's part of the optimizer state into `dir` (a checkpoint being written).
fn write_optimizer_shard(trainer: &PolicyTrainer, dir: &Path) -> Result<()> {
    let Some(zero) = &trainer.zero else {
        return Ok(());
    };
    let (rank, world) = zero.owner();
    let part = zero.state()?;
    let mut tensors = HashMap::new();
    for (name, data) in [
        ("master", &part.master),
        ("exp_avg", &part.exp_avg),
        ("exp_avg_sq", &part.exp_avg_sq),
    ] {
        tensors.insert(
            name.to_string(),
            Tensor::from_slice(data, data.len(), &HOST)?,
        );
    }
    save_safetensors_synced(&tensors, &dir.join(optimizer_shard_file(rank, world)))?;
    Ok(())
}

/// A rank other than 0 taking part in a ZeRO-2 checkpoint: it learns the directory rank 0 is
/// writing, adds its part of the optimizer state, and waits until every rank has.
pub fn save_optimizer_shard(trainer: &PolicyTrainer) -> Result<()> {
    let dirs = trainer.parallel.gather_bytes(&[])?;
    let dir = PathBuf::from(String::from_utf8_lossy(&dirs[0]).into_owned());
    write_optimizer_shard(trainer, &dir)?;
    trainer.parallel.any(false)?;
    Ok(())
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `out_dir/checkpoint-<step>/`; returns its path.
pub fn save(
    out_dir: &Path,
    trainer: &PolicyTrainer,
    state: &TrainerState,
    copy_from: Option<&Path>,
) -> Result<PathBuf> {
    let dir = out_dir.join(format!("checkpoint-{}", state.step));
    let optimizer = trainer.optimizer.state()?;
    let state = &TrainerState {
        critic_optimizer_step: trainer.critic.as_ref().map(|c| c.optimizer_steps()),
        kl_reward_coef: trainer.algorithm.kl_in_reward.as_ref().map(|k| k.coef),
        ..state.clone()
    };
    let critic = |tmp: &Path| -> oxrl_models::Result<()> {
        let Some(c) = &trainer.critic else {
            return Ok(());
        };
        c.save_into(tmp).map_err(|e| ModelError::Io {
            path: tmp.join(crate::critic::CRITIC_DIR),
            source: std::io::Error::other(e.to_string()),
        })
    };
    let sharded = |tmp: &Path| -> Result<()> {
        // Every other rank writes its part into the directory being written, then all meet.
        trainer
            .parallel
            .gather_bytes(tmp.display().to_string().as_bytes())?;
        write_optimizer_shard(trainer, tmp)?;
        trainer.parallel.any(false)?;
        Ok(())
    };
    let extra = |tmp: &Path| -> oxrl_models::Result<()> {
        critic(tmp)?;
        if trainer.zero.is_some() {
            sharded(tmp).map_err(|e| ModelError::Io {
                path: tmp.to_path_buf(),
                source: std::io::Error::other(e.to_string()),
            })?;
            let state = TrainerState {
                optimizer_shards: Some(trainer.parallel.world_size()),
                ..state.clone()
            };
            let json = serde_json::to_string_pretty(&state).unwrap_or_default();
            return write_synced(&tmp.join(TRAINER_STATE), json.as_bytes());
        }
        write_optimizer_state(trainer.vars(), &optimizer, tmp).map_err(|e| ModelError::Io {
            path: tmp.join(OPTIMIZER_STATE),
            source: std::io::Error::other(e.to_string()),
        })?;
        let json = serde_json::to_string_pretty(state).unwrap_or_default();
        write_synced(&tmp.join(TRAINER_STATE), json.as_bytes())
    };
    match trainer.policy.lora() {
        // A LoRA run's checkpoint is its adapter in PEFT's format beside the optimizer state;
        // the base model stays where `[model] path` names it.
        Some(_) => {
            let base = copy_from
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            write_dir_atomically(&dir, &|tmp| {
                trainer.policy.write_adapter(tmp, &base)?;
                copy_side_files(copy_from, tmp)?;
                extra(tmp)
            })?
        }
        None => trainer
            .policy
            .save_with(&dir, copy_from, MAX_SHARD_BYTES, &extra)?,
    }
    Ok(dir)
}

/// The newest complete checkpoint in `out_dir`, by step.
pub fn latest(out_dir: &Path) -> Option<(u64, PathBuf)> {
    std::fs::read_dir(out_dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step: u64 = name.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path()
                .join(TRAINER_STATE)
                .exists()
                .then(|| (step, e.path()))
        })
        .max_by_key(|(s, _)| *s)
}

/// Reads a checkpoint's trainer state.
pub fn load_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(TRAINER_STATE);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    serde_json::from_str(&text).map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))
}

/// Restores the optimizer's master weights and moments from a checkpoint: the whole state (a
/// ZeRO-2 group takes its parts of it, at any world size), or this rank's part of a ZeRO-2
/// checkpoint written by as many ranks. Also the critic's optimizer and the KL-in-reward β
/// the run had reached.
pub fn load_optimizer(dir: &Path, trainer: &mut PolicyTrainer, state: &TrainerState) -> Result<()> {
    if let Some(critic) = &mut trainer.critic {
        let step = state.critic_optimizer_step.ok_or_else(|| {
            TrainError::Invalid(format!(
                "{}: holds no critic (the run started without advantage = \"gae\"); resume it \
                 with the configuration it started with",
                dir.display()
            ))
        })?;
        critic.restore_optimizer(dir, step)?;
    }
    if let (Some(k), Some(coef)) = (&mut trainer.algorithm.kl_in_reward, state.kl_reward_coef) {
        k.coef = coef;
    }
    let optimizer_step = state.optimizer_step;
    if let Some(shards) = state.optimizer_shards {
        let (rank, world) = match &trainer.zero {
            Some(zero) => zero.owner(),
            None => (0, 1),
        };
        if shards != world || trainer.zero.is_none() {
            return Err(TrainError::Invalid(format!(
                "{}: holds the optimizer state as the parts of {shards} ranks (ZeRO-2), and this \
                 run has {} rank(s){}: resume it with {shards} ranks",
                dir.display(),
                trainer.parallel.world_size(),
                if trainer.zero.is_none() {
                    " without ZeRO-2"
                } else {
                    ""
                }
            )));
        }
        let path = dir.join(optimizer_shard_file(rank, world));
        let mut tensors = candle_core::safetensors::load(&path, &HOST).map_err(|source| {
            ModelError::Safetensors {
                path: path.clone(),
                source,
            }
        })?;
        let mut take = |name: &str| -> Result<Vec<f32>> {
            let t = tensors.remove(name).ok_or_else(|| {
                TrainError::Invalid(format!("{}: missing `{name}`", path.display()))
            })?;
            Ok(t.to_vec1::<f32>()?)
        };
        let part = ParamState {
            master: take("master")?,
            exp_avg: take("exp_avg")?,
            exp_avg_sq: take("exp_avg_sq")?,
        };
        return trainer.restore_optimizer_shard(part, optimizer_step);
    }
    let params = read_optimizer_state(trainer.vars(), dir)?;
    trainer.restore_optimizer(AdamW {
        config: trainer.update.optimizer,
        step: optimizer_step,
        params,
    })
}
