//! Pieces both graphs are built from: checkpoint weights as initializers, `x @ Wᵀ (+ b)`, the
//! half-split rotary embedding and the GELUs, each spelled in standard ONNX operators.

use super::graph::{Attr, Graph};
use super::proto::DataType;
use crate::error::{io_err, Result};
use crate::tensors::{CheckpointTensors, StoredDtype};
use std::io::Write;
use std::path::Path;

/// The stored precision of the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

impl WeightDtype {
    fn data_type(self) -> DataType {
        match self {
            Self::F32 => DataType::Float,
            Self::F16 => DataType::Float16,
            Self::BF16 => DataType::BFloat16,
        }
    }

    fn encode(self, values: &[f32]) -> Vec<u8> {
        let stored = match self {
            Self::F32 => StoredDtype::F32,
            Self::F16 => StoredDtype::F16,
            Self::BF16 => StoredDtype::BF16,
        };
        stored.encode(values)
    }
}

/// Where a graph's weights come from and how they are stored.
pub struct Weights<'a> {
    pub tensors: &'a CheckpointTensors,
    pub dtype: WeightDtype,
    /// The external data file, for errors.
    pub data_path: &'a Path,
}

impl Weights<'_> {
    /// The checkpoint tensor `name` (its shape checked against `shape`), stored in the export
    /// dtype with the shape `dims` (the same elements, e.g. a Conv3d kernel as a matrix) and
    /// cast to f32 in the graph.
    pub fn load<W: Write>(
        &self,
        g: &mut Graph<W>,
        name: &str,
        shape: &[usize],
        dims: &[usize],
    ) -> Result<String> {
        self.tensors.shape_of(name, shape)?;
        let raw = self.dtype.encode(&self.tensors.read_f32(name)?);
        let stored = g
            .weight(name, self.dtype.data_type(), dims, &raw)
            .map_err(io_err(self.data_path))?;
        Ok(match self.dtype {
            WeightDtype::F32 => stored,
            _ => g.op(
                "Cast",
                &[&stored],
                vec![Attr::Int("to", DataType::Float as i64)],
            ),
        })
    }
}

/// `x @ Wᵀ` for a PyTorch `[out, in]` weight.
pub fn linear<W: Write>(g: &mut Graph<W>, x: &str, weight: &str) -> String {
    let wt = g.op("Transpose", &[weight], vec![Attr::Ints("perm", vec![1, 0])]);
    g.op("MatMul", &[x, &wt], vec![])
}

/// `x @ Wᵀ + b`.
pub fn affine<W: Write>(g: &mut Graph<W>, x: &str, weight: &str, bias: &str) -> String {
    let y = linear(g, x, weight);
    g.op("Add", &[&y, bias], vec![])
}

/// `x·cos + rotate_half(x)·sin` with rotate_half(x) = [−x₂, x₁] over the last axis of size
/// `head_dim` (transformers' half-split layout).
pub fn rope<W: Write>(g: &mut Graph<W>, x: &str, cos: &str, sin: &str, head_dim: usize) -> String {
    let half = (head_dim / 2) as i64;
    let split = g.const_i64(&[half, half], false);
    let halves = g.op_n("Split", &[x, &split], vec![Attr::Int("axis", -1)], 2);
    let neg = g.op("Neg", &[&halves[1]], vec![]);
    let rotated = g.op("Concat", &[&neg, &halves[0]], vec![Attr::Int("axis", -1)]);
    let a = g.op("Mul", &[x, cos], vec![]);
    let b = g.op("Mul", &[&rotated, sin], vec![]);
    g.op("Add", &[&a, &b], vec![])
}

/// `cos` and `sin` of `emb`.
pub fn cos_sin<W: Write>(g: &mut Graph<W>, emb: &str) -> (String, String) {
    (g.op("Cos", &[emb], vec![]), g.op("Sin", &[emb], vec![]))
}

/// `x · σ(x)` (SiLU).
pub fn silu<W: Write>(g: &mut Graph<W>, x: &str) -> String {
    let sig = g.op("Sigmoid", &[x], vec![]);
    g.op("Mul", &[x, &sig], vec![])
}

/// GELU with tanh: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))` (`gelu_pytorch_tanh`).
pub fn gelu_tanh<W: Write>(g: &mut Graph<W>, x: &str) -> String {
    let c = g.const_f32(&[0.044715], &[]);
    let k = g.const_f32(&[(2.0 / std::f32::consts::PI).sqrt()], &[]);
    let half = g.const_f32(&[0.5], &[]);
    let one = g.const_f32(&[1.0], &[]);
    let x2 = g.op("Mul", &[x, x], vec![]);
    let x3 = g.op("Mul", &[&x2, x], vec![]);
    let cx3 = g.op("Mul", &[&x3, &c], vec![]);
    let inner = g.op("Add", &[x, &cx3], vec![]);
    let inner = g.op("Mul", &[&inner, &k], vec![]);
    let t = g.op("Tanh", &[&inner], vec![]);
    let t1 = g.op("Add", &[&t, &one], vec![]);
    let hx = g.op("Mul", &[x, &half], vec![]);
    g.op("Mul", &[&hx, &t1], vec![])
}

/// Exact GELU: `½x(1 + erf(x/√2))` (`nn.GELU()`).
pub fn gelu_erf<W: Write>(g: &mut Graph<W>, x: &str) -> String {
    let inv_sqrt2 = g.const_f32(&[std::f32::consts::FRAC_1_SQRT_2], &[]);
    let half = g.const_f32(&[0.5], &[]);
    let one = g.const_f32(&[1.0], &[]);
    let scaled = g.op("Mul", &[x, &inv_sqrt2], vec![]);
    let e = g.op("Erf", &[&scaled], vec![]);
    let e1 = g.op("Add", &[&e, &one], vec![]);
    let hx = g.op("Mul", &[x, &half], vec![]);
    g.op("Mul", &[&hx, &e1], vec![])
}

/// `nn.LayerNorm(eps)` over the last axis.
pub fn layer_norm<W: Write>(
    g: &mut Graph<W>,
    x: &str,
    weight: &str,
    bias: &str,
    eps: f32,
) -> String {
    g.op(
        "LayerNormalization",
        &[x, weight, bias],
        vec![Attr::Int("axis", -1), Attr::Float("epsilon", eps)],
    )
}
