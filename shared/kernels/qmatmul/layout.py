"""The packed layout's facts, which every quantized-matmul kernel reads and none defines: the
types that repack, the elements of a chunk along K and the int32 words it packs into, the rows
an interleaved tile holds, and the packed weight itself (its planes are described in
``packed``, the interleaving in ``packed_rows``). Kernels import this module; it imports no
kernel."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType

__all__ = ["CHUNK", "INT8_TYPES", "PACKED_TYPES", "ROWS", "ROWS_TYPES", "WORDS", "PackedWeight"]

_T = GGMLQuantizationType
TWO_BIT = (_T.Q2_K, _T.Q3_K)
LEGACY = (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1)  # 4/5-bit blocks of 32 (shared.quant.legacy)
PACKED_TYPES: frozenset[int] = frozenset({*LEGACY, _T.Q8_0, *TWO_BIT, _T.Q4_K, _T.Q5_K, _T.Q6_K})
# the types whose codes multiply int8 activations on dp4a (packed_int8, packed_int8_rows)
INT8_TYPES: frozenset[int] = frozenset(
    {_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K}
)
# elements per chunk along K: every K must be a multiple of it
CHUNK = {t: 128 if t in (_T.Q6_K, _T.Q8_0) else 256 for t in PACKED_TYPES}
# int32 words per chunk (the kernels' tile width)
WORDS = {t: 16 if t in (_T.Q6_K, *TWO_BIT) else 32 for t in PACKED_TYPES}
ROWS = 32  # rows an interleaved tile holds (packed_rows)
ROWS_TYPES = INT8_TYPES  # the types the rows GEMV (packed_int8_rows) multiplies


@dataclass(frozen=True)
class PackedWeight:
    qtype: int
    shape: tuple[int, int]  # (N, K)
    q: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    # planes row-interleaved in tiles of ROWS rows (packed_rows)
    rows32: bool = False
    # split-K tickets of the GEMVs (split_tickets): one int32 counter a row, zero between launches
    tickets: torch.Tensor = field(init=False, repr=False, compare=False)
    # the batch rows GEMV's one-wave K split by launch form (packed_int8_rows_batch), found at a
    # form's first launch from the compiled kernel's registers
    wave_splits: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counters = torch.zeros(self.shape[0], dtype=torch.int32, device=self.q.device)
        object.__setattr__(self, "tickets", counters)
        object.__setattr__(self, "wave_splits", {})

    @property
    def nbytes(self) -> int:
        planes = (self.q, self.d, self.sc, self.mn, self.dmin, self.hi)
        return sum(t.numel() * t.element_size() for t in planes if t is not None)
