//! LoRA (Hu et al., 2021) on the decoder's linear projections, read and written in PEFT's
//! adapter format so adapters move between oxrl and the Python stacks unchanged.
//!
//! A target projection `y = x·Wᵀ` becomes
//!
//! ```text
//! y = x·Wᵀ + s · (x·Aᵀ)·Bᵀ,   A: [r, in],  B: [out, r],  s = α / r   (α / √r with rsLoRA)
//! ```
//!
//! — PEFT's `lora_A.weight`, `lora_B.weight` and `scaling`. Only `A` and `B` train: `W` is not
//! a `Var`, so its product runs through the frozen-weight op ([`crate::ops::linear`]) and no
//! gradient is computed for it. Switching the adapters off gives the base model back without a
//! second copy of its weights (the reference policy of a LoRA run).
//!
//! The targets are the language model's seven projections. PEFT's `"all-linear"` on a Qwen3-VL
//! checkpoint also adapts the vision tower's linears; oxrl's covers the language model only and
//! writes its explicit module list into `adapter_config.json`, so PEFT loads exactly what oxrl
//! trained. An adapter with vision-tower modules is refused by name when loaded.

use super::config::text_prefix;
use super::lora_dropout::{dropout, AdapterSwitch, DropoutPass};
use super::Qwen3;
use crate::checkpoint::{save_safetensors_synced, write_dir_atomically, write_synced};
use crate::error::{ModelError, Result};
use crate::ops::linear;
use candle_core::{DType, Tensor, Var};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The projections LoRA can adapt: attention's four, then the MLP's three (PEFT's
/// `"all-linear"` on Qwen3's language model).
pub const LORA_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Attention's projections in [`super::Attention`]'s adapter order.
pub(crate) const ATTENTION_TARGETS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];
/// The MLP's projections in [`super::Mlp`]'s adapter order.
pub(crate) const MLP_TARGETS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// PEFT's file names in an adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Every PEFT adapter key starts with the wrapper's prefix before the model's module path.
const PEFT_PREFIX: &str = "base_model.model.";

/// How `A` starts (`B` always starts at zero, so a new adapter changes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraInit {
    /// PEFT's default (`init_lora_weights = true`): Kaiming-uniform with `a = √5`, i.e.
    /// `U(−1/√in, 1/√in)`.
    #[default]
    Kaiming,
    /// PEFT's `"gaussian"`: `N(0, 1/r)`.
    Gaussian,
}

/// The adapter's shape and scale (`[model.lora]`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    /// Dropout on the adapter's input while training (PEFT's `lora_dropout`).
    pub dropout: f64,
    /// Projection names, each one of [`LORA_TARGETS`].
    pub targets: Vec<String>,
    pub init: LoraInit,
    /// Rank-stabilised scaling `α/√r` (PEFT's `use_rslora`).
    pub rslora: bool,
}

impl LoraConfig {
    /// Rank `rank` on all seven projections (`"all-linear"`), PEFT's Kaiming init, no dropout.
    pub fn all_linear(rank: usize, alpha: f64) -> Self {
        Self {
            rank,
            alpha,
            dropout: 0.0,
            targets: LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
            init: LoraInit::Kaiming,
            rslora: false,
        }
    }

    /// `s`: `α/r`, or `α/√r` with rsLoRA.
    pub fn scale(&self) -> f64 {
        let r = self.rank as f64;
        match self.rslora {
            true => self.alpha / r.sqrt(),
            false => self.alpha / r,
        }
    }

    /// A configuration's own errors, before any weight is touched.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.rank == 0 {
            return Err("rank must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!(
                "alpha must be a positive number, not {}",
                self.alpha
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout must be in [0, 1), not {}", self.dropout));
        }
        if self.targets.is_empty() {
            return Err("target_modules names no projection".into());
        }
        match self
            .targets
            .iter()
            .find(|t| !LORA_TARGETS.contains(&t.as_str()))
        {
            Some(t) => Err(format!(
                "target module `{t}` is not one of {} (or \"all-linear\")",
                LORA_TARGETS.join(", ")
            )),
            None => Ok(()),
        }
    }

    fn targets(&self, name: &str) -> bool {
        self.targets.iter().any(|t| t == name)
    }
}

/// One projection's adapter.
#[derive(Clone)]
pub struct Adapter {
    /// `lora_A.weight`, `[r, in]`.
    pub a: Tensor,
    /// `lora_B.weight`, `[out, r]`.
    pub b: Tensor,
    pub scale: f64,
    /// PEFT's `lora_dropout` on the adapter's input, inside a training pass only.
    dropout: f64,
    /// The adapter's place among the model's projections: its dropout mask stream.
    index: u64,
    /// Shared by all of a model handle's adapters: off, the model is its base.
    switch: Arc<AdapterSwitch>,
}

impl Adapter {
    /// `s · (x·Aᵀ)·Bᵀ`, scaled at rank width (`(s · x·Aᵀ)·Bᵀ`): scaling the output instead, as
    /// PEFT writes it, would keep one more output-sized tensor per projection for the backward.
    fn delta(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        linear(&(linear(x, &self.a)? * self.scale)?, &self.b)
    }

    /// `W + s·B·A`, computed in f32 and stored in `W`'s dtype.
    fn merged_into(&self, w: &Tensor) -> candle_core::Result<Tensor> {
        let delta = (self
            .b
            .to_dtype(DType::F32)?
            .matmul(&self.a.to_dtype(DType::F32)?)?
            * self.scale)?;
        (w.to_dtype(DType::F32)? + delta)?.to_dtype(w.dtype())
    }

    fn map(&self, f: &impl Fn(&Tensor) -> Tensor) -> Self {
        Self {
            a: f(&self.a),
            b: f(&self.b),
            scale: self.scale,
            dropout: self.dropout,
            index: self.index,
            switch: self.switch.clone(),
        }
    }
}

/// `x·Wᵀ`, plus the adapter's `s·(x·Aᵀ)·Bᵀ` when there is one and adapters are on (its input
/// through dropout inside a training pass).
pub(crate) fn project(
    x: &Tensor,
    w: &Tensor,
    adapter: Option<&Adapter>,
) -> candle_core::Result<Tensor> {
    let y = linear(x, w)?;
    let Some(a) = adapter.filter(|a| a.switch.enabled()) else {
        return Ok(y);
    };
    match a.switch.dropout_pass().filter(|_| a.dropout > 0.0) {
        Some(pass) => y + a.delta(&dropout(x, a.dropout, pass, a.index)?)?,
        None => y + a.delta(x)?,
    }
}

/// A part's adapters carried to other handles of its tensors (`f` maps each).
pub(crate) fn map_adapters<const N: usize>(
    adapters: &[Option<Adapter>; N],
    f: &impl Fn(&Tensor) -> Tensor,
) -> [Option<Adapter>; N] {
    std::array::from_fn(|i| adapters[i].as_ref().map(|a| a.map(f)))
}

/// What a model with adapters keeps beside them.
#[derive(Clone)]
pub struct LoraState {
    pub config: LoraConfig,
    switch: Arc<AdapterSwitch>,
    /// Seeds the dropout masks (the adapters' init seed; 0 for a loaded adapter).
    dropout_seed: u64,
    /// Training passes begun so far (each draws new masks).
    passes: Arc<AtomicU64>,
}

impl LoraState {
    fn new(config: LoraConfig, switch: Arc<AdapterSwitch>, dropout_seed: u64) -> Self {
        Self {
            config,
            switch,
            dropout_seed,
            passes: Arc::new(AtomicU64::new(0)),
        }
    }
}

/// One adapted (or adaptable) projection of the decoder, for walking them in order.
struct Projection<'a> {
    /// The module path PEFT keys it by (`base_model.model.model.layers.0.self_attn.q_proj`).
    path: String,
    kind: &'static str,
    weight: &'a mut Tensor,
    adapter: &'a mut Option<Adapter>,
}

impl Qwen3 {
    /// The decoder's projections, layer by layer, attention's before the MLP's.
    fn projections(&mut self) -> Vec<Projection<'_>> {
        let prefix = format!("{PEFT_PREFIX}{}", text_prefix(self.vision.is_some()));
        let mut out = Vec::new();
        for (l, layer) in self.model.layers.iter_mut().enumerate() {
            let attn = &mut layer.self_attn;
            let weights = [
                &mut attn.q_proj,
                &mut attn.k_proj,
                &mut attn.v_proj,
                &mut attn.o_proj,
            ];
            for ((kind, weight), adapter) in ATTENTION_TARGETS
                .iter()
                .zip(weights)
                .zip(attn.lora.iter_mut())
            {
                let path = format!("{prefix}layers.{l}.self_attn.{kind}");
                out.push(Projection {
                    path,
                    kind,
                    weight,
                    adapter,
                });
            }
            let mlp = &mut layer.mlp;
            let weights = [&mut mlp.gate_proj, &mut mlp.up_proj, &mut mlp.down_proj];
            for ((kind, weight), adapter) in
                MLP_TARGETS.iter().zip(weights).zip(mlp.lora.iter_mut())
            {
                let path = format!("{prefix}layers.{l}.mlp.{kind}");
                out.push(Projection {
                    path,
                    kind,
                    weight,
                    adapter,
                });
            }
        }
        out
    }

    /// The adapters' configuration, when the model has adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|l| &l.config)
    }

    /// Switches every adapter on or off (off: the base model's outputs, from the same weights).
    pub fn set_adapters_enabled(&self, on: bool) {
        if let Some(l) = &self.lora {
            l.switch.set_enabled(on);
        }
    }

    /// A new training pass with fresh dropout masks, when the adapters have dropout: the
    /// training forward runs under [`DropoutPass::apply`] (and so does a checkpointed
    /// backward's recomputation, replaying its masks).
    pub fn begin_dropout_pass(&self) -> Option<DropoutPass> {
        let l = self.lora.as_ref().filter(|l| l.config.dropout > 0.0)?;
        let pass = l.passes.fetch_add(1, Ordering::Relaxed) + 1;
        Some(DropoutPass::new(l.switch.clone(), l.dropout_seed, pass))
    }

    /// Adds fresh adapters to the targeted projections: `A` drawn as `config.init` says from
    /// `seed`, `B` zero, so the model's outputs are unchanged until `B` trains.
    pub fn attach_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()> {
        use rand::{Rng, SeedableRng};
        config
            .validate()
            .map_err(|e| ModelError::InvalidInput(format!("[model.lora]: {e}")))?;
        if self.lora.is_some() {
            return Err(ModelError::InvalidInput(
                "the model already has LoRA adapters".into(),
            ));
        }
        let switch = AdapterSwitch::new(true);
        let (dtype, device, scale, rank) =
            (self.dtype, self.device.clone(), config.scale(), config.rank);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for (index, p) in self.projections().into_iter().enumerate() {
            if !config.targets(p.kind) {
                continue;
            }
            let (out, inputs) = p.weight.dims2()?;
            let n = rank * inputs;
            let a: Vec<f32> = match config.init {
                LoraInit::Kaiming => {
                    let bound = 1.0 / (inputs as f32).sqrt();
                    (0..n).map(|_| rng.random_range(-bound..bound)).collect()
                }
                LoraInit::Gaussian => {
                    let std = 1.0 / rank as f32;
                    (0..n)
                        .map(|_| {
                            // Box–Muller, as the model's own random init draws.
                            let u1: f32 = rng.random_range(f32::EPSILON..1.0);
                            let u2: f32 = rng.random::<f32>();
                            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
                        })
                        .collect()
                }
            };
            *p.adapter = Some(Adapter {
                a: Tensor::from_vec(a, (rank, inputs), &device)?.to_dtype(dtype)?,
                b: Tensor::zeros((out, rank), dtype, &device)?,
                scale,
                dropout: config.dropout,
                index: index as u64,
                switch: switch.clone(),
            });
        }
        self.lora = Some(LoraState::new(config.clone(), switch, seed));
        Ok(())
    }

    /// Every adapter with the checkpoint name of the weight it adapts
    /// (`model.layers.0.self_attn.q_proj.weight`), in layer order.
    fn adapters(&self) -> Vec<(String, &Adapter)> {
        let prefix = text_prefix(self.vision.is_some());
        let mut out = Vec::new();
        for (l, layer) in self.model.layers.iter().enumerate() {
            let parts = ATTENTION_TARGETS
                .iter()
                .zip(&layer.self_attn.lora)
                .map(|(k, a)| ("self_attn", k, a))
                .chain(
                    MLP_TARGETS
                        .iter()
                        .zip(&layer.mlp.lora)
                        .map(|(k, a)| ("mlp", k, a)),
                );
            for (part, kind, adapter) in parts {
                if let Some(a) = adapter {
                    out.push((format!("{prefix}layers.{l}.{part}.{kind}.weight"), a));
                }
            }
        }
        out
    }

    /// Every adapter tensor under its PEFT name (`….q_proj.lora_A.weight`), in layer order.
    pub fn adapter_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (weight, a) in self.adapters() {
            let path = format!("{PEFT_PREFIX}{}", weight.trim_end_matches(".weight"));
            out.push((format!("{path}.lora_A.weight"), a.a.clone()));
            out.push((format!("{path}.lora_B.weight"), a.b.clone()));
        }
        out
    }

    /// [`Qwen3::named_parameters`] with each enabled adapter folded into its weight
    /// (`W + s·B·A`, computed in f32): the plain checkpoint this model computes, for saving and
    /// for rollout servers. Each merged tensor is new memory; the rest are handles.
    pub fn merged_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let adapters: HashMap<String, &Adapter> = self
            .adapters()
            .into_iter()
            .filter(|(_, a)| a.switch.enabled())
            .collect();
        self.named_parameters()
            .into_iter()
            .map(|(name, w)| match adapters.get(&name) {
                Some(a) => Ok((name, a.merged_into(&w)?)),
                None => Ok((name, w)),
            })
            .collect()
    }

    /// Turns the adapters into `Var`s (the only trainable tensors of a LoRA model) and returns
    /// them by PEFT name.
    pub(crate) fn make_adapters_trainable(&mut self) -> Result<Vec<(String, Var)>> {
        let mut vars = Vec::new();
        for p in self.projections() {
            if let Some(adapter) = p.adapter {
                let a = Var::from_tensor(&adapter.a)?;
                let b = Var::from_tensor(&adapter.b)?;
                adapter.a = a.as_tensor().clone();
                adapter.b = b.as_tensor().clone();
                vars.push((format!("{}.lora_A.weight", p.path), a));
                vars.push((format!("{}.lora_B.weight", p.path), b));
            }
        }
        Ok(vars)
    }

    /// Gives this handle's adapters a switch of their own (set as now), so switching them off
    /// here leaves another handle on the same tensors (the trainer's, the engine's) as it is.
    pub(crate) fn own_adapter_switch(&mut self) {
        let Some(lora) = &mut self.lora else { return };
        let switch = AdapterSwitch::new(lora.switch.enabled());
        lora.switch = switch.clone();
        for p in self.projections() {
            if let Some(a) = p.adapter {
                a.switch = switch.clone();
            }
        }
    }

    /// Writes the adapters as PEFT does (`adapter_config.json` and `adapter_model.safetensors`),
    /// atomically; `base_model` is recorded as `base_model_name_or_path`.
    pub fn save_adapter(&self, out: &Path, base_model: &str) -> Result<()> {
        write_dir_atomically(out, &|dir| self.write_adapter(dir, base_model))
    }

    /// [`Qwen3::save_adapter`]'s files, written into the existing directory `dir`.
    pub fn write_adapter(&self, dir: &Path, base_model: &str) -> Result<()> {
        let lora = self.lora.as_ref().ok_or_else(|| {
            ModelError::InvalidInput("the model has no LoRA adapters to save".into())
        })?;
        let c = &lora.config;
        let config = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": c.rank,
            "lora_alpha": c.alpha,
            "lora_dropout": c.dropout,
            "target_modules": c.targets,
            "use_rslora": c.rslora,
            "init_lora_weights": match c.init {
                LoraInit::Kaiming => json!(true),
                LoraInit::Gaussian => json!("gaussian"),
            },
            "bias": "none",
            "fan_in_fan_out": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "inference_mode": true,
        });
        let tensors: HashMap<String, Tensor> = self.adapter_parameters().into_iter().collect();
        save_safetensors_synced(&tensors, &dir.join(ADAPTER_WEIGHTS))?;
        let text = serde_json::to_string_pretty(&config).unwrap_or_default();
        write_synced(&dir.join(ADAPTER_CONFIG), text.as_bytes())
    }

    /// Loads a PEFT LoRA adapter directory onto this (base) model. Errors name the file and
    /// the key: an adapter kind, option or module oxrl does not apply is refused, never
    /// half-applied.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        let config_path = dir.join(ADAPTER_CONFIG);
        let value = crate::config::read_json(&config_path)?;
        let config = peft_config(&value, &config_path)?;
        let weights_path = dir.join(ADAPTER_WEIGHTS);
        let mut tensors =
            candle_core::safetensors::load(&weights_path, &self.device).map_err(|source| {
                ModelError::Safetensors {
                    path: weights_path.clone(),
                    source,
                }
            })?;
        if self.lora.is_some() {
            return Err(ModelError::InvalidInput(
                "the model already has LoRA adapters".into(),
            ));
        }
        let (dtype, rank, scale) = (self.dtype, config.rank, config.scale());
        let switch = AdapterSwitch::new(true);
        let mut adapters = Vec::new();
        for (index, p) in self.projections().into_iter().enumerate() {
            let a_name = format!("{}.lora_A.weight", p.path);
            let b_name = format!("{}.lora_B.weight", p.path);
            let (a, b) = match (tensors.remove(&a_name), tensors.remove(&b_name)) {
                (Some(a), Some(b)) => (a, b),
                (None, None) => continue,
                (Some(_), None) => return Err(missing(&weights_path, &b_name)),
                (None, Some(_)) => return Err(missing(&weights_path, &a_name)),
            };
            let (out, inputs) = p.weight.dims2()?;
            for (name, t, shape) in [(&a_name, &a, [rank, inputs]), (&b_name, &b, [out, rank])] {
                if t.dims() != shape {
                    return Err(ModelError::WeightsMismatch {
                        dir: dir.to_path_buf(),
                        source: Box::new(ModelError::TensorShape {
                            name: name.clone(),
                            got: t.dims().to_vec(),
                            expected: shape.to_vec(),
                        }),
                    });
                }
            }
            adapters.push((p.adapter, index, a.to_dtype(dtype)?, b.to_dtype(dtype)?));
        }
        if let Some(extra) = tensors.keys().min() {
            return Err(ModelError::ConfigKey {
                path: weights_path,
                key: extra.clone(),
                expected: "a lora_A/lora_B weight of one of the language model's projections \
                           (q/k/v/o_proj, gate/up/down_proj); adapters on other modules (the \
                           vision tower, the embedding, lm_head) are not supported"
                    .into(),
            });
        }
        if adapters.is_empty() {
            return Err(ModelError::InvalidInput(format!(
                "{}: no adapter weights for this model's projections",
                weights_path.display()
            )));
        }
        for (slot, index, a, b) in adapters {
            *slot = Some(Adapter {
                a,
                b,
                scale,
                dropout: config.dropout,
                index: index as u64,
                switch: switch.clone(),
            });
        }
        self.lora = Some(LoraState::new(config, switch, 0));
        Ok(())
    }

    /// Folds every adapter into its weight (`W + s·B·A`, in f32, stored in the model's dtype)
    /// and drops the adapters: a plain model that scores as the adapted one did.
    pub fn merge_adapters(&mut self) -> Result<()> {
        for p in self.projections() {
            if let Some(adapter) = p.adapter.take() {
                *p.weight = adapter.merged_into(p.weight)?;
            }
        }
        self.lora = None;
        Ok(())
    }
}

fn missing(path: &Path, name: &str) -> ModelError {
    ModelError::ConfigKey {
        path: path.to_path_buf(),
        key: name.to_string(),
        expected: "present: lora_A and lora_B come in pairs".into(),
    }
}

/// Reads PEFT's `adapter_config.json` into a [`LoraConfig`], refusing what oxrl would not
/// apply as PEFT does (DoRA, biases, per-module ranks, transposed weights, other PEFT types).
fn peft_config(v: &Value, path: &Path) -> Result<LoraConfig> {
    let bad = |key: &str, expected: &str| ModelError::ConfigKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        expected: expected.to_string(),
    };
    let peft_type = v.get("peft_type").and_then(Value::as_str);
    if peft_type != Some("LORA") {
        return Err(bad(
            "peft_type",
            "\"LORA\" (the only PEFT method oxrl applies)",
        ));
    }
    let rank = v
        .get("r")
        .and_then(Value::as_u64)
        .filter(|r| *r > 0)
        .ok_or_else(|| bad("r", "a positive integer"))? as usize;
    let alpha = v
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| bad("lora_alpha", "a number"))?;
    let dropout = v.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let flag = |key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(false);
    for key in ["use_dora", "fan_in_fan_out"] {
        if flag(key) {
            return Err(bad(key, "false (not supported)"));
        }
    }
    if let Some(bias) = v.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(bad("bias", "\"none\" (adapter biases are not supported)"));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if v.get(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(bad(key, "empty (per-module ranks are not supported)"));
        }
    }
    if v.get("modules_to_save").is_some_and(|m| !m.is_null()) {
        return Err(bad(
            "modules_to_save",
            "null (fully trained modules are not supported)",
        ));
    }
    let targets = match v.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => {
            LORA_TARGETS.iter().map(|t| t.to_string()).collect()
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| t.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("target_modules", "a list of module names"))?,
        _ => {
            return Err(bad(
                "target_modules",
                "\"all-linear\" or a list of module names",
            ))
        }
    };
    let init = match v.get("init_lora_weights") {
        Some(Value::String(s)) if s == "gaussian" => LoraInit::Gaussian,
        _ => LoraInit::Kaiming,
    };
    Ok(LoraConfig {
        rank,
        alpha,
        dropout,
        // What a loaded adapter adapts is what its weights name; the listed names are kept
        // for saving it again.
        targets,
        init,
        rslora: flag("use_rslora"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qwen3::lora_dropout::dropout_mask;
    use candle_core::Device;

    /// `x·Wᵀ + s·((x ⊙ m)·Aᵀ)·Bᵀ`, written out element by element.
    fn by_hand(x: &[f32], w: &[f32], a: &[f32], b: &[f32], m: &[f32], s: f32) -> Vec<f32> {
        let (n, d_in, d_out, r) = (2, 3, 4, 2);
        let mut y = vec![0f32; n * d_out];
        for i in 0..n {
            let xd: Vec<f32> = (0..d_in)
                .map(|k| x[i * d_in + k] * m[i * d_in + k])
                .collect();
            let h: Vec<f32> = (0..r)
                .map(|j| s * (0..d_in).map(|k| xd[k] * a[j * d_in + k]).sum::<f32>())
                .collect();
            for o in 0..d_out {
                let base: f32 = (0..d_in).map(|k| x[i * d_in + k] * w[o * d_in + k]).sum();
                let delta: f32 = (0..r).map(|j| h[j] * b[o * r + j]).sum();
                y[i * d_out + o] = base + delta;
            }
        }
        y
    }

    #[test]
    fn an_adapter_sees_its_input_through_dropout_only_inside_a_training_pass() {
        let dev = Device::Cpu;
        let vals = |n: usize, k: f32| -> Vec<f32> {
            (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * k).collect()
        };
        let (x, w, a, b) = (vals(6, 0.5), vals(12, 0.25), vals(6, 0.3), vals(8, 0.2));
        let t = |v: &[f32], shape: (usize, usize)| Tensor::from_slice(v, shape, &dev).unwrap();
        let switch = AdapterSwitch::new(true);
        let adapter = Adapter {
            a: t(&a, (2, 3)),
            b: t(&b, (4, 2)),
            scale: 2.0,
            dropout: 0.5,
            index: 9,
            switch: switch.clone(),
        };
        let project = || {
            project(&t(&x, (2, 3)), &t(&w, (4, 3)), Some(&adapter))
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let close =
            |got: &[f32], want: &[f32]| got.iter().zip(want).all(|(g, w)| (g - w).abs() <= 1e-5);
        let eval = project();
        assert!(close(&eval, &by_hand(&x, &w, &a, &b, &[1.0; 6], 2.0)));
        let pass = DropoutPass::new(switch, 3, 1);
        let trained = {
            let _on = pass.apply();
            project()
        };
        let mask = dropout_mask(0.5, pass.key, 9, 6);
        assert!(mask.contains(&0.0) && mask.contains(&2.0), "{mask:?}");
        assert!(close(&trained, &by_hand(&x, &w, &a, &b, &mask, 2.0)));
        assert_eq!(project(), eval, "the mask outlived its pass");
    }
}
