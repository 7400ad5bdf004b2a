"""Dense copies of packed weights for the batches the packed matmuls are slow at.

The packed kernels read a quantized weight once per call: for one activation row (decode at
batch 1) that is the whole point, since reading bytes is the cost. For many rows the cost is
the math instead, and the dequantizing tiles (or a dequantizing pass before torch's matmul)
spend most of a step turning codes into floats again and again: on the H200 a 64-sequence
decode step of an 8B Q4_K_M model spent 9 ms of 13.7 in the packed GEMM, and every prompt
chunk paid 6.3 ms to rewrite all weights as bf16 (BENCHMARKS.md, 2026-11-30 (c), (d)).

Where memory is plentiful a layer keeps, beside its planes, the dequantized weight in the
compute dtype (``QuantLinear.dense_copy``, bit-identical to ``unpack`` rounded to that dtype);
batches of more than ``dense_rows`` rows multiply by it through torch's matmul (cuBLAS), and
smaller ones keep reading the planes. The copy costs 2 bytes a weight (16 GB for an 8B model
in bf16), so it is made only when asked (``on``) or, with ``auto``, on a GPU whose free memory
after loading is at least four times the copies' size (an H200 with an 8B model: yes; a 24 GB
card: no). The KV cache is sized after this, from what is left.
"""

from __future__ import annotations

import torch

from shared.kernels.qmatmul.packed_dequant import dequantize_packed
from shared.model.linear import QuantLinear

__all__ = ["DENSE_MODES", "DENSE_ROWS", "add_dense_copies"]

DENSE_MODES = ("auto", "on", "off")
DENSE_ROWS = 16  # above this many rows a layer multiplies by its dense copy
_AUTO_SHARE = 0.25  # auto: the copies may take at most this share of the free memory


def _usable_free(device: torch.device) -> int:
    """The device's free bytes this process may still allocate: under a per-process cap (a
    pipeline stage's --memory-gib), what the cap leaves beyond what torch holds."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        free = min(free, int(fraction(device) * total) - torch.cuda.memory_reserved(device))
    return max(0, free)


def add_dense_copies(model: torch.nn.Module, mode: str, rows: int = DENSE_ROWS) -> int:
    """Give every packed layer of the model a dense copy per `mode` (auto / on / off); returns
    the bytes the copies take (0 when none were made)."""
    if mode not in DENSE_MODES:
        raise ValueError(f"dense copies: mode {mode!r} is not one of {', '.join(DENSE_MODES)}")
    layers = [
        m
        for m in model.modules()
        if isinstance(m, QuantLinear) and m.packed is not None and m.kernel_error is None
    ]
    if mode == "off" or not layers:
        return 0
    size = sum(m.shape[0] * m.shape[1] * m.compute_dtype.itemsize for m in layers)
    device = layers[0].packed.q.device
    if mode == "auto":
        if device.type != "cuda":
            return 0
        if size > _AUTO_SHARE * _usable_free(device):
            return 0
    for m in layers:
        m.dense_copy = dequantize_packed(m.packed, m.compute_dtype)
        m.dense_rows = rows
    return size
