"""Token embedding whose weights stay quantized on the device: only the looked-up rows are
dequantized."""

from __future__ import annotations

import torch
from torch import nn

from shared.kernels.qmatmul import pack
from shared.kernels.qmatmul.packed_dequant import dequantize_packed_rows
from shared.model.linear import packable
from shared.quant import dequantize


class QuantEmbedding(nn.Module):
    """Token embedding: only the looked-up rows are dequantized. With ``use_kernels`` a
    packed type keeps planes instead of the blocks, and a lookup is one launch
    (``dequantize_packed_rows``: the same values as ``dequantize``, bit for bit)."""

    def __init__(
        self,
        raw: torch.Tensor,
        qtype: int,
        shape: tuple[int, int],
        compute_dtype: torch.dtype,
        use_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.raw, self.qtype, self.shape, self.compute_dtype = raw, qtype, shape, compute_dtype
        self.packed = None
        if use_kernels and packable(qtype, shape):
            self.packed, self.raw = pack(raw, qtype, shape), None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return dequantize_packed_rows(self.packed, ids.reshape(-1), self.compute_dtype)
        rows = self.raw[ids]
        return dequantize(rows, self.qtype, (ids.numel(), self.shape[1])).to(self.compute_dtype)
