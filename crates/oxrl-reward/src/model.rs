//! A reward model as a reward function: `Qwen3ForSequenceClassification` scores the prompt the
//! policy saw followed by its response (`prompt + response` as text, tokenized by the reward
//! model's tokenizer without added special tokens), in batches, without gradients; then an
//! optional normalisation, `scale · s + shift`.

use crate::{RewardFn, RewardInput, Schedule};
use candle_core::{DType, Device};
use oxrl_models::{load_sequence_classifier, SequenceClassifier, Tokenizer};
use std::path::Path;
use std::sync::Mutex;

/// How raw scores are normalised before `scale` and `shift`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalize {
    None,
    /// `(s − mean) / std` over every score seen so far in the run (this batch included), so a
    /// reward model's offset and spread do not set the weight it has in a mix.
    Running,
}

impl Normalize {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "none" => Some(Normalize::None),
            "running" => Some(Normalize::Running),
            _ => None,
        }
    }
}

/// The settings of one reward model (`type = "reward_model"`).
#[derive(Debug, Clone, PartialEq)]
pub struct RewardModelSpec {
    /// A checkpoint directory or a hub id.
    pub path: String,
    pub dtype: DType,
    /// Sequences per forward.
    pub batch_size: usize,
    pub normalize: Normalize,
    pub scale: f64,
    pub shift: f64,
}

impl RewardModelSpec {
    pub fn new(path: &str) -> Self {
        Self {
            path: path.to_string(),
            dtype: DType::F32,
            batch_size: 8,
            normalize: Normalize::None,
            scale: 1.0,
            shift: 0.0,
        }
    }
}

/// Welford's running mean and variance.
#[derive(Debug, Default)]
struct Running {
    n: f64,
    mean: f64,
    m2: f64,
}

impl Running {
    fn add(&mut self, x: f64) {
        self.n += 1.0;
        let d = x - self.mean;
        self.mean += d / self.n;
        self.m2 += d * (x - self.mean);
    }

    /// The population std, 1 until two distinct values were seen.
    fn std(&self) -> f64 {
        match self.n >= 2.0 && self.m2 > 0.0 {
            true => (self.m2 / self.n).sqrt(),
            false => 1.0,
        }
    }
}

pub struct RewardModel {
    model: Box<dyn SequenceClassifier>,
    tokenizer: Tokenizer,
    spec: RewardModelSpec,
    stats: Mutex<Running>,
}

impl RewardModel {
    /// Loads the checkpoint in `dir` (already resolved from `spec.path`) through the model
    /// registry (its `architectures` must name a sequence classifier) and its tokenizer, onto
    /// `device` (the run's).
    pub fn load(dir: &Path, spec: RewardModelSpec, device: &Device) -> oxrl_models::Result<Self> {
        let model = load_sequence_classifier(dir, spec.dtype, device)?;
        if model.num_labels() != 1 {
            return Err(oxrl_models::ModelError::ConfigKey {
                path: dir.join("config.json"),
                key: "num_labels".into(),
                expected: format!(
                    "1 for a reward model (one score), got {}",
                    model.num_labels()
                ),
            });
        }
        let tokenizer = Tokenizer::from_dir(dir)?;
        Ok(Self {
            model,
            tokenizer,
            spec,
            stats: Mutex::new(Running::default()),
        })
    }

    /// Raw scores of a batch, before normalisation.
    fn raw(&self, inputs: &[RewardInput]) -> Result<Vec<f64>, String> {
        let ids = inputs
            .iter()
            .map(|i| {
                self.tokenizer
                    .encode(&format!("{}{}", i.prompt, i.response))
            })
            .collect::<oxrl_models::Result<Vec<_>>>()
            .map_err(|e| e.to_string())?;
        let scores = self.model.score_batch(&ids).map_err(|e| e.to_string())?;
        Ok(scores.into_iter().map(|s| f64::from(s[0])).collect())
    }
}

impl RewardFn for RewardModel {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        self.score_batch(std::slice::from_ref(input))
            .pop()
            .unwrap_or_else(|| Err("no score".into()))
    }

    fn score_batch(&self, inputs: &[RewardInput]) -> Vec<Result<f64, String>> {
        let raw = match self.raw(inputs) {
            Ok(r) => r,
            Err(e) => return vec![Err(e); inputs.len()],
        };
        let normalised: Vec<f64> = match self.spec.normalize {
            Normalize::None => raw,
            Normalize::Running => {
                let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
                raw.iter().for_each(|&s| stats.add(s));
                let (mean, std) = (stats.mean, stats.std());
                raw.iter().map(|s| (s - mean) / std).collect()
            }
        };
        normalised
            .into_iter()
            .map(|s| Ok(self.spec.scale * s + self.spec.shift))
            .collect()
    }

    /// One forward at a time: the forward itself uses every core.
    fn schedule(&self) -> Schedule {
        Schedule {
            batch_size: self.spec.batch_size.max(1),
            workers: Some(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_statistics_are_welfords() {
        let mut r = Running::default();
        r.add(1.0);
        assert_eq!(r.std(), 1.0, "one value: no spread yet");
        for x in [2.0, 3.0, 4.0] {
            r.add(x);
        }
        assert_eq!(r.mean, 2.5);
        assert!((r.std() - 1.25f64.sqrt()).abs() < 1e-12);
    }
}
