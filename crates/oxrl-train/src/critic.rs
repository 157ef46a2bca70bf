//! PPO's critic (`[critic]`, `advantage = "gae"`): a value model trained beside the policy.
//! Before the update it values every response token (`V_old`, which GAE bootstraps from);
//! after the advantages it fits the returns `R = A + V_old` with the clipped value loss
//! (`oxrl_algo::value_loss`), its own AdamW and its own epochs and mini-batches — verl's
//! `dp_critic` step. In a data-parallel group each rank computes its share of every
//! mini-batch and the ranks sum the gradients; every rank keeps the whole critic optimizer.

use crate::optim::{
    accumulate, adamw_on, clip_grad_norm, dense_gradients, host_values, squared_norms, AdamW,
    AdamWConfig, Optimizer,
};
use crate::parallel::DataParallel;
use crate::state::{read_optimizer_state, write_optimizer_state};
use crate::trajectory::Trajectory;
use crate::update::{requests, Result, TrainError};
use candle_core::{DType, Device, Tensor, Var};
use oxrl_algo::value_loss::clipped_value_loss;
use oxrl_algo::{token_weights, BatchTotals, LossAgg};
use oxrl_models::Qwen3ValueModel;
use std::collections::BTreeMap;
use std::path::Path;

/// The checkpoint subdirectory that holds the critic (a `Qwen3ForTokenClassification`
/// directory plus its optimizer state).
pub const CRITIC_DIR: &str = "critic";

#[derive(Debug, Clone, PartialEq)]
pub struct CriticConfig {
    /// Where the critic starts: a value-model checkpoint, or any Qwen3 checkpoint (then with a
    /// fresh head); the policy's by default. A directory or a hub id.
    pub path: String,
    pub optimizer: AdamWConfig,
    /// `c` of the clipped value loss; `None`: the plain squared error.
    pub value_clip: Option<f64>,
    pub ppo_epochs: usize,
    /// Trajectories per optimizer step; `None` = the whole batch.
    pub mini_batch_size: Option<usize>,
    /// Trajectories per forward/backward.
    pub micro_batch_size: usize,
    pub max_grad_norm: f64,
    pub loss_agg: LossAgg,
    /// Training steps at the start of a run in which only the critic learns, so the policy's
    /// first advantages do not come from an untrained value head.
    pub warmup_steps: u64,
}

pub struct Critic {
    pub model: Qwen3ValueModel,
    vars: Vec<(String, Var)>,
    optimizer: Box<dyn Optimizer>,
    pub config: CriticConfig,
    /// The data-parallel group the critic shares steps with (the policy trainer's).
    pub parallel: DataParallel,
}

/// What one critic update measured, summed over its optimizer steps (and ranks).
#[derive(Default)]
struct Sums {
    loss: f64,
    vpred: f64,
    tokens: f64,
    clipped: f64,
    grad_norm: f64,
    steps: usize,
}

impl Critic {
    /// The critic of a run: from `dir` (a resumed checkpoint's `critic/`, or the config's
    /// path), trainable, with AdamW starting from its f32 weights.
    pub fn load(
        config: CriticConfig,
        dir: &Path,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> Result<Self> {
        let model = Qwen3ValueModel::load(dir, dtype, device, seed)?;
        Self::new(model, config)
    }

    pub fn new(mut model: Qwen3ValueModel, config: CriticConfig) -> Result<Self> {
        let vars = model.make_trainable()?;
        let initial = host_values(&vars)?;
        let var_list: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
        let device = model.model.device.clone();
        let optimizer = adamw_on(&device, AdamW::new(config.optimizer, initial), &var_list)?;
        Ok(Self {
            model,
            vars,
            optimizer,
            config,
            parallel: DataParallel::default(),
        })
    }

    /// Trajectories per optimizer step in an update of `n`.
    fn mini_batch_len(&self, n: usize) -> usize {
        self.config.mini_batch_size.unwrap_or(n).clamp(1, n.max(1))
    }

    /// `V_old`: the critic's value of every response token of `trajs`, before its update. Each
    /// rank values its update share and the ranks exchange the rows.
    pub fn values(&self, trajs: &[Trajectory]) -> Result<Vec<Vec<f64>>> {
        let n = trajs.len();
        let mini = self.mini_batch_len(n);
        let mine = self.parallel.update_shard(n, mini);
        let mut rows = Vec::with_capacity(mine.len());
        for micro in mine.chunks(self.config.micro_batch_size.max(1)) {
            let batch: Vec<&Trajectory> = micro.iter().map(|&i| &trajs[i]).collect();
            let flat = self
                .model
                .values(&requests(&batch, 1.0))?
                .detach()
                .to_vec1::<f32>()?;
            let mut at = 0;
            for t in &batch {
                let len = t.response_ids.len();
                rows.push(flat[at..at + len].to_vec());
                at += len;
            }
        }
        let all = self.parallel.gather_rows(rows, n, mini)?;
        Ok(all
            .into_iter()
            .map(|r| r.into_iter().map(f64::from).collect())
            .collect())
    }

    /// Fits the returns: for each critic epoch and mini-batch, one optimizer step of the
    /// clipped value loss against `values` (`V_old`). Returns the `critic/*` metrics.
    pub fn update(
        &mut self,
        trajs: &[Trajectory],
        values: &[Vec<f64>],
        returns: &[Vec<f64>],
    ) -> Result<BTreeMap<String, f64>> {
        let mini = self.mini_batch_len(trajs.len());
        let mut sums = Sums::default();
        let mut lr = self.config.optimizer.lr;
        for _ in 0..self.config.ppo_epochs.max(1) {
            let order: Vec<usize> = (0..trajs.len()).collect();
            for batch in order.chunks(mini) {
                let totals = BatchTotals {
                    tokens: batch.iter().map(|&i| trajs[i].response_ids.len()).sum(),
                    sequences: batch.len(),
                    loss_scale_factor: 1.0,
                };
                let share = &batch[self.parallel.share(batch.len())];
                let mut acc: Vec<Option<Tensor>> = vec![None; self.vars.len()];
                let mut step = [0.0; 4];
                for micro in share.chunks(self.config.micro_batch_size.max(1)) {
                    let m = self.micro_batch(trajs, micro, values, returns, &totals, &mut acc)?;
                    for (s, x) in step.iter_mut().zip(m) {
                        *s += x;
                    }
                }
                self.parallel.sum(&mut step)?;
                let grad_norm = self.apply(acc)?;
                lr = self.config.optimizer.lr;
                sums.loss += step[0];
                sums.vpred += step[1];
                sums.tokens += step[2];
                sums.clipped += step[3];
                sums.grad_norm += grad_norm;
                sums.steps += 1;
            }
        }
        let steps = sums.steps.max(1) as f64;
        let tokens = sums.tokens.max(1.0);
        Ok(BTreeMap::from([
            ("critic/vf_loss".to_string(), sums.loss / steps),
            ("critic/vpred_mean".to_string(), sums.vpred / tokens),
            ("critic/vf_clipfrac".to_string(), sums.clipped / tokens),
            ("critic/grad_norm".to_string(), sums.grad_norm / steps),
            ("critic/lr".to_string(), lr),
        ]))
    }

    /// One micro-batch's forward, loss and backward (gradients added to `acc`); returns its
    /// aggregated loss, Σ V, its token count and its clipped tokens.
    fn micro_batch(
        &self,
        trajs: &[Trajectory],
        micro: &[usize],
        values: &[Vec<f64>],
        returns: &[Vec<f64>],
        totals: &BatchTotals,
        acc: &mut [Option<Tensor>],
    ) -> Result<[f64; 4]> {
        let batch: Vec<&Trajectory> = micro.iter().map(|&i| &trajs[i]).collect();
        let lens: Vec<usize> = batch.iter().map(|t| t.response_ids.len()).collect();
        let vpred = self.model.values(&requests(&batch, 1.0))?;
        let dev = vpred.device().clone();
        let flat = |rows: &[Vec<f64>]| -> candle_core::Result<Tensor> {
            let v: Vec<f32> = micro
                .iter()
                .flat_map(|&i| rows[i].iter().map(|&x| x as f32))
                .collect();
            let n = v.len();
            Tensor::from_vec(v, n, &dev)
        };
        let out = clipped_value_loss(
            &vpred,
            &flat(values)?,
            &flat(returns)?,
            self.config.value_clip,
        )?;
        let n = out.per_token.dims1()?;
        let w = Tensor::from_vec(token_weights(self.config.loss_agg, &lens, totals), n, &dev)?;
        let loss = (&out.per_token * &w)?.sum_all()?;
        accumulate(&self.vars, acc, &loss.backward()?)?;
        let vsum = vpred.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        Ok([
            loss.to_scalar::<f32>()? as f64,
            vsum,
            n as f64,
            out.clipped as f64,
        ])
    }

    /// Sums the gradients over the group, clips them and takes one AdamW step; returns the
    /// norm before clipping.
    fn apply(&mut self, acc: Vec<Option<Tensor>>) -> Result<f64> {
        let mut grads = dense_gradients(&self.vars, acc)?;
        self.parallel.sum_gradients(&mut grads)?;
        let squared = squared_norms(&grads)?;
        let norm = clip_grad_norm(&mut grads, &squared, self.config.max_grad_norm)?;
        if !norm.is_finite() {
            return Err(TrainError::Invalid(format!(
                "critic gradient norm is {norm}: the update was skipped to keep the weights intact"
            )));
        }
        let vars: Vec<Var> = self.vars.iter().map(|(_, v)| v.clone()).collect();
        self.optimizer
            .update(&vars, &grads, self.config.optimizer.lr)?;
        Ok(norm)
    }

    /// Writes the critic into `checkpoint/critic/`: the value model, then its optimizer state.
    pub fn save_into(&self, checkpoint: &Path) -> Result<()> {
        let dir = checkpoint.join(CRITIC_DIR);
        self.model.save(&dir)?;
        write_optimizer_state(&self.vars, &self.optimizer.state()?, &dir)
    }

    /// Optimizer steps taken (saved in the trainer state beside the policy's).
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer.steps()
    }

    /// Restores the critic's optimizer from `checkpoint/critic/` (the model was loaded from
    /// there), at optimizer step `step`.
    pub fn restore_optimizer(&mut self, checkpoint: &Path, step: u64) -> Result<()> {
        let dir = checkpoint.join(CRITIC_DIR);
        let params = read_optimizer_state(&self.vars, &dir)?;
        let state = AdamW {
            config: self.config.optimizer,
            step,
            params,
        };
        let vars: Vec<Var> = self.vars.iter().map(|(_, v)| v.clone()).collect();
        self.optimizer = adamw_on(&self.model.model.device, state, &vars)?;
        Ok(())
    }
}
