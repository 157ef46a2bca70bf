//! The part of ONNX's protobuf schema (`onnx.proto3`) an exported model uses, encoded by hand:
//! protobuf's wire format is varints and length-delimited fields, and writing it directly
//! keeps a protobuf compiler out of the build. Field numbers are `onnx.proto`'s.

/// A protobuf message under construction.
#[derive(Default)]
pub struct Message(Vec<u8>);

impl Message {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    fn key(&mut self, field: u32, wire_type: u32) {
        varint(&mut self.0, u64::from((field << 3) | wire_type));
    }

    /// A varint field (int32, int64, enum); negative values take ten bytes, as protobuf says.
    pub fn int(&mut self, field: u32, value: i64) -> &mut Self {
        self.key(field, 0);
        varint(&mut self.0, value as u64);
        self
    }

    pub fn float(&mut self, field: u32, value: f32) -> &mut Self {
        self.key(field, 5);
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, field: u32, value: &[u8]) -> &mut Self {
        self.key(field, 2);
        varint(&mut self.0, value.len() as u64);
        self.0.extend_from_slice(value);
        self
    }

    pub fn string(&mut self, field: u32, value: &str) -> &mut Self {
        self.bytes(field, value.as_bytes())
    }

    pub fn message(&mut self, field: u32, value: Message) -> &mut Self {
        self.bytes(field, &value.0)
    }

    /// A packed repeated int64 field.
    pub fn packed_ints(&mut self, field: u32, values: &[i64]) -> &mut Self {
        let mut packed = Vec::new();
        for v in values {
            varint(&mut packed, *v as u64);
        }
        self.bytes(field, &packed)
    }
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// `TensorProto.DataType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    Float = 1,
    Int64 = 7,
    Bool = 9,
    Float16 = 10,
    BFloat16 = 16,
}

/// Field numbers of the messages used.
pub mod field {
    pub mod model {
        pub const IR_VERSION: u32 = 1;
        pub const PRODUCER_NAME: u32 = 2;
        pub const PRODUCER_VERSION: u32 = 3;
        pub const GRAPH: u32 = 7;
        pub const OPSET_IMPORT: u32 = 8;
    }
    pub mod opset {
        pub const DOMAIN: u32 = 1;
        pub const VERSION: u32 = 2;
    }
    pub mod graph {
        pub const NODE: u32 = 1;
        pub const NAME: u32 = 2;
        pub const INITIALIZER: u32 = 5;
        pub const INPUT: u32 = 11;
        pub const OUTPUT: u32 = 12;
    }
    pub mod node {
        pub const INPUT: u32 = 1;
        pub const OUTPUT: u32 = 2;
        pub const NAME: u32 = 3;
        pub const OP_TYPE: u32 = 4;
        pub const ATTRIBUTE: u32 = 5;
    }
    pub mod attribute {
        pub const NAME: u32 = 1;
        pub const F: u32 = 2;
        pub const I: u32 = 3;
        pub const INTS: u32 = 8;
        pub const TYPE: u32 = 20;
    }
    pub mod tensor {
        pub const DIMS: u32 = 1;
        pub const DATA_TYPE: u32 = 2;
        pub const NAME: u32 = 8;
        pub const RAW_DATA: u32 = 9;
        pub const EXTERNAL_DATA: u32 = 13;
        pub const DATA_LOCATION: u32 = 14;
    }
    pub mod string_entry {
        pub const KEY: u32 = 1;
        pub const VALUE: u32 = 2;
    }
    pub mod value_info {
        pub const NAME: u32 = 1;
        pub const TYPE: u32 = 2;
    }
    pub mod type_proto {
        pub const TENSOR_TYPE: u32 = 1;
        pub const ELEM_TYPE: u32 = 1;
        pub const SHAPE: u32 = 2;
        pub const DIM: u32 = 1;
        pub const DIM_VALUE: u32 = 1;
        pub const DIM_PARAM: u32 = 2;
    }
}

/// `AttributeProto.AttributeType`.
pub mod attribute_type {
    pub const FLOAT: i64 = 1;
    pub const INT: i64 = 2;
    pub const INTS: i64 = 7;
}

/// `TensorProto.DataLocation.EXTERNAL`.
pub const EXTERNAL: i64 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_keys_follow_the_wire_format() {
        let mut m = Message::new();
        m.int(1, 300).string(2, "ab").int(3, -1);
        let bytes = m.into_bytes();
        // field 1, varint: key 0x08, 300 = 0xac 0x02
        assert_eq!(&bytes[..3], &[0x08, 0xac, 0x02]);
        // field 2, length-delimited: key 0x12, length 2, "ab"
        assert_eq!(&bytes[3..7], &[0x12, 0x02, b'a', b'b']);
        // field 3, -1 as ten bytes of two's complement
        assert_eq!(bytes[7], 0x18);
        assert_eq!(bytes.len(), 8 + 10);
        assert_eq!(bytes[17], 0x01);
    }
}
