"""The CPU's ops through the compiled library (shared/cpu/ops.c): one call each for the residual
add and RMSNorm, the gated activation, RoPE with the KV write, and attention, where torch's
references take several ops and allocations each (a decode step of SmolLM2 spent more time in
those than in its matmuls). float32 activations and a float32 or float16 cache; anything else
(an FP8 cache, another dtype) takes the torch reference it inherits.

Attention: every query row a row at a time in C, the same computation whatever the rows of its
step: a verified draft's rows give plain decoding's logits bit for bit, and a prompt's rows
give the same values however the prompt was chunked, cached or restored (a prefix-cache hit
then answers exactly as the first request did). Prompt chunks over long contexts pay for it:
no GEMM over the keys, as torch's fused attention has."""

from __future__ import annotations

import torch

from shared.cpu.native import load
from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.ops_backend import TorchOps

__all__ = ["NativeOps"]

_F32 = torch.float32
_CACHES = (torch.float32, torch.float16)


def _f32(*ts: torch.Tensor) -> bool:
    """All float32 (on the CPU: the ops are only chosen there)."""
    return all(t.dtype == _F32 for t in ts)


class NativeOps(TorchOps):
    name = "native"

    def __init__(self) -> None:
        self.lib = load()
        if self.lib is None:
            raise RuntimeError("the CPU library is not available here")
        # RoPE's angles per position unit, by (dim, base, factors' id): as rope_angles forms
        # them. The factors are kept beside them, so their id names them while cached
        self._inv_freq: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if not _f32(x, w) or not w.is_contiguous():
            return super().rms_norm(x, w, eps)
        x = x.contiguous()  # a strided view (QK-norm's heads of the fused projection): copied
        out = torch.empty_like(x)
        d = x.shape[-1]
        self.lib.skiff_add_rms_norm(
            x.data_ptr(), None, w.data_ptr(), eps, x.numel() // d, d, out.data_ptr(), None
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _f32(x, residual, w) or not (
            x.is_contiguous() and residual.is_contiguous() and w.is_contiguous()
        ):
            return super().add_rms_norm(x, residual, w, eps)
        out, total = torch.empty_like(x), torch.empty_like(x)
        d = x.shape[-1]
        self.lib.skiff_add_rms_norm(
            x.data_ptr(), residual.data_ptr(), w.data_ptr(), eps, x.numel() // d, d,
            out.data_ptr(), total.data_ptr(),
        )  # fmt: skip
        return out, total

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._gated(gate, up, 0) if self._rows(gate, up) else super().silu_mul(gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._gated(gate, up, 1) if self._rows(gate, up) else super().gelu_mul(gate, up)

    @staticmethod
    def _rows(gate: torch.Tensor, up: torch.Tensor) -> bool:
        """Both [rows, n] float32 with unit column stride and one row stride (halves of one
        product, or contiguous)."""
        return (
            _f32(gate, up)
            and gate.dim() == 2
            and gate.shape == up.shape
            and gate.stride(1) == up.stride(1) == 1
            and gate.stride(0) == up.stride(0)
        )

    def _gated(self, gate: torch.Tensor, up: torch.Tensor, gelu: int) -> torch.Tensor:
        rows, n = gate.shape
        out = torch.empty((rows, n), dtype=_F32)
        self.lib.skiff_gated_act(
            gate.data_ptr(), up.data_ptr(), gate.stride(0), rows, n, gelu, out.data_ptr()
        )
        return out

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        kv: KVPool,
        layer: int,
        rope: tuple[int, float, float, torch.Tensor | None],
        neox: bool,
        scale: float,
        sliding_window: int,
        int8_layout: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, dict]:
        kc, vc = kv.k[layer], kv.v[layer]
        if not (_f32(q, k, v) and kc.dtype in _CACHES and kc.dtype == vc.dtype):
            return super().attention(
                q, k, v, batch, kv, layer, rope, neox, scale, sliding_window, int8_layout
            )
        t, hq, d = q.shape
        hk = k.shape[1]
        # q and k rotated in place: copies of them (contiguous, as the library reads them)
        q = q.clone(memory_format=torch.contiguous_format)
        k = k.clone(memory_format=torch.contiguous_format)
        v = v.contiguous()
        dim, base, rope_scale, factors = rope
        half = int(kc.dtype == torch.float16)
        positions, slots = batch.positions.contiguous(), batch.slot_mapping.contiguous()
        self.lib.skiff_rope_kv(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), positions.data_ptr(), t, hq, hk, d, dim,
            self._angles(dim, base, factors).data_ptr(), rope_scale, int(neox), kc.data_ptr(),
            vc.data_ptr(), slots.data_ptr(), half,
        )  # fmt: skip
        out = torch.empty_like(q)
        tables = batch.block_tables.contiguous()
        self.lib.skiff_attention(
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), half, tables.data_ptr(), tables.shape[1],
            batch.query_start_loc_t.contiguous().data_ptr(),
            batch.seq_lens_t.contiguous().data_ptr(),
            len(batch.seq_lens), hq, hk, d, kc.shape[1], scale, sliding_window, out.data_ptr(),
        )  # fmt: skip
        return out, {}

    def _angles(self, dim: int, base: float, factors: torch.Tensor | None) -> torch.Tensor:
        key = (dim, base, id(factors))
        if key not in self._inv_freq:
            exponents = torch.arange(0, dim, 2, dtype=_F32)
            inv_freq = 1.0 / (base ** (exponents / dim))
            if factors is not None:
                inv_freq = inv_freq / factors.float()
            self._inv_freq[key] = (inv_freq.contiguous(), factors)
        return self._inv_freq[key][0]
