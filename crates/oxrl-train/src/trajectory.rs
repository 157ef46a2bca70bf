//! Trajectories: what a rollout produced for one sampled response, as plain data that can be
//! written by one run and trained on by another (`oxrl train --rollouts`).

pub use crate::error::TrajectoryError;
use oxrl_models::{ImagePrompting, ImageSource, ProcessedImage};
use oxrl_rollout::WeightVersion;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// The prompt's id: trajectories with the same uid form a group.
    pub uid: String,
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    pub reward: f64,
    /// Per response token, the sampling engine's log-probability.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rollout_logprobs: Vec<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// The policy weights that sampled it; absent in a hand-made or foreign rollout file, which
    /// the trainer then takes as off-policy by the user's choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<WeightVersion>,
    /// The prompt's images (Qwen3-VL), as paths (relative ones to the rollout file) or `data:`
    /// URLs, in the order of their tokens in `prompt_ids`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<String>,
    /// The images processed for the policy: filled by the rollout, or by
    /// [`attach_images`] for a file.
    #[serde(skip)]
    pub pixels: Vec<Arc<ProcessedImage>>,
    /// Per response token, whether it enters the loss: `false` for the observation tokens an
    /// environment wrote into a multi-turn episode. Empty: every token does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loss_mask: Vec<bool>,
}

/// Loads and processes the images of trajectories read from `path` for a policy that takes them,
/// expanding each image's single pad in `prompt_ids` when the file holds the compact form.
pub fn attach_images(
    trajs: &mut [Trajectory],
    path: &Path,
    prompting: Option<&ImagePrompting>,
) -> Result<(), TrajectoryError> {
    let base = path.parent().unwrap_or(Path::new("."));
    for (i, t) in trajs.iter_mut().enumerate() {
        if t.images.is_empty() {
            continue;
        }
        let bad = |e: oxrl_models::ModelError| TrajectoryError::Line {
            path: path.display().to_string(),
            line: i + 1,
            message: e.to_string(),
        };
        let sources: Vec<ImageSource> = t
            .images
            .iter()
            .map(|r| ImageSource::from_reference(r, base))
            .collect();
        t.pixels = ImagePrompting::prepare_with(prompting, &sources).map_err(bad)?;
        if let Some(p) = prompting {
            t.prompt_ids = p.expand(&t.prompt_ids, &t.pixels).map_err(bad)?;
        }
    }
    Ok(())
}

/// Reads a JSONL file of trajectories; errors name the file and line.
pub fn read_trajectories(path: &Path) -> Result<Vec<Trajectory>, TrajectoryError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TrajectoryError::Io {
        path: shown.clone(),
        source,
    })?;
    parse_trajectories(&text, &shown)
}

/// The trajectories of JSONL `text` (from the file named `shown`), checked as `--rollouts`
/// needs them.
pub fn parse_trajectories(text: &str, shown: &str) -> Result<Vec<Trajectory>, TrajectoryError> {
    let shown = shown.to_string();
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let bad = |message: String| TrajectoryError::Line {
            path: shown.clone(),
            line: i + 1,
            message,
        };
        let t: Trajectory = serde_json::from_str(raw).map_err(|e| bad(e.to_string()))?;
        if t.prompt_ids.is_empty() || t.response_ids.is_empty() {
            return Err(bad(
                "`prompt_ids` and `response_ids` must each hold at least one token".into(),
            ));
        }
        if !t.rollout_logprobs.is_empty() && t.rollout_logprobs.len() != t.response_ids.len() {
            return Err(bad(format!(
                "`rollout_logprobs` has {} values for {} response tokens",
                t.rollout_logprobs.len(),
                t.response_ids.len()
            )));
        }
        if !t.reward.is_finite() {
            return Err(bad(format!(
                "`reward` must be a finite number, got {}",
                t.reward
            )));
        }
        out.push(t);
    }
    if out.is_empty() {
        return Err(TrajectoryError::Line {
            path: shown,
            line: 0,
            message: "no trajectories".into(),
        });
    }
    Ok(out)
}
