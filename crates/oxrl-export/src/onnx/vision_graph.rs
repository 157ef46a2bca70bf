//! Qwen3-VL's vision tower as an ONNX graph over one image (or one video's frames): inputs
//! `pixel_values` `[patches, C·T·P·P]` (the image processor's rows, 2×2 merge-block order) and
//! `grid_thw` `[3]`; outputs `image_embeds` `[patches/4, out_hidden]` and `deepstack_embeds`
//! `[k, patches/4, out_hidden]`. Everything that depends on the grid — the bilinearly resampled
//! position table, the 2-D rotary tables, attention kept inside each frame — is computed in
//! the graph from `grid_thw`, so a deployment feeds the processor's output as it is. Several
//! images are several calls, concatenated in image order (attention never crosses images).

use super::graph::{Attr, Dim, Graph};
use super::ops::{self, Weights};
use super::proto::DataType;
use crate::error::Result;
use oxrl_models::vision::{VisionConfig, VISION_PREFIX};
use std::io::Write;

const LAYER_NORM_EPS: f32 = 1e-6;

pub(super) struct VisionGraph<'a, W: Write> {
    g: Graph<W>,
    config: &'a VisionConfig,
    weights: Weights<'a>,
}

/// Each patch's row and column inside its frame (`[n]` int64) and the grid's height and width.
struct Patches {
    rows: String,
    cols: String,
    h: String,
    w: String,
}

/// Per-patch values every block uses.
struct Stem {
    /// `[n, 1, head_dim]`.
    cos: String,
    sin: String,
    /// `[n, n]`: 0 inside a frame, f32's lowest across frames.
    mask: String,
}

impl<'a, W: Write> VisionGraph<'a, W> {
    pub fn new(g: Graph<W>, config: &'a VisionConfig, weights: Weights<'a>) -> Self {
        Self { g, config, weights }
    }

    fn weight(&mut self, name: &str, shape: &[usize]) -> Result<String> {
        let full = format!("{VISION_PREFIX}{name}");
        self.weights.load(&mut self.g, &full, shape, shape)
    }

    pub fn build(mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<Graph<W>> {
        let c = self.config.clone();
        let dv = c.hidden_size;
        let merged = c.out_hidden_size;
        self.g.input(
            "pixel_values",
            DataType::Float,
            &[Dim::Named("num_patches"), Dim::Fixed(c.patch_dim())],
        );
        self.g.input("grid_thw", DataType::Int64, &[Dim::Fixed(3)]);

        // Patch embedding: the Conv3d with kernel = stride is a matrix over the flattened rows.
        let kernel_shape = [
            dv,
            c.in_channels,
            c.temporal_patch_size,
            c.patch_size,
            c.patch_size,
        ];
        let kernel = self.weights.load(
            &mut self.g,
            &format!("{VISION_PREFIX}patch_embed.proj.weight"),
            &kernel_shape,
            &[dv, c.patch_dim()],
        )?;
        let bias = self.weight("patch_embed.proj.bias", &[dv])?;
        let x = ops::affine(&mut self.g, "pixel_values", &kernel, &bias);
        let (patches, stem) = self.stem();
        let positions = self.position_embeddings(&patches)?;
        let mut x = self.g.op("Add", &[&x, &positions], vec![]);

        let mut deepstack = Vec::new();
        for layer in 0..c.depth {
            x = self.block(layer, &x, &stem)?;
            if let Some(k) = c.deepstack_visual_indexes.iter().position(|&i| i == layer) {
                let prefix = format!("deepstack_merger_list.{k}");
                let out = self.merger(&prefix, &x, true)?;
                let zero = self.g.const_i64(&[0], false);
                deepstack.push(self.g.op("Unsqueeze", &[&out, &zero], vec![]));
            }
            progress(layer + 1, c.depth);
        }
        let embeds = self.merger("merger", &x, false)?;
        self.g
            .node("Identity", &[&embeds], &["image_embeds"], vec![]);
        let tokens = || Dim::Named("num_merged_tokens");
        self.g.output(
            "image_embeds",
            DataType::Float,
            &[tokens(), Dim::Fixed(merged)],
        );
        if !deepstack.is_empty() {
            let refs: Vec<&str> = deepstack.iter().map(String::as_str).collect();
            self.g.node(
                "Concat",
                &refs,
                &["deepstack_embeds"],
                vec![Attr::Int("axis", 0)],
            );
            self.g.output(
                "deepstack_embeds",
                DataType::Float,
                &[Dim::Fixed(deepstack.len()), tokens(), Dim::Fixed(merged)],
            );
        }
        Ok(self.g)
    }

    /// Each patch's row and column inside its frame, in the pixel rows' order (2×2 merge
    /// blocks, frame after frame), the rotary tables they give, and the per-frame mask.
    fn stem(&mut self) -> (Patches, Stem) {
        let c = self.config;
        let m = c.spatial_merge_size as i64;
        let g = &mut self.g;
        let scalar = |g: &mut Graph<W>, i: i64| {
            let idx = g.const_i64(&[i], true);
            g.op("Gather", &["grid_thw", &idx], vec![Attr::Int("axis", 0)])
        };
        let (t, h, w) = (scalar(g, 0), scalar(g, 1), scalar(g, 2));
        let (zero, one) = (g.const_i64(&[0], true), g.const_i64(&[1], true));
        let axis0 = g.const_i64(&[0], false);
        let axis1 = g.const_i64(&[1], false);
        let h1 = g.op("Unsqueeze", &[&h, &axis0], vec![]);
        let w1 = g.op("Unsqueeze", &[&w, &axis0], vec![]);
        let hw_shape = g.op("Concat", &[&h1, &w1], vec![Attr::Int("axis", 0)]);
        let m_const = g.const_i64(&[m], false);
        let hm = g.op("Div", &[&h1, &m_const], vec![]);
        let wm = g.op("Div", &[&w1, &m_const], vec![]);
        let blocks_shape = g.op(
            "Concat",
            &[&hm, &m_const, &wm, &m_const],
            vec![Attr::Int("axis", 0)],
        );
        let flat = g.const_i64(&[-1], false);
        let t1 = g.op("Unsqueeze", &[&t, &axis0], vec![]);
        // grid [h, w] of one coordinate → merge-block order → repeated for each frame.
        let ordered = |g: &mut Graph<W>, line: &str, axis: &str| {
            let line = g.op("Unsqueeze", &[line, axis], vec![]);
            let grid = g.op("Expand", &[&line, &hw_shape], vec![]);
            let blocks = g.op("Reshape", &[&grid, &blocks_shape], vec![]);
            let blocks = g.op(
                "Transpose",
                &[&blocks],
                vec![Attr::Ints("perm", vec![0, 2, 1, 3])],
            );
            let one_frame = g.op("Reshape", &[&blocks, &flat], vec![]);
            g.op("Tile", &[&one_frame, &t1], vec![])
        };
        let row_line = g.op("Range", &[&zero, &h, &one], vec![]);
        let col_line = g.op("Range", &[&zero, &w, &one], vec![]);
        let rows = ordered(g, &row_line, &axis1);
        let cols = ordered(g, &col_line, &axis0);

        // 2-D rotary: the first quarter of frequencies turn with the row, the second with the
        // column, and the pair repeats (half-split rotation).
        let hd = c.head_dim();
        let sd = hd / 2;
        let theta = c.rope_theta as f32;
        let inv_freq: Vec<f32> = (0..sd / 2)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / sd as f32))
            .collect();
        let inv_freq = g.const_f32(&inv_freq, &[(sd / 2) as i64]);
        let as_float = |g: &mut Graph<W>, x: &str| {
            g.op("Cast", &[x], vec![Attr::Int("to", DataType::Float as i64)])
        };
        let (rf, cf) = (as_float(g, &rows), as_float(g, &cols));
        let rf1 = g.op("Unsqueeze", &[&rf, &axis1], vec![]);
        let cf1 = g.op("Unsqueeze", &[&cf, &axis1], vec![]);
        let fr = g.op("Mul", &[&rf1, &inv_freq], vec![]);
        let fc = g.op("Mul", &[&cf1, &inv_freq], vec![]);
        let half = g.op("Concat", &[&fr, &fc], vec![Attr::Int("axis", -1)]);
        let emb = g.op("Concat", &[&half, &half], vec![Attr::Int("axis", -1)]);
        let (cos, sin) = ops::cos_sin(g, &emb);
        let cos = g.op("Unsqueeze", &[&cos, &axis1], vec![]);
        let sin = g.op("Unsqueeze", &[&sin, &axis1], vec![]);

        // Frames: patch i belongs to frame i / (h·w); attention stays inside a frame.
        let n = g.op("Shape", &["pixel_values"], vec![]);
        let n = g.op("Gather", &[&n, &zero], vec![Attr::Int("axis", 0)]);
        let patch = g.op("Range", &[&zero, &n, &one], vec![]);
        let per_frame = g.op("Mul", &[&h, &w], vec![]);
        let frame = g.op("Div", &[&patch, &per_frame], vec![]);
        let fi = g.op("Unsqueeze", &[&frame, &axis1], vec![]);
        let fj = g.op("Unsqueeze", &[&frame, &axis0], vec![]);
        let same = g.op("Equal", &[&fi, &fj], vec![]);
        let open = g.const_f32(&[0.0], &[]);
        let closed = g.const_f32(&[f32::MIN], &[]);
        let mask = g.op("Where", &[&same, &open, &closed], vec![]);

        let patches = Patches { rows, cols, h, w };
        (patches, Stem { cos, sin, mask })
    }

    /// The learned `side × side` position table resampled to the grid (bilinear,
    /// align_corners): source coordinate `i·(side−1)/(n−1)` (0 when n = 1), four taps with
    /// f32 weights summed in f32, in the patches' order.
    fn position_embeddings(&mut self, p: &Patches) -> Result<String> {
        let c = self.config;
        let side = c.position_grid_side();
        let table = self.weight(
            "pos_embed.weight",
            &[c.num_position_embeddings, c.hidden_size],
        )?;
        let g = &mut self.g;
        let float = |g: &mut Graph<W>, x: &str| {
            g.op("Cast", &[x], vec![Attr::Int("to", DataType::Float as i64)])
        };
        let one_i = g.const_i64(&[1], true);
        let last_f = g.const_f32(&[(side - 1) as f32], &[]);
        let last_i = g.const_i64(&[(side - 1) as i64], true);
        let one_f = g.const_f32(&[1.0], &[]);
        // (y0, y1, dy) of a coordinate over a grid side of n patches.
        let taps = |g: &mut Graph<W>, i: &str, n: &str| {
            let n1 = g.op("Sub", &[n, &one_i], vec![]);
            let n1 = g.op("Max", &[&n1, &one_i], vec![]);
            let i = float(g, i);
            let n1 = float(g, &n1);
            let scaled = g.op("Mul", &[&i, &last_f], vec![]);
            let y = g.op("Div", &[&scaled, &n1], vec![]);
            let y0f = g.op("Floor", &[&y], vec![]);
            let dy = g.op("Sub", &[&y, &y0f], vec![]);
            let y0 = g.op(
                "Cast",
                &[&y0f],
                vec![Attr::Int("to", DataType::Int64 as i64)],
            );
            let y1 = g.op("Add", &[&y0, &one_i], vec![]);
            let y1 = g.op("Min", &[&y1, &last_i], vec![]);
            (y0, y1, dy)
        };
        let (y0, y1, dy) = taps(g, &p.rows, &p.h);
        let (x0, x1, dx) = taps(g, &p.cols, &p.w);
        let side_i = g.const_i64(&[side as i64], true);
        let ndy = g.op("Sub", &[&one_f, &dy], vec![]);
        let ndx = g.op("Sub", &[&one_f, &dx], vec![]);
        let axis1 = g.const_i64(&[1], false);
        let mut sum: Option<String> = None;
        for (yy, xx, wy, wx) in [
            (&y0, &x0, &ndy, &ndx),
            (&y0, &x1, &ndy, &dx),
            (&y1, &x0, &dy, &ndx),
            (&y1, &x1, &dy, &dx),
        ] {
            let row = g.op("Mul", &[yy, &side_i], vec![]);
            let index = g.op("Add", &[&row, xx], vec![]);
            let values = g.op("Gather", &[&table, &index], vec![Attr::Int("axis", 0)]);
            let weight = g.op("Mul", &[wy, wx], vec![]);
            let weight = g.op("Unsqueeze", &[&weight, &axis1], vec![]);
            let term = g.op("Mul", &[&values, &weight], vec![]);
            sum = Some(match sum {
                None => term,
                Some(s) => g.op("Add", &[&s, &term], vec![]),
            });
        }
        Ok(sum.unwrap_or_default())
    }

    /// One `Qwen3VLVisionBlock`: non-causal attention inside each frame, then the MLP, both
    /// pre-norm and residual.
    fn block(&mut self, layer: usize, x: &str, stem: &Stem) -> Result<String> {
        let c = self.config.clone();
        let (dv, iv, heads, hd) = (
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.head_dim(),
        );
        let mut w = std::collections::HashMap::new();
        for (part, shape) in [
            ("norm1.weight", vec![dv]),
            ("norm1.bias", vec![dv]),
            ("attn.qkv.weight", vec![3 * dv, dv]),
            ("attn.qkv.bias", vec![3 * dv]),
            ("attn.proj.weight", vec![dv, dv]),
            ("attn.proj.bias", vec![dv]),
            ("norm2.weight", vec![dv]),
            ("norm2.bias", vec![dv]),
            ("mlp.linear_fc1.weight", vec![iv, dv]),
            ("mlp.linear_fc1.bias", vec![iv]),
            ("mlp.linear_fc2.weight", vec![dv, iv]),
            ("mlp.linear_fc2.bias", vec![dv]),
        ] {
            w.insert(
                part,
                self.weight(&format!("blocks.{layer}.{part}"), &shape)?,
            );
        }
        let g = &mut self.g;
        let xn = ops::layer_norm(g, x, &w["norm1.weight"], &w["norm1.bias"], LAYER_NORM_EPS);
        let qkv = ops::affine(g, &xn, &w["attn.qkv.weight"], &w["attn.qkv.bias"]);
        let shape = g.const_i64(&[-1, 3, heads as i64, hd as i64], false);
        let qkv = g.op("Reshape", &[&qkv, &shape], vec![]);
        let thirds = g.op_n("Split", &[&qkv], vec![Attr::Int("axis", 1)], 3);
        let axis1 = g.const_i64(&[1], false);
        let part = |g: &mut Graph<W>, i: usize, rotate: bool| {
            let x = g.op("Squeeze", &[&thirds[i], &axis1], vec![]);
            let x = match rotate {
                true => ops::rope(g, &x, &stem.cos, &stem.sin, hd),
                false => x,
            };
            // [n, heads, hd] → [heads, n, hd]
            g.op("Transpose", &[&x], vec![Attr::Ints("perm", vec![1, 0, 2])])
        };
        let q = part(g, 0, true);
        let k = part(g, 1, true);
        let v = part(g, 2, false);
        let kt = g.op("Transpose", &[&k], vec![Attr::Ints("perm", vec![0, 2, 1])]);
        let scores = g.op("MatMul", &[&q, &kt], vec![]);
        let scale = g.const_f32(&[(hd as f32).powf(-0.5)], &[]);
        let scores = g.op("Mul", &[&scores, &scale], vec![]);
        let scores = g.op("Add", &[&scores, &stem.mask], vec![]);
        let probs = g.op("Softmax", &[&scores], vec![Attr::Int("axis", -1)]);
        let attn = g.op("MatMul", &[&probs, &v], vec![]);
        let attn = g.op(
            "Transpose",
            &[&attn],
            vec![Attr::Ints("perm", vec![1, 0, 2])],
        );
        let flat = g.const_i64(&[-1, dv as i64], false);
        let attn = g.op("Reshape", &[&attn, &flat], vec![]);
        let attn = ops::affine(g, &attn, &w["attn.proj.weight"], &w["attn.proj.bias"]);
        let x = g.op("Add", &[x, &attn], vec![]);
        let xn = ops::layer_norm(g, &x, &w["norm2.weight"], &w["norm2.bias"], LAYER_NORM_EPS);
        let h = ops::affine(
            g,
            &xn,
            &w["mlp.linear_fc1.weight"],
            &w["mlp.linear_fc1.bias"],
        );
        let h = ops::gelu_tanh(g, &h);
        let h = ops::affine(
            g,
            &h,
            &w["mlp.linear_fc2.weight"],
            &w["mlp.linear_fc2.bias"],
        );
        Ok(g.op("Add", &[&x, &h], vec![]))
    }

    /// A patch merger: each 2×2 block's four tokens concatenated, normed (before the
    /// concatenation for the final merger, after it for the DeepStack ones), then
    /// `fc2(GELU(fc1(·)))` with the exact GELU.
    fn merger(&mut self, prefix: &str, x: &str, postshuffle: bool) -> Result<String> {
        let c = self.config;
        let m2 = c.spatial_merge_size * c.spatial_merge_size;
        let (dv, hm, out) = (c.hidden_size, c.hidden_size * m2, c.out_hidden_size);
        let norm = if postshuffle { hm } else { dv };
        let nw = self.weight(&format!("{prefix}.norm.weight"), &[norm])?;
        let nb = self.weight(&format!("{prefix}.norm.bias"), &[norm])?;
        let w1 = self.weight(&format!("{prefix}.linear_fc1.weight"), &[hm, hm])?;
        let b1 = self.weight(&format!("{prefix}.linear_fc1.bias"), &[hm])?;
        let w2 = self.weight(&format!("{prefix}.linear_fc2.weight"), &[out, hm])?;
        let b2 = self.weight(&format!("{prefix}.linear_fc2.bias"), &[out])?;
        let g = &mut self.g;
        let merged = g.const_i64(&[-1, hm as i64], false);
        let x = match postshuffle {
            true => {
                let x = g.op("Reshape", &[x, &merged], vec![]);
                ops::layer_norm(g, &x, &nw, &nb, LAYER_NORM_EPS)
            }
            false => {
                let x = ops::layer_norm(g, x, &nw, &nb, LAYER_NORM_EPS);
                g.op("Reshape", &[&x, &merged], vec![])
            }
        };
        let h = ops::affine(g, &x, &w1, &b1);
        let h = ops::gelu_erf(g, &h);
        Ok(ops::affine(g, &h, &w2, &b2))
    }
}
