"""Linear layers whose weights stay quantized on the device (the embedding: embedding.py).

Three ways to multiply, chosen once at load time:

- dense: float weights (F32/F16/BF16), or ``cache_dequantized`` (the CPU reference path keeps a
  dequantized copy, which makes it fast enough to generate with);
- packed kernels (``use_kernels``, every quantized type when K is a multiple of the type's
  chunk, 128 or 256): the GGUF blocks are repacked into the kernels' plane layout
  (``shared.kernels.qmatmul.packed``, bit-identical when dequantized) and the raw blocks are
  dropped; a kernel that fails to build on the device falls back to dequantizing the planes.
  A layer may also keep a dense copy beside its planes (``dense_copy``, made by
  ``shared.model.dense_copies`` where memory allows): batches of more than ``dense_rows`` rows
  then multiply by it (torch's matmul) and smaller ones read the packed planes;
- otherwise the GGUF blocks stay: with ``use_kernels``, decode-sized batches (M <= 64) of
  Q4_0..Q8_0 / Q4_K..Q6_K run the in-place GEMVs and the rest dequantize (torch, bit-exact) and
  matmul; without, every call dequantizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from shared.kernels.device import interpreted
from shared.kernels.qmatmul import (
    KQUANT_TYPES,
    LEGACY_TYPES,
    PACKED_TYPES,
    pack,
    packed_matmul,
    quant_gemv_kquant,
    quant_gemv_legacy,
    unpack,
)
from shared.kernels.qmatmul.int8_activations import int8_buffers_for, int8_layout
from shared.kernels.qmatmul.layout import CHUNK
from shared.kernels.qmatmul.norm_ahead import folds, norm_buffers
from shared.kernels.qmatmul.packed_int8_pair import (
    gemv_int8_pair_kernel,
    pair_splits,
    rows_gemv_pair,
)
from shared.kernels.qmatmul.packed_matmul import (
    ACTS,
    config_for,
    default_config,
    rounds_gated,
    rows_plan,
)
from shared.kernels.qmatmul.packed_rows import interleave, wants_rows
from shared.kernels.qmatmul.qkv_rope import QKVRope
from shared.kernels.qmatmul.tuning import Tuner
from shared.model.int4_linear import Int4Weight, int4_supported
from shared.model.native_linear import NativeWeight, native_supported
from shared.model.rows_exact import rows_exact
from shared.quant import dequantize

FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16
_GEMV_MAX_M = 64
# batch 1: RoPE and the KV-cache write in the Q/K/V GEMV's epilogue (SplitLinear.forward_rope),
# except where q's weight is of these types: on the H200 W1 gained 1.6 % (Q4_K_M) and 2.1 %
# (Q8_0) but Q6_K lost 1.1-1.9 % (its 6144-row launch; BENCHMARKS.md (aj), not explained)
QKV_ROPE_SKIP_TYPES = (GGMLQuantizationType.Q6_K,)
# decode batches of up to this many rows have their activations rounded to int8 ahead, by the
# RMSNorm before the GEMVs (norm.add_rms_norm_int8), where the batch rows GEMV multiplies them
# (packed_int8_rows_batch, 2-4 rows), as batch 1's rows GEMV has had since (w). Q4_K_M's W1 at
# batches 2/3/4 gained 1.6/1.2/1.3 % on the H200 against batch 1 only (BENCHMARKS.md (ai))
ROUND_AHEAD_ROWS = 4


def packable(qtype: int, shape: tuple[int, int]) -> bool:
    """Whether a weight of this type and shape can be repacked into the kernels' planes."""
    return qtype in PACKED_TYPES and shape[1] % CHUNK[qtype] == 0


class QuantLinear(nn.Module):
    def __init__(
        self,
        raw: torch.Tensor,  # [out, row_bytes] uint8: the GGUF bytes of each row
        qtype: int,
        shape: tuple[int, int],  # (out_features, in_features)
        compute_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        cache_dequantized: bool = False,
        use_kernels: bool = False,
        tuner: Tuner | None = None,
        cpu_weights: str = "float",
    ) -> None:
        super().__init__()
        self.qtype = qtype
        self.shape = shape
        self.compute_dtype = compute_dtype
        self.bias = bias
        self.raw = raw
        self.packed = None
        self._gemv = None
        self.tuner = tuner
        self.kernel_error: str | None = None  # set when the packed kernels fail to build here
        self.gated_act = 0  # > 0: rows are gate/up pairs, multiplied by GatedLinear
        # the weight in compute_dtype: the only copy (float types, cache_dequantized), or one
        # kept beside the packed planes for batches of more than dense_rows rows
        self.dense_copy: torch.Tensor | None = None
        self.dense_rows = 0
        # the CPU's: GGUF blocks for the C library (native_linear) or int4 planes (int4_linear)
        self.native: NativeWeight | None = None
        self.int4: Int4Weight | None = None
        cpu = raw.device.type == "cpu" and cpu_weights != "float"
        if cpu and cpu_weights == "native" and native_supported(qtype, shape):
            self.native = NativeWeight(raw, qtype, shape)
            self.raw = self.native.rows
        elif cpu and int4_supported(qtype, shape):
            self.int4 = Int4Weight(raw, qtype, shape)
            self.raw = None
        elif cpu and qtype not in FLOAT_TYPES:
            # the types neither takes (Q2_K, Q3_K; ragged shapes): a bf16 copy
            self.dense_copy = self._dequantize().to(torch.bfloat16)
        elif qtype in FLOAT_TYPES or cache_dequantized:
            self.dense_copy = self._dequantize()
            if qtype in FLOAT_TYPES:
                self.raw = None  # the dense copy is the same values; keep one
        elif use_kernels and packable(qtype, shape):
            self.packed = pack(raw, qtype, shape)
            if self.packed.q.is_cuda and wants_rows(qtype):  # batch 1 on the rows GEMV
                self.packed = interleave(self.packed)
            self.raw = None
        elif use_kernels and qtype in LEGACY_TYPES:
            self._gemv = quant_gemv_legacy
        elif use_kernels and qtype in KQUANT_TYPES:
            self._gemv = quant_gemv_kquant

    def _dequantize(self) -> torch.Tensor:
        if self.int4 is not None:
            return self.int4.dequantize().to(self.compute_dtype)
        if self.packed is not None:
            return unpack(self.packed).to(self.compute_dtype)
        return dequantize(self.raw, self.qtype, self.shape).to(self.compute_dtype)

    def weight(self) -> torch.Tensor:
        return self.dense_copy if self.dense_copy is not None else self._dequantize()

    def kernel_builds(self) -> bool:
        """Run the packed kernels once (one row and a few); on a device where they fail to
        build, fall back for good to dequantizing the packed planes in torch (bit-exact, slow)."""
        if self.packed is None:
            return True
        try:
            for m in (1, 4):
                x = torch.zeros(
                    m, self.shape[1], dtype=self.compute_dtype, device=self.packed.q.device
                )
                packed_matmul(x, self.packed, act=self.gated_act)
        except Exception as exc:  # noqa: BLE001 - any compiler or launch failure
            self.kernel_error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            return False
        return True

    def matmul_args(self, x2: torch.Tensor) -> dict:
        """packed_matmul's config (and dense copy) for the activation rows x2."""
        m = x2.shape[0]
        if self.dense_copy is not None and m > self.dense_rows:
            return {"config": {"DEQUANT": 1}, "dense": self.dense_copy}
        return {"config": self.tuner.config(self.packed, m, x2.dtype) if self.tuner else None}

    def int8_layout(self, m: int) -> tuple[int, int] | None:
        """The (W, G) layout a call of m rows rounds its activations to for the rows GEMV
        (``packed_int8_rows``), when it runs that: one row over interleaved planes, with a
        config that does not round in the GEMV itself (QX); or, for 2 .. ROUND_AHEAD_ROWS
        rows, the batch rows GEMV's (a ``ROWS`` config). The caller may round them ahead
        (``norm.add_rms_norm_int8``) and pass them to forward. Else None."""
        pw = self.packed
        if m < 1 or m > ROUND_AHEAD_ROWS or pw is None or not pw.rows32:
            return None
        if self.kernel_error is not None or (self.dense_copy is not None and m > self.dense_rows):
            return None
        tuned = self.tuner.config(pw, m, self.compute_dtype) if self.tuner is not None else None
        if m == 1:
            return None if tuned and tuned.get("QX") else int8_layout(pw)
        cfg = tuned or config_for(pw, m, self.compute_dtype)
        return int8_layout(pw) if cfg.get("ROWS") else None

    def forward_norm(
        self,
        x: torch.Tensor,
        rounded: dict | None,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        layouts: tuple[tuple[int, int], ...],
    ) -> tuple[torch.Tensor, torch.Tensor, dict] | None:
        """forward for one row, with the residual add and RMSNorm after it in the rows GEMV's
        epilogue (``norm_ahead``), for GEMVs that read only its rounding in `layouts`:
        (out, out + residual, {layout: (xq, xd, xs, sums, eps)}: the rounding of
        ``(out + residual) * weight``, awaiting the norm's scale). None where it cannot be
        (nothing ran): not one row of interleaved planes, a bias, a failed build, or layouts
        the epilogue cannot round (``norm_ahead.folds``)."""
        pw = self.packed
        if (
            pw is None
            or not pw.rows32
            or self.int8_layout(1) is None
            or self.bias is not None
            or x.numel() != self.shape[1]
            or residual.shape != (1, self.shape[0])
            or not folds(self.shape[0], layouts)
        ):
            return None
        x2 = x.reshape(1, -1)
        norm_out, made = norm_buffers(residual, weight, eps, layouts)
        int8 = rounded.get(int8_layout(pw)) if rounded else None
        y = packed_matmul(x2, pw, **self.matmul_args(x2), int8=int8, norm_out=norm_out)
        return y.reshape(*x.shape[:-1], self.shape[0]), norm_out.new_residual, made

    def forward(
        self, x: torch.Tensor, rounded: dict | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ W.T (+ bias); rounded: x's int8 roundings by layout (int8_layout), if made.
        out: x's rows of the result are stored there, in its dtype (the rows GEMV stores
        them itself, with no rounding to x's dtype between; else a copy), and out returned."""
        pw = self.packed
        if out is not None and not (
            pw is not None and pw.rows32 and x.numel() == self.shape[1] and self.bias is None
            and self.kernel_error is None
        ):  # fmt: skip
            return out.copy_(self(x, rounded).reshape(out.shape))
        if self.kernel_error is not None:
            return F.linear(x, self.weight(), self.bias)
        if self.native is not None:
            y = self.native.matmul(x.reshape(-1, self.shape[1])).to(x.dtype)
        elif self.int4 is not None:
            y = self.int4.matmul(x.reshape(-1, self.shape[1]))
        elif pw is not None:
            x2 = x.reshape(-1, self.shape[1])
            int8 = rounded.get(int8_layout(pw)) if rounded else None
            into = out.view(1, -1) if out is not None else None
            y = packed_matmul(x2, pw, **self.matmul_args(x2), int8=int8, out=into)
            if out is not None:
                return out
        elif self._gemv is not None and x.numel() <= _GEMV_MAX_M * self.shape[1]:
            y = self._gemv(x.reshape(-1, self.shape[1]), self.raw, self.qtype)
        elif self.dense_copy is not None and self.dense_copy.dtype != x.dtype:  # a bf16 copy
            y = rows_exact(x.to(self.dense_copy.dtype), self.dense_copy).to(x.dtype)
        elif x.device.type == "cpu":
            y = rows_exact(x, self.weight())
        else:
            return F.linear(x, self.weight(), self.bias)
        y = y.reshape(*x.shape[:-1], self.shape[0])
        return y if self.bias is None else y + self.bias


class SplitLinear(nn.Module):
    """Several projections of the same input (Q/K/V; gate/up), returned in order as views of
    their parts' outputs. A part multiplies one projection or a run of consecutive ones whose
    rows were concatenated at load time (``WeightLoader.split_linear``: one part for Q/K/V of
    one type, two for Llama-3 Q4_K_M's Q4_K q and k beside a Q6_K v)."""

    def __init__(self, parts: list[QuantLinear], sizes: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.runs: list[list[int]] = []  # the sizes each part's output splits into
        i = 0
        for part in parts:
            j, rows = i, 0
            while rows < part.shape[0] and j < len(sizes):
                rows, j = rows + sizes[j], j + 1
            if rows != part.shape[0]:
                raise ValueError(
                    f"SplitLinear: a part of {part.shape[0]} rows is not a run of {sizes}"
                )
            self.runs.append(sizes[i:j])
            i = j
        if i != len(sizes):
            raise ValueError(
                f"SplitLinear: parts of {[p.shape[0] for p in parts]} rows for {sizes}"
            )

    def int8_layouts(self, m: int) -> tuple[tuple[int, int], ...]:
        """The layouts a call of m rows rounds its activations to (QuantLinear.int8_layout)."""
        return tuple(sorted({lay for p in self.parts if (lay := p.int8_layout(m)) is not None}))

    def reads_rounded(self, m: int) -> bool:
        """Whether a call of m rows reads only x's int8 roundings (every part the rows GEMV at
        one row), not x: then x may be a stand-in (``norm_ahead``)."""
        return m == 1 and all(p.int8_layout(1) is not None for p in self.parts)

    def forward(self, x: torch.Tensor, rounded: dict | None = None) -> tuple[torch.Tensor, ...]:
        ys = self._paired(x, rounded) or [part(x, rounded) for part in self.parts]
        out: list[torch.Tensor] = []
        for y, run in zip(ys, self.runs, strict=True):
            out.extend(torch.split(y, run, dim=-1) if len(run) > 1 else (y,))
        return tuple(out)

    def forward_rope(
        self, x: torch.Tensor, rounded: dict | None, rope: QKVRope
    ) -> torch.Tensor | None:
        """Q/K/V of one token whose GEMVs' epilogue rotates q and k and writes k and v to
        rope's caches (``qkv_rope``): q rotated ([1, q_dim], a view), or None where that
        cannot be (then nothing ran: forward, and RoPE apart): parts other than the rows GEMV
        or with a bias, rows that are not q/k/v, outputs or caches the epilogue refuses."""
        x2 = x.reshape(-1, self.parts[0].shape[1])
        rows = [p.shape[0] for p in self.parts]
        if (
            x2.shape[0] != 1
            or self.parts[0].qtype in QKV_ROPE_SKIP_TYPES
            or rope.refusal(x.dtype) is not None
            or sum(rows) != rope.q_dim + 2 * rope.kv_dim
            or rows[0] < rope.q_dim
            or any(
                p.packed is None or not p.packed.rows32 or p.kernel_error is not None
                or p.bias is not None
                for p in self.parts
            )
        ):  # fmt: skip
            return None
        ys = self._paired(x, rounded, rope)
        if ys is None:
            row0, ys = 0, []
            for p in self.parts:
                int8 = rounded.get(int8_layout(p.packed)) if rounded else None
                ys.append(packed_matmul(x2, p.packed, **p.matmul_args(x2), int8=int8,
                                        rope=(rope, row0)))  # fmt: skip
                row0 += p.shape[0]
        return ys[0].reshape(1, -1)[:, : rope.q_dim]

    def _paired(
        self, x: torch.Tensor, rounded: dict | None, rope: QKVRope | None = None
    ) -> list[torch.Tensor] | None:
        """Two parts of different types (Q4_K_M's q/k and v) multiplied in one launch at batch
        1 (``packed_int8_pair``), when both run the rows GEMV on x rounded ahead for their
        layouts; None otherwise (one launch a part). rope: as forward_rope's (no biases)."""
        if len(self.parts) != 2 or not rounded:
            return None
        a, b = self.parts
        x2 = x.reshape(-1, a.shape[1])
        if x2.shape[0] != 1:  # rounded ahead for the batch rows GEMV: one launch a part
            return None
        layouts = (a.int8_layout(1), b.int8_layout(1))
        if any(lay is None or lay not in rounded for lay in layouts):
            return None
        cfg = a.matmul_args(x2)["config"] or default_config(
            1, a.shape[0], a.shape[1], x.device, a.packed.qtype, dtype=x.dtype
        )
        cfg, splits = rows_plan(a.packed, cfg, pair=b.packed)
        splits = pair_splits(a.packed, b.packed, splits)
        if splits is None:
            return None
        ys = rows_gemv_pair(x2, a.packed, b.packed, rounded[layouts[0]], rounded[layouts[1]],
                            cfg, splits, interpreted(gemv_int8_pair_kernel),
                            (rope, 0) if rope is not None else None)  # fmt: skip
        return [
            (y if lin.bias is None else y + lin.bias).reshape(*x.shape[:-1], lin.shape[0])
            for y, lin in zip(ys, (a, b), strict=True)
        ]


class GatedLinear(nn.Module):
    """``act(x @ gate.T) * (x @ up.T)`` as one packed matmul: the gate and up rows interleaved at
    load time (row 2i the gate of output i, 2i + 1 its up) and the activation applied to the
    float32 accumulators in the kernel's epilogue (``packed_matmul(..., act=)``), so neither the
    [T, 2F] product nor a separate activation launch remains. act: 1 SiLU, 2 GELU (tanh)."""

    def __init__(self, fused: QuantLinear, act: int) -> None:
        super().__init__()
        self.fused = fused
        self.act = act
        fused.gated_act = act

    def int8_layouts(self, m: int) -> tuple[tuple[int, int], ...]:
        layout = self.fused.int8_layout(m)
        return () if layout is None else (layout,)

    def reads_rounded(self, m: int) -> bool:
        """As SplitLinear.reads_rounded."""
        return m == 1 and self.fused.int8_layout(1) is not None

    def forward(self, x: torch.Tensor, rounded: dict | None = None) -> torch.Tensor:
        return self.forward_int8(x, rounded, None)[0]

    def forward_int8(
        self, x: torch.Tensor, rounded: dict | None, out_layout: tuple[int, int] | None
    ) -> tuple[torch.Tensor, dict]:
        """(act(gate) * up, its int8 rounding in out_layout when the rows GEMV made it in the
        same launch, for the next layer's GEMV: {(W, G): (xq, xd, xs)}, else {})."""
        lin = self.fused
        if lin.packed is not None and lin.kernel_error is None:
            x2 = x.reshape(-1, lin.shape[1])
            int8 = rounded.get(int8_layout(lin.packed)) if rounded else None
            n_out = lin.shape[0] // 2
            out_int8, made = None, {}
            rows_gemv = x2.shape[0] == 1 and lin.packed.rows32
            if out_layout and rows_gemv and rounds_gated(n_out, *out_layout):
                made = {out_layout: int8_buffers_for(n_out, *out_layout, x.device)}
                out_int8 = (*made[out_layout], *out_layout)
            y = packed_matmul(
                x2, lin.packed, act=self.act, **lin.matmul_args(x2), int8=int8, out_int8=out_int8
            )
            return y.reshape(*x.shape[:-1], n_out), made
        y = lin(x)  # dense or dequantizing: the activation in torch
        return ACTS[self.act](y[..., 0::2], y[..., 1::2]), {}
