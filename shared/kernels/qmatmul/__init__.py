"""Quantized matmul kernels: packed-layout GEMV/GEMM (Q4_K, Q6_K, Q8_0) and GEMVs that read GGUF
blocks in place (the other types)."""

from shared.kernels.qmatmul.kquants import KQUANT_TYPES, quant_gemv_kquant
from shared.kernels.qmatmul.legacy import LEGACY_TYPES, quant_gemv_legacy
from shared.kernels.qmatmul.packed import PACKED_TYPES, PackedWeight, pack, unpack
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
