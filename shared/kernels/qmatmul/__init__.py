"""Quantized matmul kernels: packed-layout GEMV/GEMM for every GGUF quant type (Q4_0..Q8_0,
Q2_K..Q6_K) and GEMVs that read GGUF blocks in place (for K that the packed chunks do not
divide)."""

from shared.kernels.qmatmul.kquants import KQUANT_TYPES, quant_gemv_kquant
from shared.kernels.qmatmul.layout import PACKED_TYPES, PackedWeight
from shared.kernels.qmatmul.legacy import LEGACY_TYPES, quant_gemv_legacy
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import packed_matmul

__all__ = [
    "KQUANT_TYPES",
    "LEGACY_TYPES",
    "PACKED_TYPES",
    "PackedWeight",
    "pack",
    "packed_matmul",
    "quant_gemv_kquant",
    "quant_gemv_legacy",
    "unpack",
]
