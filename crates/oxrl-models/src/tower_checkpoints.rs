//! Activation checkpointing for the vision tower, as [`crate::qwen3::checkpointing`] does for
//! the decoder: the forward keeps only each block's input; the backward recomputes one block at
//! a time and backpropagates from its output's gradient. The tower's outputs (merged image
//! embeddings and DeepStack features) are leaves: the decoder's backward leaves their gradients
//! in the store, and [`TowerCheckpoints::backward`] takes them from there.

use crate::error::Result;
use crate::qwen3::checkpointing::merge_into;
use crate::vision::{PatchMerger, Stem, VisionOutput, VisionTower};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

/// One batch of images through the checkpointed tower, ready for its backward.
pub struct TowerCheckpoints {
    /// Handles on the tower's weights (shared storage, the same tensor ids).
    tower: VisionTower,
    pixel_values: Tensor,
    grids: Vec<[usize; 3]>,
    stem: Stem,
    /// `boundaries[l]` is block `l`'s input; the last is the last block's output. No graph.
    boundaries: Vec<Tensor>,
    /// The leaves the decoder sees: the final merger's output, then the DeepStack features.
    outputs: VisionOutput,
}

impl VisionTower {
    /// [`VisionTower::forward`] keeping only the block boundaries; the outputs are leaves whose
    /// gradients [`TowerCheckpoints::backward`] sends through the recomputed blocks.
    pub fn forward_checkpointed(
        &self,
        pixel_values: &Tensor,
        grids: &[[usize; 3]],
    ) -> Result<TowerCheckpoints> {
        let merged = self.config.spatial_merge_size.pow(2);
        let leaf = |t: Tensor| Var::from_tensor(&t.detach()).map(Var::into_inner);
        let stem = self.stem(pixel_values, grids)?;
        let mut boundaries = vec![stem.x.detach()];
        let mut deepstack = Vec::with_capacity(self.deepstack_mergers.len());
        for (l, block) in self.blocks.iter().enumerate() {
            let x = self.block(block, &boundaries[l], &stem)?.detach();
            if let Some(merger) = self.deepstack_merger_after(l) {
                deepstack.push(leaf(merger.forward(&x, merged)?)?);
            }
            boundaries.push(x);
        }
        let last = &boundaries[self.blocks.len()];
        let embeds = leaf(self.merger.forward(last, merged)?)?;
        Ok(TowerCheckpoints {
            tower: self.map_weights(Tensor::clone),
            pixel_values: pixel_values.clone(),
            grids: grids.to_vec(),
            stem: Stem {
                x: stem.x.detach(),
                ..stem
            },
            boundaries,
            outputs: VisionOutput { embeds, deepstack },
        })
    }
}

impl TowerCheckpoints {
    /// The tower's outputs for the decoder: leaves, without graph.
    pub fn outputs(&self) -> &VisionOutput {
        &self.outputs
    }

    /// How many blocks the backward recomputes.
    pub fn blocks(&self) -> usize {
        self.boundaries.len() - 1
    }

    /// The ids of [`TowerCheckpoints::outputs`]: a backward must keep their gradients.
    pub fn output_ids(&self) -> impl Iterator<Item = TensorId> + '_ {
        std::iter::once(self.outputs.embeds.id())
            .chain(self.outputs.deepstack.iter().map(Tensor::id))
    }

    /// Takes the outputs' gradients out of `grads` and adds the gradient of every weight `keep`
    /// picks: boundary by boundary from the last, each recomputed with every consumer of it (the
    /// next block, or the final merger, and the DeepStack merger tapping it) in one backward, as
    /// full backprop sums them; then the patch and position embeddings.
    pub fn backward(
        &self,
        grads: &mut GradStore,
        keep: impl Fn(&TensorId) -> bool,
    ) -> candle_core::Result<()> {
        let tower = &self.tower;
        let merged = tower.config.spatial_merge_size.pow(2);
        let depth = tower.blocks.len();
        // The DeepStack feature tapping each boundary (block `l`'s output is boundary `l + 1`).
        let mut taps: Vec<Option<(&PatchMerger, &Tensor)>> = vec![None; depth + 1];
        let tapped = (0..depth).filter_map(|l| tower.deepstack_merger_after(l).map(|m| (l, m)));
        for ((l, merger), leaf) in tapped.zip(&self.outputs.deepstack) {
            taps[l + 1] = Some((merger, leaf));
        }
        // The gradient of block `b`'s output, once known.
        let mut upstream: Option<Tensor> = None;
        for b in (0..=depth).rev() {
            let x = Var::from_tensor(&self.boundaries[b])?;
            let mut terms = Vec::with_capacity(2);
            match upstream.take() {
                Some(g) if b < depth => {
                    terms.push((tower.block(&tower.blocks[b], &x, &self.stem)?, g))
                }
                _ => {
                    if let Some(g) = grads.remove(&self.outputs.embeds) {
                        terms.push((tower.merger.forward(&x, merged)?, g));
                    }
                }
            }
            if let Some((merger, leaf)) = taps[b] {
                if let Some(g) = grads.remove(leaf) {
                    terms.push((merger.forward(&x, merged)?, g));
                }
            }
            upstream = Some(backprop_terms(&x, terms, grads, &keep)?);
        }
        let upstream = upstream.unwrap_or(self.boundaries[0].zeros_like()?);
        let stem = tower
            .stem(&self.pixel_values, &self.grids)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let step = (stem.x * upstream)?.sum_all()?.backward()?;
        merge_into(grads, step, keep)
    }
}

/// Backpropagates `Σ (output · its gradient)` over `terms` (outputs recomputed from `input`),
/// adding the weights' gradients `keep` picks to `grads`; returns `input`'s gradient.
fn backprop_terms(
    input: &Var,
    terms: Vec<(Tensor, Tensor)>,
    grads: &mut GradStore,
    keep: &impl Fn(&TensorId) -> bool,
) -> candle_core::Result<Tensor> {
    let mut total: Option<Tensor> = None;
    for (output, grad) in terms {
        let term = (&output * grad.to_dtype(output.dtype())?)?.sum_all()?;
        total = Some(match total {
            Some(t) => (t + term)?,
            None => term,
        });
    }
    let Some(total) = total else {
        return input.as_tensor().zeros_like();
    };
    let step = total.backward()?;
    let input_grad = match step.get(input.as_tensor()) {
        Some(g) => g.clone(),
        None => input.as_tensor().zeros_like()?,
    };
    merge_into(grads, step, keep)?;
    Ok(input_grad)
}
