//! Checkpoint weights by name: taking them out of a loaded checkpoint with their shapes checked,
//! and the [`Module`] pattern that lets a model's structs write each weight name once.

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use std::collections::HashMap;

/// How random initialisation fills a weight (transformers' `_init_weights` defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// N(0, `initializer_range`²).
    Normal,
    Ones,
    Zeros,
}

/// One weight of a module: its checkpoint name relative to the module, shape and initialisation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Slot {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl Slot {
    pub fn new(name: &'static str, shape: &[usize], init: Init) -> Self {
        Self {
            name,
            shape: shape.to_vec(),
            init,
        }
    }
}

/// Removes `name` from `map`; an error when it is missing or has another shape.
pub(crate) fn take(
    map: &mut HashMap<String, Tensor>,
    name: &str,
    shape: &[usize],
) -> Result<Tensor> {
    let t = map
        .remove(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    if t.dims() != shape {
        return Err(ModelError::TensorShape {
            name: name.to_string(),
            got: t.dims().to_vec(),
            expected: shape.to_vec(),
        });
    }
    Ok(t)
}

/// A model part whose weights are a fixed list of checkpoint tensors. [`Module::slots`] is the
/// one place their names are written: loading, naming for save and the optimizer, detaching
/// and random initialisation all go through it.
pub(crate) trait Module<const N: usize>: Sized {
    /// The part's settings that fix its weights' shapes.
    type Config;

    /// The weights in transformers' `named_parameters()` order.
    fn slots(config: &Self::Config) -> [Slot; N];

    /// The part from its weights, in [`Module::slots`] order.
    fn from_weights(weights: [Tensor; N]) -> Self;

    /// Its weights, in [`Module::slots`] order.
    fn weights(&self) -> [&Tensor; N];

    /// Takes the part's weights, named `{prefix}{slot}`, out of a checkpoint's tensors.
    fn load(config: &Self::Config, prefix: &str, t: &mut HashMap<String, Tensor>) -> Result<Self> {
        let mut taken = Vec::with_capacity(N);
        for slot in Self::slots(config) {
            taken.push(take(t, &format!("{prefix}{}", slot.name), &slot.shape)?);
        }
        Ok(Self::from_weights(std::array::from_fn(|i| {
            taken[i].clone()
        })))
    }

    /// Appends every weight under its checkpoint name `{prefix}{slot}` (cheap handle clones).
    fn push_named(&self, config: &Self::Config, prefix: &str, out: &mut Vec<(String, Tensor)>) {
        for (slot, t) in Self::slots(config).iter().zip(self.weights()) {
            out.push((format!("{prefix}{}", slot.name), t.clone()));
        }
    }

    /// The same part over other handles of its weights (`f` maps each weight).
    fn map(&self, f: &impl Fn(&Tensor) -> Tensor) -> Self {
        Self::from_weights(self.weights().map(f))
    }
}
