//! Building an ONNX graph: nodes with generated value names, small constants stored inline,
//! and weights streamed into an external data file (`model.onnx.data`) so a model of any
//! size stays under protobuf's 2 GB message limit.

use super::proto::{attribute_type, field, DataType, Message, EXTERNAL};
use std::io::{self, Write};

/// The default ONNX operator set the graph is written against.
pub const OPSET: i64 = 17;
/// `ModelProto.ir_version` of opset 17 (ONNX 1.12).
const IR_VERSION: i64 = 8;
/// Each weight's offset in the data file is a multiple of this.
const DATA_ALIGNMENT: u64 = 64;

/// A node attribute.
pub enum Attr {
    Int(&'static str, i64),
    Float(&'static str, f32),
    Ints(&'static str, Vec<i64>),
}

/// One dimension of a graph input or output.
pub enum Dim<'a> {
    Fixed(usize),
    Named(&'a str),
}

pub struct Graph<W: Write> {
    nodes: Vec<Message>,
    initializers: Vec<Message>,
    inputs: Vec<Message>,
    outputs: Vec<Message>,
    next_value: usize,
    data: W,
    data_file: String,
    data_len: u64,
}

impl<W: Write> Graph<W> {
    /// A graph whose weights go to `data`, which the model file names `data_file`.
    pub fn new(data: W, data_file: &str) -> Self {
        Self {
            nodes: Vec::new(),
            initializers: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            next_value: 0,
            data,
            data_file: data_file.into(),
            data_len: 0,
        }
    }

    fn fresh(&mut self, op: &str) -> String {
        self.next_value += 1;
        format!("{op}_{}", self.next_value)
    }

    /// A node with one output; returns the output's name.
    pub fn op(&mut self, op: &str, inputs: &[&str], attrs: Vec<Attr>) -> String {
        let out = self.fresh(op);
        self.node(op, inputs, &[&out], attrs);
        out
    }

    /// A node with `n` outputs.
    pub fn op_n(&mut self, op: &str, inputs: &[&str], attrs: Vec<Attr>, n: usize) -> Vec<String> {
        let outs: Vec<String> = (0..n).map(|_| self.fresh(op)).collect();
        let refs: Vec<&str> = outs.iter().map(String::as_str).collect();
        self.node(op, inputs, &refs, attrs);
        outs
    }

    /// A node writing the named outputs.
    pub fn node(&mut self, op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<Attr>) {
        let mut node = Message::new();
        for i in inputs {
            node.string(field::node::INPUT, i);
        }
        for o in outputs {
            node.string(field::node::OUTPUT, o);
        }
        node.string(
            field::node::NAME,
            &format!("{op}_node_{}", self.nodes.len()),
        )
        .string(field::node::OP_TYPE, op);
        for attr in attrs {
            node.message(field::node::ATTRIBUTE, attribute(attr));
        }
        self.nodes.push(node);
    }

    /// An int64 constant (rank 1, or a scalar when `scalar`), stored in the model file.
    pub fn const_i64(&mut self, values: &[i64], scalar: bool) -> String {
        let name = self.fresh("const");
        let dims = if scalar {
            vec![]
        } else {
            vec![values.len() as i64]
        };
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.inline(&name, DataType::Int64, &dims, &raw);
        name
    }

    /// An f32 constant of shape `dims`, stored in the model file.
    pub fn const_f32(&mut self, values: &[f32], dims: &[i64]) -> String {
        let name = self.fresh("const");
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.inline(&name, DataType::Float, dims, &raw);
        name
    }

    fn inline(&mut self, name: &str, data_type: DataType, dims: &[i64], raw: &[u8]) {
        let mut t = Message::new();
        t.packed_ints(field::tensor::DIMS, dims)
            .int(field::tensor::DATA_TYPE, data_type as i64)
            .string(field::tensor::NAME, name)
            .bytes(field::tensor::RAW_DATA, raw);
        self.initializers.push(t);
    }

    /// A weight named `name` whose little-endian bytes `raw` go to the external data file.
    pub fn weight(
        &mut self,
        name: &str,
        data_type: DataType,
        dims: &[usize],
        raw: &[u8],
    ) -> io::Result<String> {
        let offset = self.data_len.div_ceil(DATA_ALIGNMENT) * DATA_ALIGNMENT;
        self.data
            .write_all(&vec![0u8; (offset - self.data_len) as usize])?;
        self.data.write_all(raw)?;
        self.data_len = offset + raw.len() as u64;
        let entry = |key: &str, value: &str| {
            let mut e = Message::new();
            e.string(field::string_entry::KEY, key)
                .string(field::string_entry::VALUE, value);
            e
        };
        let dims: Vec<i64> = dims.iter().map(|d| *d as i64).collect();
        let mut t = Message::new();
        t.packed_ints(field::tensor::DIMS, &dims)
            .int(field::tensor::DATA_TYPE, data_type as i64)
            .string(field::tensor::NAME, name)
            .message(
                field::tensor::EXTERNAL_DATA,
                entry("location", &self.data_file),
            )
            .message(
                field::tensor::EXTERNAL_DATA,
                entry("offset", &offset.to_string()),
            )
            .message(
                field::tensor::EXTERNAL_DATA,
                entry("length", &raw.len().to_string()),
            )
            .int(field::tensor::DATA_LOCATION, EXTERNAL);
        self.initializers.push(t);
        Ok(name.to_string())
    }

    pub fn input(&mut self, name: &str, data_type: DataType, dims: &[Dim]) {
        self.inputs.push(value_info(name, data_type, dims));
    }

    pub fn output(&mut self, name: &str, data_type: DataType, dims: &[Dim]) {
        self.outputs.push(value_info(name, data_type, dims));
    }

    /// The model file's bytes, and the data writer back (to flush and sync).
    pub fn finish(self, graph_name: &str, producer_version: &str) -> (Vec<u8>, W) {
        let mut graph = Message::new();
        for n in self.nodes {
            graph.message(field::graph::NODE, n);
        }
        graph.string(field::graph::NAME, graph_name);
        for t in self.initializers {
            graph.message(field::graph::INITIALIZER, t);
        }
        for i in self.inputs {
            graph.message(field::graph::INPUT, i);
        }
        for o in self.outputs {
            graph.message(field::graph::OUTPUT, o);
        }
        let mut opset = Message::new();
        opset
            .string(field::opset::DOMAIN, "")
            .int(field::opset::VERSION, OPSET);
        let mut model = Message::new();
        model
            .int(field::model::IR_VERSION, IR_VERSION)
            .string(field::model::PRODUCER_NAME, "oxrl")
            .string(field::model::PRODUCER_VERSION, producer_version)
            .message(field::model::GRAPH, graph)
            .message(field::model::OPSET_IMPORT, opset);
        (model.into_bytes(), self.data)
    }
}

fn attribute(attr: Attr) -> Message {
    let mut a = Message::new();
    match attr {
        Attr::Int(name, v) => {
            a.string(field::attribute::NAME, name)
                .int(field::attribute::I, v)
                .int(field::attribute::TYPE, attribute_type::INT);
        }
        Attr::Float(name, v) => {
            a.string(field::attribute::NAME, name)
                .float(field::attribute::F, v)
                .int(field::attribute::TYPE, attribute_type::FLOAT);
        }
        Attr::Ints(name, v) => {
            a.string(field::attribute::NAME, name)
                .packed_ints(field::attribute::INTS, &v)
                .int(field::attribute::TYPE, attribute_type::INTS);
        }
    }
    a
}

fn value_info(name: &str, data_type: DataType, dims: &[Dim]) -> Message {
    use field::type_proto as tp;
    let mut shape = Message::new();
    for d in dims {
        let mut dim = Message::new();
        match d {
            Dim::Fixed(n) => dim.int(tp::DIM_VALUE, *n as i64),
            Dim::Named(s) => dim.string(tp::DIM_PARAM, s),
        };
        shape.message(tp::DIM, dim);
    }
    let mut tensor = Message::new();
    tensor
        .int(tp::ELEM_TYPE, data_type as i64)
        .message(tp::SHAPE, shape);
    let mut ty = Message::new();
    ty.message(tp::TENSOR_TYPE, tensor);
    let mut v = Message::new();
    v.string(field::value_info::NAME, name)
        .message(field::value_info::TYPE, ty);
    v
}
