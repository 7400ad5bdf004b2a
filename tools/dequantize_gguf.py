"""Writes an all-F32 copy of a GGUF file, dequantized with Skiff's dequantizer.

llama.cpp quantizes activations to 8 bits in its matmuls with quantized weights; on an F32 copy
it does not, so comparing Skiff on the quantized file with llama.cpp on this copy checks that the
two compute the same graph on the same weights, free of that noise.
Usage: python -m tools.dequantize_gguf SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from shared.loader import GGUFFile
from shared.quant import dequantize
from tools.synthetic_gguf import part_path


def dequantize_gguf(src: str | Path, dst: str | Path) -> Path:
    f = GGUFFile(src)
    reader = GGUFReader(src)
    tmp = str(part_path(dst))
    w = GGUFWriter(tmp, f.architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_uint32(key, 0)  # ALL_F32
        elif field.types[0] == GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    for name, info in f.tensors.items():
        raw = torch.from_numpy(np.array(f.raw(name)))
        w.add_tensor(name, dequantize(raw, info.qtype, info.shape).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(tmp).replace(dst)
    return Path(dst)


if __name__ == "__main__":
    dequantize_gguf(sys.argv[1], sys.argv[2])
