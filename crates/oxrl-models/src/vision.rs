//! The Qwen3-VL vision tower (`Qwen3VLVisionModel`), per qwen3-vl-spec §2.1–2.2: patch embedding
//! as a matmul, the learned position table resampled bilinearly to each image's grid, 2-D rotary
//! attention inside each image, LayerNorm blocks with tanh-GELU MLPs, the final patch merger and
//! the DeepStack mergers whose outputs are added to the text stream after the first text layers.
//!
//! Built only from candle primitives with a backward, so training reaches every vision weight.

use crate::error::{ModelError, Result};
use crate::ops::{linear, rope};
pub use crate::weights::Init;
use candle_core::{DType, Device, Tensor, D};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// `vision_config` of a Qwen3-VL `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
    pub deepstack_visual_indexes: Vec<usize>,
    pub rope_theta: f64,
}

impl VisionConfig {
    pub fn from_value(v: &Value, path: &Path) -> Result<Self> {
        let err = |key: &str, expected: &str| ModelError::ConfigKey {
            path: path.to_path_buf(),
            key: format!("vision_config.{key}"),
            expected: expected.to_string(),
        };
        let uint = |key: &str, default: Option<usize>| -> Result<usize> {
            match v.get(key) {
                None | Some(Value::Null) => default.ok_or_else(|| err(key, "a positive integer")),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| err(key, "a positive integer")),
            }
        };
        let deepstack_visual_indexes = match v.get("deepstack_visual_indexes") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|n| n as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| err("deepstack_visual_indexes", "a list of layer indexes"))?,
            Some(_) => return Err(err("deepstack_visual_indexes", "a list of layer indexes")),
        };
        let act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(err("hidden_act", "\"gelu_pytorch_tanh\""));
        }
        let c = Self {
            depth: uint("depth", None)?,
            hidden_size: uint("hidden_size", None)?,
            intermediate_size: uint("intermediate_size", None)?,
            num_heads: uint("num_heads", None)?,
            in_channels: uint("in_channels", Some(3))?,
            patch_size: uint("patch_size", Some(16))?,
            temporal_patch_size: uint("temporal_patch_size", Some(2))?,
            spatial_merge_size: uint("spatial_merge_size", Some(2))?,
            out_hidden_size: uint("out_hidden_size", None)?,
            num_position_embeddings: uint("num_position_embeddings", None)?,
            deepstack_visual_indexes,
            rope_theta: v
                .get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
                .or_else(|| v.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
        };
        if !c.hidden_size.is_multiple_of(c.num_heads)
            || !(c.hidden_size / c.num_heads).is_multiple_of(4)
        {
            return Err(err(
                "num_heads",
                "a divisor of hidden_size leaving a head size divisible by 4",
            ));
        }
        let side = c.position_grid_side();
        if side * side != c.num_position_embeddings {
            return Err(err("num_position_embeddings", "a square number"));
        }
        if let Some(&bad) = c.deepstack_visual_indexes.iter().find(|&&i| i >= c.depth) {
            return Err(err(
                "deepstack_visual_indexes",
                &format!("indexes below depth {} (got {bad})", c.depth),
            ));
        }
        Ok(c)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values per pixel row: `C × T × P × P`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Side of the square position table (`isqrt(num_position_embeddings)`).
    pub fn position_grid_side(&self) -> usize {
        self.num_position_embeddings.isqrt()
    }
}

pub struct VisionBlock {
    pub norm1_weight: Tensor,
    pub norm1_bias: Tensor,
    pub norm2_weight: Tensor,
    pub norm2_bias: Tensor,
    pub qkv_weight: Tensor,
    pub qkv_bias: Tensor,
    pub proj_weight: Tensor,
    pub proj_bias: Tensor,
    pub fc1_weight: Tensor,
    pub fc1_bias: Tensor,
    pub fc2_weight: Tensor,
    pub fc2_bias: Tensor,
}

impl VisionBlock {
    fn named(&self) -> [(&'static str, &Tensor); 12] {
        [
            ("norm1.weight", &self.norm1_weight),
            ("norm1.bias", &self.norm1_bias),
            ("norm2.weight", &self.norm2_weight),
            ("norm2.bias", &self.norm2_bias),
            ("attn.qkv.weight", &self.qkv_weight),
            ("attn.qkv.bias", &self.qkv_bias),
            ("attn.proj.weight", &self.proj_weight),
            ("attn.proj.bias", &self.proj_bias),
            ("mlp.linear_fc1.weight", &self.fc1_weight),
            ("mlp.linear_fc1.bias", &self.fc1_bias),
            ("mlp.linear_fc2.weight", &self.fc2_weight),
            ("mlp.linear_fc2.bias", &self.fc2_bias),
        ]
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Self {
        Self {
            norm1_weight: f(&self.norm1_weight),
            norm1_bias: f(&self.norm1_bias),
            norm2_weight: f(&self.norm2_weight),
            norm2_bias: f(&self.norm2_bias),
            qkv_weight: f(&self.qkv_weight),
            qkv_bias: f(&self.qkv_bias),
            proj_weight: f(&self.proj_weight),
            proj_bias: f(&self.proj_bias),
            fc1_weight: f(&self.fc1_weight),
            fc1_bias: f(&self.fc1_bias),
            fc2_weight: f(&self.fc2_weight),
            fc2_bias: f(&self.fc2_bias),
        }
    }
}

/// `Qwen3VLVisionPatchMerger`: 2×2 neighbouring tokens concatenated, then `fc2(gelu(fc1(·)))`.
/// The norm runs per token before the merge (`merger`) or on the merged row (DeepStack mergers).
pub struct PatchMerger {
    pub postshuffle_norm: bool,
    pub norm_weight: Tensor,
    pub norm_bias: Tensor,
    pub fc1_weight: Tensor,
    pub fc1_bias: Tensor,
    pub fc2_weight: Tensor,
    pub fc2_bias: Tensor,
}

impl PatchMerger {
    fn named(&self) -> [(&'static str, &Tensor); 6] {
        [
            ("norm.weight", &self.norm_weight),
            ("norm.bias", &self.norm_bias),
            ("linear_fc1.weight", &self.fc1_weight),
            ("linear_fc1.bias", &self.fc1_bias),
            ("linear_fc2.weight", &self.fc2_weight),
            ("linear_fc2.bias", &self.fc2_bias),
        ]
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Self {
        Self {
            postshuffle_norm: self.postshuffle_norm,
            norm_weight: f(&self.norm_weight),
            norm_bias: f(&self.norm_bias),
            fc1_weight: f(&self.fc1_weight),
            fc1_bias: f(&self.fc1_bias),
            fc2_weight: f(&self.fc2_weight),
            fc2_bias: f(&self.fc2_bias),
        }
    }

    pub(crate) fn forward(&self, x: &Tensor, merged: usize) -> candle_core::Result<Tensor> {
        let rows = x.dim(0)? / merged;
        let x = if self.postshuffle_norm {
            layer_norm(&x.reshape((rows, ()))?, &self.norm_weight, &self.norm_bias)?
        } else {
            layer_norm(x, &self.norm_weight, &self.norm_bias)?.reshape((rows, ()))?
        };
        let h = affine(&x, &self.fc1_weight, &self.fc1_bias)?.gelu_erf()?;
        affine(&h, &self.fc2_weight, &self.fc2_bias)
    }
}

/// `x · wᵀ + b`.
fn affine(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    linear(x, w)?.broadcast_add(b)
}

/// `nn.LayerNorm(eps = 1e-6)` over the last axis, statistics and affine in f32 (as torch's
/// kernel does for half-precision inputs), cast back to the input dtype.
fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
    const EPS: f64 = 1e-6;
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let inv = (centred.sqr()?.mean_keepdim(D::Minus1)? + EPS)?
        .sqrt()?
        .recip()?;
    centred
        .broadcast_mul(&inv)?
        .broadcast_mul(&weight.to_dtype(DType::F32)?)?
        .broadcast_add(&bias.to_dtype(DType::F32)?)?
        .to_dtype(dtype)
}

/// Every vision weight's checkpoint name, shape and initialisation.
pub fn parameter_shapes(c: &VisionConfig) -> Vec<(String, Vec<usize>, Init)> {
    let (dv, iv) = (c.hidden_size, c.intermediate_size);
    let hm = dv * c.spatial_merge_size * c.spatial_merge_size;
    let p = |name: &str, shape: &[usize], init: Init| {
        (format!("{VISION_PREFIX}{name}"), shape.to_vec(), init)
    };
    let mut out = vec![
        p(
            "patch_embed.proj.weight",
            &[
                dv,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size,
            ],
            Init::Normal,
        ),
        p("patch_embed.proj.bias", &[dv], Init::Zeros),
        p(
            "pos_embed.weight",
            &[c.num_position_embeddings, dv],
            Init::Normal,
        ),
    ];
    for i in 0..c.depth {
        for (name, shape, init) in [
            ("norm1.weight", vec![dv], Init::Ones),
            ("norm1.bias", vec![dv], Init::Zeros),
            ("norm2.weight", vec![dv], Init::Ones),
            ("norm2.bias", vec![dv], Init::Zeros),
            ("attn.qkv.weight", vec![3 * dv, dv], Init::Normal),
            ("attn.qkv.bias", vec![3 * dv], Init::Zeros),
            ("attn.proj.weight", vec![dv, dv], Init::Normal),
            ("attn.proj.bias", vec![dv], Init::Zeros),
            ("mlp.linear_fc1.weight", vec![iv, dv], Init::Normal),
            ("mlp.linear_fc1.bias", vec![iv], Init::Zeros),
            ("mlp.linear_fc2.weight", vec![dv, iv], Init::Normal),
            ("mlp.linear_fc2.bias", vec![dv], Init::Zeros),
        ] {
            out.push(p(&format!("blocks.{i}.{name}"), &shape, init));
        }
    }
    let mergers = std::iter::once(("merger".to_string(), dv)).chain(
        (0..c.deepstack_visual_indexes.len()).map(|k| (format!("deepstack_merger_list.{k}"), hm)),
    );
    for (prefix, norm) in mergers {
        for (name, shape, init) in [
            ("norm.weight", vec![norm], Init::Ones),
            ("norm.bias", vec![norm], Init::Zeros),
            ("linear_fc1.weight", vec![hm, hm], Init::Normal),
            ("linear_fc1.bias", vec![hm], Init::Zeros),
            (
                "linear_fc2.weight",
                vec![c.out_hidden_size, hm],
                Init::Normal,
            ),
            ("linear_fc2.bias", vec![c.out_hidden_size], Init::Zeros),
        ] {
            out.push(p(&format!("{prefix}.{name}"), &shape, init));
        }
    }
    out
}

/// What the vision tower gives the text model for a batch of images.
pub struct VisionOutput {
    /// `[Σ t·h·w/m², out_hidden]`: merged tokens, image after image.
    pub embeds: Tensor,
    /// One `[Σ t·h·w/m², out_hidden]` per DeepStack tap, in `deepstack_visual_indexes` order.
    pub deepstack: Vec<Tensor>,
}

/// The tower's first block input and the grids' rotary tables and attention segments.
pub(crate) struct Stem {
    /// Patch embeddings plus resampled positions `[Σ t·h·w, Dv]`.
    pub x: Tensor,
    /// 2-D rotary tables `[Σ t·h·w, head_dim]` (f32).
    pub cos: Tensor,
    pub sin: Tensor,
    /// Rows of each image (per temporal slice): attention stays inside one.
    pub segments: Vec<usize>,
}

pub struct VisionTower {
    pub config: VisionConfig,
    /// The Conv3d kernel `[Dv, C, T, P, P]`; kernel = stride, so it runs as a matmul per patch.
    pub patch_weight: Tensor,
    pub patch_bias: Tensor,
    pub pos_embed: Tensor,
    pub blocks: Vec<VisionBlock>,
    pub merger: PatchMerger,
    pub deepstack_mergers: Vec<PatchMerger>,
    pub dtype: DType,
    pub device: Device,
}

/// Checkpoint prefix of every vision weight.
pub const VISION_PREFIX: &str = "model.visual.";

impl VisionTower {
    /// Takes the `model.visual.*` tensors out of `t`.
    pub fn from_tensors(
        config: VisionConfig,
        t: &mut HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let c = &config;
        let (dv, iv) = (c.hidden_size, c.intermediate_size);
        let hm = dv * c.spatial_merge_size * c.spatial_merge_size;
        let mut take = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let full = format!("{VISION_PREFIX}{name}");
            let x = t
                .remove(&full)
                .ok_or_else(|| ModelError::MissingTensor(full.clone()))?;
            if x.elem_count() != shape.iter().product::<usize>() {
                return Err(ModelError::TensorShape {
                    name: full,
                    got: x.dims().to_vec(),
                    expected: shape.to_vec(),
                });
            }
            // A reshape to the same shape would still be a new tensor: keep the one given, so a
            // trainable tower's weights are the optimizer's variables themselves.
            match x.dims() == shape {
                true => Ok(x),
                false => Ok(x.reshape(shape)?),
            }
        };
        let conv = [
            dv,
            c.in_channels,
            c.temporal_patch_size,
            c.patch_size,
            c.patch_size,
        ];
        let patch_weight = take("patch_embed.proj.weight", &conv)?;
        let patch_bias = take("patch_embed.proj.bias", &[dv])?;
        let pos_embed = take("pos_embed.weight", &[c.num_position_embeddings, dv])?;
        let mut blocks = Vec::with_capacity(c.depth);
        for i in 0..c.depth {
            let mut w = |name: &str, shape: &[usize]| take(&format!("blocks.{i}.{name}"), shape);
            blocks.push(VisionBlock {
                norm1_weight: w("norm1.weight", &[dv])?,
                norm1_bias: w("norm1.bias", &[dv])?,
                norm2_weight: w("norm2.weight", &[dv])?,
                norm2_bias: w("norm2.bias", &[dv])?,
                qkv_weight: w("attn.qkv.weight", &[3 * dv, dv])?,
                qkv_bias: w("attn.qkv.bias", &[3 * dv])?,
                proj_weight: w("attn.proj.weight", &[dv, dv])?,
                proj_bias: w("attn.proj.bias", &[dv])?,
                fc1_weight: w("mlp.linear_fc1.weight", &[iv, dv])?,
                fc1_bias: w("mlp.linear_fc1.bias", &[iv])?,
                fc2_weight: w("mlp.linear_fc2.weight", &[dv, iv])?,
                fc2_bias: w("mlp.linear_fc2.bias", &[dv])?,
            });
        }
        let mut merger = |prefix: &str, postshuffle_norm: bool| -> Result<PatchMerger> {
            let norm = if postshuffle_norm { hm } else { dv };
            let mut w = |name: &str, shape: &[usize]| take(&format!("{prefix}.{name}"), shape);
            Ok(PatchMerger {
                postshuffle_norm,
                norm_weight: w("norm.weight", &[norm])?,
                norm_bias: w("norm.bias", &[norm])?,
                fc1_weight: w("linear_fc1.weight", &[hm, hm])?,
                fc1_bias: w("linear_fc1.bias", &[hm])?,
                fc2_weight: w("linear_fc2.weight", &[c.out_hidden_size, hm])?,
                fc2_bias: w("linear_fc2.bias", &[c.out_hidden_size])?,
            })
        };
        let final_merger = merger("merger", false)?;
        let deepstack_mergers = (0..c.deepstack_visual_indexes.len())
            .map(|k| merger(&format!("deepstack_merger_list.{k}"), true))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config,
            patch_weight,
            patch_bias,
            pos_embed,
            blocks,
            merger: final_merger,
            deepstack_mergers,
            dtype,
            device: device.clone(),
        })
    }

    /// Every weight under its checkpoint name.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            (
                format!("{VISION_PREFIX}patch_embed.proj.weight"),
                self.patch_weight.clone(),
            ),
            (
                format!("{VISION_PREFIX}patch_embed.proj.bias"),
                self.patch_bias.clone(),
            ),
            (
                format!("{VISION_PREFIX}pos_embed.weight"),
                self.pos_embed.clone(),
            ),
        ];
        for (i, b) in self.blocks.iter().enumerate() {
            for (name, t) in b.named() {
                out.push((format!("{VISION_PREFIX}blocks.{i}.{name}"), t.clone()));
            }
        }
        for (name, t) in self.merger.named() {
            out.push((format!("{VISION_PREFIX}merger.{name}"), t.clone()));
        }
        for (k, m) in self.deepstack_mergers.iter().enumerate() {
            for (name, t) in m.named() {
                out.push((
                    format!("{VISION_PREFIX}deepstack_merger_list.{k}.{name}"),
                    t.clone(),
                ));
            }
        }
        out
    }

    /// The same tower over other handles of its weights (`f` maps each weight).
    pub fn map_weights(&self, f: impl Fn(&Tensor) -> Tensor) -> Self {
        Self {
            config: self.config.clone(),
            patch_weight: f(&self.patch_weight),
            patch_bias: f(&self.patch_bias),
            pos_embed: f(&self.pos_embed),
            blocks: self.blocks.iter().map(|b| b.map(&f)).collect(),
            merger: self.merger.map(&f),
            deepstack_mergers: self.deepstack_mergers.iter().map(|m| m.map(&f)).collect(),
            dtype: self.dtype,
            device: self.device.clone(),
        }
    }

    /// Runs the tower over `pixel_values` `[Σ t·h·w, C·T·P·P]` of images with `grids` (t, h, w).
    pub fn forward(&self, pixel_values: &Tensor, grids: &[[usize; 3]]) -> Result<VisionOutput> {
        let m = self.config.spatial_merge_size;
        let stem = self.stem(pixel_values, grids)?;
        let mut x = stem.x.clone();
        let mut deepstack = Vec::with_capacity(self.deepstack_mergers.len());
        for (l, block) in self.blocks.iter().enumerate() {
            x = self.block(block, &x, &stem)?;
            if let Some(merger) = self.deepstack_merger_after(l) {
                deepstack.push(merger.forward(&x, m * m)?);
            }
        }
        Ok(VisionOutput {
            embeds: self.merger.forward(&x, m * m)?,
            deepstack,
        })
    }

    /// The DeepStack merger that taps block `l`'s output, if one does.
    pub(crate) fn deepstack_merger_after(&self, l: usize) -> Option<&PatchMerger> {
        let k = self
            .config
            .deepstack_visual_indexes
            .iter()
            .position(|&i| i == l)?;
        self.deepstack_mergers.get(k)
    }

    /// Checks the pixel rows against the grids, then embeds the patches: the first block's
    /// input, with what every block needs of the grids.
    pub(crate) fn stem(&self, pixel_values: &Tensor, grids: &[[usize; 3]]) -> Result<Stem> {
        let c = &self.config;
        let m = c.spatial_merge_size;
        let total: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
        if pixel_values.dims() != [total, c.patch_dim()] {
            return Err(ModelError::InvalidInput(format!(
                "pixel values of shape {:?} do not match the image grids {grids:?} (expected [{total}, {}])",
                pixel_values.dims(),
                c.patch_dim()
            )));
        }
        if let Some(g) = grids.iter().find(|g| g[1] % m != 0 || g[2] % m != 0) {
            return Err(ModelError::InvalidInput(format!(
                "image grid {g:?}: height and width must be multiples of the merge size {m}"
            )));
        }
        let kernel = self.patch_weight.reshape((c.hidden_size, c.patch_dim()))?;
        let x = affine(
            &pixel_values.to_dtype(self.dtype)?,
            &kernel,
            &self.patch_bias,
        )?;
        let x = (x + self.position_embeddings(grids)?)?;
        let (cos, sin) = self.rotary_tables(grids)?;
        let segments: Vec<usize> = grids
            .iter()
            .flat_map(|&[t, h, w]| std::iter::repeat_n(h * w, t))
            .collect();
        Ok(Stem {
            x,
            cos,
            sin,
            segments,
        })
    }

    /// One `Qwen3VLVisionBlock`: attention inside each image, then the MLP, both residual.
    pub(crate) fn block(
        &self,
        b: &VisionBlock,
        x: &Tensor,
        stem: &Stem,
    ) -> candle_core::Result<Tensor> {
        let c = &self.config;
        let (cos, sin, segments) = (&stem.cos, &stem.sin, &stem.segments);
        let (n, heads, hd) = (x.dim(0)?, c.num_heads, c.head_dim());
        let xn = layer_norm(x, &b.norm1_weight, &b.norm1_bias)?;
        let qkv = affine(&xn, &b.qkv_weight, &b.qkv_bias)?.reshape((n, 3, heads, hd))?;
        // Rotary in f32, then back to the model dtype; cos/sin are [N, hd] → [N, 1, hd].
        let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
        let rot = |t: Tensor| -> candle_core::Result<Tensor> {
            rope(&t.to_dtype(DType::F32)?, &cos, &sin)?.to_dtype(self.dtype)
        };
        let q = rot(qkv.narrow(1, 0, 1)?.squeeze(1)?)?;
        let k = rot(qkv.narrow(1, 1, 1)?.squeeze(1)?)?;
        let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
        let scale = (hd as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(segments.len());
        let mut start = 0;
        for &len in segments {
            // Full (non-causal) attention inside one image (or temporal slice): [heads, len, hd].
            let seg = |t: &Tensor| t.narrow(0, start, len)?.transpose(0, 1)?.contiguous();
            let (q, k, v) = (seg(&q)?, seg(&k)?, seg(&v)?);
            let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(self.dtype)?;
            outs.push(
                probs
                    .matmul(&v)?
                    .transpose(0, 1)?
                    .reshape((len, heads * hd))?,
            );
            start += len;
        }
        let attn = Tensor::cat(&outs, 0)?;
        let x = (x + affine(&attn, &b.proj_weight, &b.proj_bias)?)?;
        let xn = layer_norm(&x, &b.norm2_weight, &b.norm2_bias)?;
        let h = affine(&xn, &b.fc1_weight, &b.fc1_bias)?.gelu()?;
        x + affine(&h, &b.fc2_weight, &b.fc2_bias)?
    }

    /// Patch coordinates `(row, col)` of every pixel row: merge-block order, repeated per frame.
    fn patch_coordinates(&self, grids: &[[usize; 3]]) -> Vec<(usize, usize)> {
        let m = self.config.spatial_merge_size;
        let mut out = Vec::new();
        for &[t, h, w] in grids {
            for _ in 0..t {
                for br in 0..h / m {
                    for bc in 0..w / m {
                        for ir in 0..m {
                            for ic in 0..m {
                                out.push((br * m + ir, bc * m + ic));
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// The learned position table resampled to each grid (bilinear, align_corners): four taps
    /// per patch with f32 weights, summed in f32, in the pixel rows' order.
    fn position_embeddings(&self, grids: &[[usize; 3]]) -> candle_core::Result<Tensor> {
        let side = self.config.position_grid_side();
        let mut idx: [Vec<u32>; 4] = Default::default();
        let mut wts: [Vec<f32>; 4] = Default::default();
        for &[t, h, w] in grids {
            let coord = |i: usize, n: usize| -> (usize, usize, f32) {
                let x = if n == 1 {
                    0.0
                } else {
                    i as f32 * (side - 1) as f32 / (n - 1) as f32
                };
                let x0 = x as usize;
                (x0, (x0 + 1).min(side - 1), x - x0 as f32)
            };
            for (r, col) in self.patch_coordinates(&[[t, h, w]]) {
                let (y0, y1, dy) = coord(r, h);
                let (x0, x1, dx) = coord(col, w);
                let taps = [
                    (y0 * side + x0, (1.0 - dy) * (1.0 - dx)),
                    (y0 * side + x1, (1.0 - dy) * dx),
                    (y1 * side + x0, dy * (1.0 - dx)),
                    (y1 * side + x1, dy * dx),
                ];
                for (k, (i, wt)) in taps.into_iter().enumerate() {
                    idx[k].push(i as u32);
                    wts[k].push(wt);
                }
            }
        }
        let table = self.pos_embed.to_dtype(DType::F32)?;
        let mut sum: Option<Tensor> = None;
        for (i, w) in idx.into_iter().zip(wts) {
            let n = i.len();
            let rows = table.index_select(&Tensor::from_vec(i, n, &self.device)?, 0)?;
            let term = rows.broadcast_mul(&Tensor::from_vec(w, (n, 1), &self.device)?)?;
            sum = Some(match sum {
                None => term,
                Some(s) => (s + term)?,
            });
        }
        let sum = sum.ok_or_else(|| candle_core::Error::Msg("no image grids".into()))?;
        sum.to_dtype(self.dtype)
    }

    /// 2-D rotary cos/sin `[N, head_dim]` in f32: the first quarter of frequencies rotate with
    /// the patch row, the second with the column, and the pair repeats (half-split rotation).
    fn rotary_tables(&self, grids: &[[usize; 3]]) -> candle_core::Result<(Tensor, Tensor)> {
        let hd = self.config.head_dim();
        let sd = hd / 2;
        let theta = self.config.rope_theta as f32;
        let inv_freq: Vec<f32> = (0..sd / 2)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / sd as f32))
            .collect();
        let coords = self.patch_coordinates(grids);
        let mut emb = Vec::with_capacity(coords.len() * hd);
        for &(r, c) in &coords {
            let half: Vec<f32> = inv_freq
                .iter()
                .map(|f| r as f32 * f)
                .chain(inv_freq.iter().map(|f| c as f32 * f))
                .collect();
            emb.extend_from_slice(&half);
            emb.extend_from_slice(&half);
        }
        let emb = Tensor::from_vec(emb, (coords.len(), hd), &self.device)?;
        Ok((emb.cos()?, emb.sin()?))
    }
}
