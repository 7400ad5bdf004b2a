"""A quantized weight multiplied on the CPU straight from its GGUF blocks (shared/cpu/qdot.c).

No copy of the weight is made: the rows are the file's bytes (mapped, or one concatenation
for fused projections), read once per step at decode, as llama.cpp reads them. The activations
are rounded to int8 per 32 elements with a float32 scale (llama.cpp's Q8 rounding; the
logit-fidelity tests bound what it changes); the weights' codes, scales and offsets are the
file's exactly.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K. The others (Q2_K, Q3_K, the float
types) keep torch's path."""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from shared.cpu.native import load

__all__ = ["NativeWeight", "RoundedActs", "native_supported"]

GROUP = 32


def native_supported(qtype: int, shape: tuple[int, int]) -> bool:
    """Whether the library is at hand here and takes a weight of this type and shape."""
    lib = load()
    if lib is None or not lib.skiff_supported(int(qtype)):
        return False
    return shape[1] % GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] == 0


class RoundedActs:
    """x [M, K] rounded to int8 per `block` elements (32; 256 for the K-quants, as llama.cpp's
    q8_K): codes, a float32 scale a block, the codes' sums per 16."""

    def __init__(self, x: torch.Tensor, block: int = GROUP) -> None:
        lib = load()
        m, k = x.shape
        xf = x.to(torch.float32).contiguous()
        self.shape = (m, k)
        self.block = block
        self.q = torch.empty((m, k), dtype=torch.int8)
        self.d = torch.empty((m, k // block), dtype=torch.float32)
        self.s = torch.empty((m, k // 16), dtype=torch.int32)
        lib.skiff_quantize_rows(
            xf.data_ptr(), m, k, block, self.q.data_ptr(), self.d.data_ptr(), self.s.data_ptr()
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [M, K]: the values the matmul multiplies (for tests)."""
        m, k = self.shape
        b = self.block
        return (self.q.float().view(m, k // b, b) * self.d[..., None]).view(m, k)


class NativeWeight:
    """The [N, K] weight's GGUF rows, multiplied by qdot.c."""

    def __init__(self, raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> None:
        n, k = shape
        self.qtype = int(qtype)
        self.shape = shape
        self.rows = raw.reshape(n, -1).contiguous()
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        if self.rows.shape[1] != k // block * size:
            raise ValueError(
                f"{n} rows of {self.rows.shape[1]} bytes are not {shape} of type {qtype}"
            )
        self._lib = load()
        self._row_bytes = self.rows.shape[1]
        self.act_block = self._lib.skiff_act_block(self.qtype)  # its activations' rounding

    def matmul(self, x: torch.Tensor | RoundedActs, simd: bool = True) -> torch.Tensor:
        """x [M, K] @ W.T: float32 [M, N]. x may be rounded already, per act_block (one
        rounding for the projections of one input). simd False: the portable C path (tests)."""
        n, k = self.shape
        if isinstance(x, RoundedActs):
            if x.block != self.act_block:
                raise ValueError(f"rounded per {x.block}; this type takes {self.act_block}")
            y = torch.empty((x.shape[0], n), dtype=torch.float32)
            self._lib.skiff_qmatmul(
                self.qtype, self.rows.data_ptr(), self._row_bytes, n, k, x.q.data_ptr(),
                x.d.data_ptr(), x.s.data_ptr(), x.shape[0], y.data_ptr(), n, int(simd),
            )  # fmt: skip
            return y
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = torch.empty((xf.shape[0], n), dtype=torch.float32)
        self._lib.skiff_matmul(
            self.qtype, self.rows.data_ptr(), self._row_bytes, n, k, xf.data_ptr(),
            xf.shape[0], y.data_ptr(), n, int(simd),
        )  # fmt: skip
        return y

    @property
    def nbytes(self) -> int:
        return self.rows.numel()
