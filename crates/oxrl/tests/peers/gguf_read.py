"""Reads a GGUF file that `oxrl export --format gguf` wrote with the `gguf` package (llama.cpp's
own reader) and prints what it holds: the metadata, and each tensor dequantized to f32 in
PyTorch's shape with its encoding.

argv: FILE. stdout: {"metadata": {...}, "tensors": {name: {"type", "shape", "values"}}}, the
values flattened row-major.
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main(path):
    reader = GGUFReader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    tensors = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        tensors[t.name] = {
            "type": t.tensor_type.name,
            "shape": [int(d) for d in reversed(t.shape)],
            "values": values.reshape(-1).tolist(),
        }
    json.dump({"metadata": metadata, "tensors": tensors}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
