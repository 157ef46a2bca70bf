//! Activation checkpointing per decoder layer: the forward keeps only each layer's input; the
//! backward recomputes one layer at a time, with its graph, and backpropagates the gradient of
//! its output into its weights and its input. Peak activation memory is one layer's graph plus
//! the layer boundaries, instead of every layer's graph.
//!
//! The top of the graph (final norm, lm_head, log-probs, loss) grows from a leaf standing for
//! the last layer's output, so `loss.backward()` stops there; [`LayerCheckpoints::backward`]
//! takes it from there. Qwen3-VL's image embeddings and DeepStack features enter the layers as
//! leaves too; their gradients are gathered over every layer and sent through the vision tower
//! at the end, whose blocks are checkpointed the same way ([`crate::tower_checkpoints`]).
//!
//! This loop is also where ZeRO-2 reduce-scatters each layer's gradients as soon as they are
//! complete ([`LayerCheckpoints::backward_with`]).

use super::lora_dropout::DropoutPass;
use super::model::{Frame, Qwen3Model};
use super::visual::VisualInjection;
use crate::config::Qwen3Config;
use crate::tower_checkpoints::TowerCheckpoints;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use std::collections::HashSet;
use std::sync::Arc;

/// One batch's checkpointed forward, ready for its backward.
pub struct LayerCheckpoints {
    config: Qwen3Config,
    /// Handles on the model's weights (shared storage, the same tensor ids).
    body: Qwen3Model,
    input_ids: Tensor,
    frame: Frame,
    /// Input of layer `l`, without graph.
    inputs: Vec<Tensor>,
    /// The last layer's output, the leaf the top of the graph grows from.
    top: Var,
    visual: Option<CheckpointedVisual>,
    /// Every weight's id: only their gradients are kept from the recomputations.
    weights: HashSet<TensorId>,
    /// The forward's LoRA dropout pass, applied again while the layers are recomputed.
    pub(crate) dropout: Option<DropoutPass>,
}

/// The images of a checkpointed batch: the layers see leaf copies of the tower's outputs; the
/// outputs with their graph wait for the leaves' gradients.
struct CheckpointedVisual {
    leaves: VisualInjection,
    embeds: Tensor,
    deepstack: Vec<Tensor>,
    /// The checkpointed tower the outputs grow from (their graph stops at its output leaves).
    tower: Option<Arc<TowerCheckpoints>>,
}

impl CheckpointedVisual {
    fn new(visual: &VisualInjection) -> candle_core::Result<Self> {
        let leaf = |t: &Tensor| Var::from_tensor(&t.detach()).map(Var::into_inner);
        Ok(Self {
            leaves: VisualInjection {
                index: visual.index.clone(),
                keep: visual.keep.clone(),
                embeds: leaf(&visual.embeds)?,
                deepstack: visual
                    .deepstack
                    .iter()
                    .map(leaf)
                    .collect::<Result<_, _>>()?,
                tower: None,
            },
            embeds: visual.embeds.clone(),
            deepstack: visual.deepstack.clone(),
            tower: visual.tower.clone(),
        })
    }

    /// The leaves and the tower outputs they stand for.
    fn pairs(&self) -> impl Iterator<Item = (&Tensor, &Tensor)> {
        std::iter::once((&self.leaves.embeds, &self.embeds))
            .chain(self.leaves.deepstack.iter().zip(&self.deepstack))
    }
}

impl Qwen3Model {
    /// [`Qwen3Model::forward`] keeping only the layer boundaries: returns the final-norm hidden
    /// states (whose graph stops at the last layer's output) and what the backward needs.
    pub(crate) fn forward_checkpointed(
        &self,
        c: &Qwen3Config,
        input_ids: &Tensor,
        positions: Option<&[[u32; 3]]>,
        visual: Option<&VisualInjection>,
        weights: HashSet<TensorId>,
    ) -> candle_core::Result<(Tensor, LayerCheckpoints)> {
        let frame = self.frame(c, input_ids, positions)?;
        let visual = visual.map(CheckpointedVisual::new).transpose()?;
        let leaves = visual.as_ref().map(|v| &v.leaves);
        let mut x = self.embed(c, input_ids, leaves)?.detach();
        let mut inputs = Vec::with_capacity(self.layers.len());
        for l in 0..self.layers.len() {
            let next = self.layer(c, l, &x, &frame, leaves)?.detach();
            inputs.push(std::mem::replace(&mut x, next));
        }
        let top = Var::from_tensor(&x)?;
        let hidden = self.norm.forward(top.as_tensor(), c.rms_norm_eps)?;
        let checkpoints = LayerCheckpoints {
            config: c.clone(),
            body: self.map(&|t| t.clone()),
            input_ids: input_ids.clone(),
            frame,
            inputs,
            top,
            visual,
            weights,
            dropout: None,
        };
        Ok((hidden, checkpoints))
    }
}

impl LayerCheckpoints {
    /// How many vision-tower blocks the backward recomputes (0 for a batch without images).
    pub fn tower_blocks(&self) -> usize {
        let tower = self.visual.as_ref().and_then(|v| v.tower.as_ref());
        tower.map_or(0, |t| t.blocks())
    }

    /// Continues a backward that `loss.backward()` began at the top of the graph: recomputes
    /// the layers from the last to the first, then the embeddings and the vision tower, adding
    /// every weight's gradient to `grads`.
    pub fn backward(&self, grads: &mut GradStore) -> candle_core::Result<()> {
        self.backward_with(grads, |_, _| Ok(()))
    }

    /// [`LayerCheckpoints::backward`], calling `layer_done(l, grads)` as soon as layer `l`'s
    /// weight gradients are complete (the hook for a per-layer gradient reduce-scatter).
    pub fn backward_with(
        &self,
        grads: &mut GradStore,
        mut layer_done: impl FnMut(usize, &mut GradStore) -> candle_core::Result<()>,
    ) -> candle_core::Result<()> {
        let Some(mut upstream) = grads.remove(self.top.as_tensor()) else {
            return Ok(());
        };
        let c = &self.config;
        let leaves = self.visual.as_ref().map(|v| &v.leaves);
        let leaf_ids: HashSet<TensorId> = self
            .visual
            .iter()
            .flat_map(|v| v.pairs().map(|(leaf, _)| leaf.id()))
            .collect();
        let keep = |id: &TensorId| self.weights.contains(id) || leaf_ids.contains(id);
        let _masks_on = self.dropout.as_ref().map(DropoutPass::apply);
        for l in (0..self.inputs.len()).rev() {
            let input = Var::from_tensor(&self.inputs[l])?;
            let out = self
                .body
                .layer(c, l, input.as_tensor(), &self.frame, leaves)?;
            let step = (out * &upstream)?.sum_all()?.backward()?;
            upstream = match step.get(input.as_tensor()) {
                Some(g) => g.clone(),
                None => self.inputs[l].zeros_like()?,
            };
            merge_into(grads, step, keep)?;
            layer_done(l, grads)?;
        }
        let embedded = self.body.embed(c, &self.input_ids, leaves)?;
        merge_into(grads, (embedded * &upstream)?.sum_all()?.backward()?, keep)?;
        if let Some(v) = &self.visual {
            let mut through_tower: Option<Tensor> = None;
            for (leaf, output) in v.pairs() {
                if let Some(g) = grads.remove(leaf) {
                    let term = (output * g.to_dtype(output.dtype())?)?.sum_all()?;
                    through_tower = Some(match through_tower {
                        Some(sum) => (sum + term)?,
                        None => term,
                    });
                }
            }
            if let Some(s) = through_tower {
                let outputs: HashSet<TensorId> =
                    v.tower.iter().flat_map(|t| t.output_ids()).collect();
                merge_into(grads, s.backward()?, |id| {
                    self.weights.contains(id) || outputs.contains(id)
                })?;
            }
            if let Some(tower) = &v.tower {
                tower.backward(grads, |id| self.weights.contains(id))?;
            }
        }
        Ok(())
    }
}

/// Adds the gradients `from` holds for the tensors `keep` picks to `into`.
pub(crate) fn merge_into(
    into: &mut GradStore,
    from: GradStore,
    keep: impl Fn(&TensorId) -> bool,
) -> candle_core::Result<()> {
    let ids: Vec<TensorId> = from.get_ids().filter(|id| keep(id)).copied().collect();
    for id in ids {
        let Some(g) = from.get_id(id) else { continue };
        let sum = match into.get_id(id) {
            Some(prev) => (prev + g)?,
            None => g.clone(),
        };
        into.insert_id(id, sum);
    }
    Ok(())
}
