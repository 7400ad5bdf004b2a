"""Which implementation the model's ops run on a device: the torch references (CPU, and the
oracle in tests) or the Triton kernels (GPU). Both take the same arguments, so the model code
does not know which one it calls.
"""

from __future__ import annotations

import torch

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.ops import activation, fused_norm, norm
from shared.ops.paged_attention import paged_attention_ref, write_kv
from shared.ops.paged_attention_fp8 import paged_attention_fp8_ref, write_kv_fp8
from shared.ops.rope import apply_rope, rope_angles


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
        return fused_norm.add_rms_norm_ref(x, residual, w, eps)

    def add_rms_norm_int8(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        w: torch.Tensor,
        eps: float,
        layouts: tuple[tuple[int, int], ...],
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(normed, residual, x's int8 roundings by layout): add_rms_norm, or rms_norm with x
        as the residual when residual is None. The references round nothing ahead (empty)."""
        if residual is None:
            return self.rms_norm(x, w, eps), x, {}
        return *self.add_rms_norm(x, residual, w, eps), {}

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return activation.silu_mul(gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return activation.gelu_mul(gate, up)

    def qkv_rope(
        self,
        n_tokens: int,
        batch: ForwardBatch,
        kv: KVPool,
        layer: int,
        rope: tuple[int, float, float, torch.Tensor | None],
        neox: bool,
        n_heads: int,
    ) -> object | None:
        """Where the Q/K/V GEMV's epilogue may rotate q and k and write k and v to the cache
        (``qkv_rope.QKVRope``), then passed to attention as k = v = None; None when the ops
        keep RoPE and the write in attention (the references always do)."""
        return None

    def attention(
        self,
        q: torch.Tensor,  # [T, n_heads, head_dim]
        k: torch.Tensor,  # [T, n_kv_heads, head_dim]
        v: torch.Tensor,  # [T, n_kv_heads, head_dim]
        batch: ForwardBatch,
        kv: KVPool,
        layer: int,
        rope: tuple[int, float, float, torch.Tensor | None],  # dim, base, scale, freq factors
        neox: bool,
        scale: float,
        sliding_window: int,
        int8_layout: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """(the attention output, its int8 rounding in int8_layout for the output projection's
        GEMV when made in the same launches: {(W, G): (xq, xd, xs)}, else {}). The references
        round nothing ahead."""
        return self._attention_ref(q, k, v, batch, kv, layer, rope, neox, scale, sliding_window), {}

    def _attention_ref(self, q, k, v, batch, kv, layer, rope, neox, scale, sliding_window):
        key = (rope[0], rope[1], rope[2], id(rope[3]))
        if key not in batch.rope_tables:
            batch.rope_tables[key] = rope_angles(batch.positions, *rope)
        cos, sin = batch.rope_tables[key]
        q = apply_rope(q, cos, sin, neox)
        k = apply_rope(k, cos, sin, neox)
        kc, vc = kv.k[layer], kv.v[layer]
        if kv.fp8:
            ks, vs = kv.k_scale[layer], kv.v_scale[layer]
            write_kv_fp8(kc, vc, ks, vs, k, v, batch.slot_mapping)
            return paged_attention_fp8_ref(
                q,
                kc,
                vc,
                ks,
                vs,
                batch.block_tables,
                batch.query_start_loc,
                batch.seq_lens,
                scale,
                sliding_window,
            )
        write_kv(kc, vc, k, v, batch.slot_mapping)
        return paged_attention_ref(
            q,
            kc,
            vc,
            batch.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            scale,
            sliding_window,
        )


class TritonOps(TorchOps):
    name = "triton"

    def __init__(self) -> None:
        from shared.kernels import activation as act_k
        from shared.kernels import norm as norm_k
        from shared.kernels import paged_attention as attn_k
        from shared.kernels.device import num_sms
        from shared.kernels.qmatmul.qkv_rope import QKVRope
        from shared.kernels.rope_kv import rope_and_write_kv

        self._norm, self._act, self._attn_k = norm_k, act_k, attn_k
        self._attn, self._rope_kv = attn_k.paged_attention, rope_and_write_kv
        self._qkv_rope = QKVRope
        self._num_sms = num_sms

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        return self._norm.add_rms_norm(x, residual, w, eps)

    def add_rms_norm_int8(self, x, residual, w, eps, layouts):
        """One launch: the norm and, for one row, its int8 roundings for the layouts (the
        GEMVs then skip their own rounding launch)."""
        ahead = layouts[:2]  # a third rounds in its own launch
        return self._norm.add_rms_norm_int8(x, residual, w, eps, ahead)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._act.silu_mul_separate(gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._act.gelu_mul_separate(gate, up)

    def qkv_rope(self, n_tokens, batch, kv, layer, rope, neox, n_heads):
        """One token (the rows GEMV's), the "norm" layout and a 16- or 32-bit cache: the GEMV's
        epilogue does RoPE and the KV write (``qkv_rope``), where the model's Q/K/V allow it."""
        if n_tokens != 1 or neox or kv.fp8:
            return None
        dim, base, rope_scale, factors = rope
        return self._qkv_rope(
            batch.positions, batch.slot_mapping, kv.k[layer], kv.v[layer], n_heads, dim, base,
            rope_scale, factors,
        )  # fmt: skip

    def attention(
        self, q, k, v, batch, kv, layer, rope, neox, scale, sliding_window, int8_layout=None
    ):
        """k and v None: q came rotated and k and v were written by the Q/K/V GEMV (qkv_rope)."""
        dim, base, rope_scale, factors = rope
        kc, vc = kv.k[layer], kv.v[layer]
        ks = kv.k_scale[layer] if kv.fp8 else None
        vs = kv.v_scale[layer] if kv.fp8 else None
        if k is not None:
            q = self._rope_kv(
                q,
                k,
                v,
                batch.positions,
                kc,
                vc,
                batch.slot_mapping,
                dim,
                base,
                neox,
                rope_scale,
                factors,
                ks,
                vs,
            )
        out = self._attn(
            q,
            kc,
            vc,
            batch.block_tables,
            batch.query_start_loc_t,
            batch.seq_lens_t,
            scale,
            sliding_window,
            max_query_len=batch.max_query_len,
            k_scale=ks,
            v_scale=vs,
            max_seq_len=batch.max_seq_len,
            int8_layout=int8_layout,
            **self._splits(q, kc.shape[2], batch, sliding_window),
        )
        return out if int8_layout is not None else (out, {})  # (out, rounded) with a layout

    def _splits(
        self, q: torch.Tensor, n_kv_heads: int, batch: ForwardBatch, sliding_window: int
    ) -> dict:
        """Split-K arguments. Decode steps: a CUDA graph's own count (cuda_graphs'
        decode_graphs), else the kernel's rule at the batch's longest context; so do
        windowed layers, whose window bounds the keys. Steps with prompt chunks: a CUDA
        graph's device-held count, or one from the batch's lengths."""
        if batch.max_query_len <= 1:
            return (
                {"num_splits": batch.attn_splits}
                if batch.attn_splits and not sliding_window
                else {}
            )
        if 0 < sliding_window < self._attn_k.CHUNK_SPLIT_MIN_CONTEXT:
            return {}
        if batch.attn_splits_t is not None:
            return {"num_splits": batch.max_attn_splits, "num_splits_t": batch.attn_splits_t}
        if not batch.attn_splits:
            batch.attn_splits = self._attn_k.chunk_num_splits(
                batch.query_lens,
                batch.seq_lens,
                q.shape[1],
                n_kv_heads,
                q.shape[2],
                self._num_sms(q.device),
                self._attn_k.chunk_split_limit(q.shape[0]),
            )
        return {"num_splits": batch.attn_splits}
