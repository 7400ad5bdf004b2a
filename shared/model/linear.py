"""Linear and embedding layers whose weights stay in their GGUF block format on the device.

The matmul dequantizes with the torch reference (bit-exact with gguf.quants) on every call;
quantized Triton kernels replace that per type. `cache_dequantized` keeps a dequantized copy
instead, which makes the CPU reference path fast enough to generate with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.quant import dequantize

FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16


class QuantLinear(nn.Module):
    def __init__(
        self,
        raw: torch.Tensor,  # [out, row_bytes] uint8: the GGUF bytes of each row
        qtype: int,
        shape: tuple[int, int],  # (out_features, in_features)
        compute_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        cache_dequantized: bool = False,
    ) -> None:
        super().__init__()
        self.qtype = qtype
        self.shape = shape
        self.compute_dtype = compute_dtype
        self.bias = bias
        self.raw = raw
        self._dense: torch.Tensor | None = None
        if qtype in FLOAT_TYPES or cache_dequantized:
            self._dense = self._dequantize()
            if qtype in FLOAT_TYPES:
                self.raw = None  # the dense copy is the same values; keep one

    def _dequantize(self) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape).to(self.compute_dtype)

    def weight(self) -> torch.Tensor:
        return self._dense if self._dense is not None else self._dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.bias)


class QuantEmbedding(nn.Module):
    """Token embedding: only the looked-up rows are dequantized."""

    def __init__(
        self, raw: torch.Tensor, qtype: int, shape: tuple[int, int], compute_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.raw, self.qtype, self.shape, self.compute_dtype = raw, qtype, shape, compute_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw[ids]
        return dequantize(rows, self.qtype, (ids.numel(), self.shape[1])).to(self.compute_dtype)
