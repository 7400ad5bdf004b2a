"""Quantized matmul kernels that read GGUF blocks in place (weights never dequantized to memory)."""

from shared.kernels.qmatmul.kquants import KQUANT_TYPES, quant_gemv_kquant
from shared.kernels.qmatmul.legacy import LEGACY_TYPES, quant_gemv_legacy

__all__ = ["KQUANT_TYPES", "quant_gemv_kquant", "LEGACY_TYPES", "quant_gemv_legacy"]
