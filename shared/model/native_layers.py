"""A Llama-family or Gemma 3 model's decoder layers on the CPU in one call of the compiled library
(shared/cpu/layers.c) instead of ~10 ops a layer through Python: the same ops in the same
order, so the same values bit for bit; the step saves the calls' overhead (SmolLM2's decode
step spent ~7 of its 16 ms in Python and torch's allocator between the ops).

Taken for the Llama family (QK-norm and biases included) and Gemma 3, where every projection
is multiplied from its GGUF blocks (QuantLinear.native) by the native ops (NativeOps), over a
float32 or float16 cache, with float32 activations on the CPU. Anything else keeps the modules'
path (``NativeLayers.build`` answers None, or ``run`` declines a step).
"""

from __future__ import annotations

import ctypes
import os

import torch

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.linear import QuantLinear, SplitLinear

_F32, _CACHES = torch.float32, (torch.float32, torch.float16)
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("type", _I), ("w", _P), ("row_bytes", _L), ("n", _I), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _P), ("ffn_norm", _P), ("q_norm", _P), ("k_norm", _P),
        ("post_attn_norm", _P), ("post_ffn_norm", _P), ("qkv", _Part * 3), ("n_qkv", _I),
        ("wo", _Part), ("gate_up", _Part * 2), ("n_gate_up", _I), ("down", _Part), ("k_cache", _P),
        ("v_cache", _P), ("rope_dim", _I), ("inv_freq", _P), ("rope_scale", _F), ("window", _I),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("t", _I), ("d_model", _I), ("hq", _I), ("hk", _I), ("hd", _I), ("ffn", _I),
        ("neox", _I), ("half_cache", _I), ("gelu", _I), ("eps", _F), ("attn_scale", _F),
        ("positions", _P), ("slots", _P), ("block_tables", _P), ("width", _I), ("qstart", _P),
        ("seq_lens", _P), ("n_seqs", _I), ("block_size", _I), ("simd", _I),
    ]  # fmt: skip


def _parts(module: QuantLinear | SplitLinear) -> list[QuantLinear] | None:
    parts = list(module.parts) if isinstance(module, SplitLinear) else [module]
    if any(p.native is None or p.kernel_error is not None for p in parts):
        return None
    return parts


def _part(p: QuantLinear) -> _Part:
    w = p.native
    bias = p.bias.data_ptr() if p.bias is not None else None
    return _Part(w.qtype, w.rows.data_ptr(), w.rows.shape[1], w.shape[0], bias)


class NativeLayers:
    """The layers' pointers, made once (weights, norms, RoPE angles; the caches per pool)."""

    def __init__(self, model, lib: ctypes.CDLL, layers: list[tuple], gemma: bool) -> None:
        self.model, self.lib = model, lib
        self._layers = layers  # (norms, qkv parts, wo, gate_up parts, down, attention)
        self.gemma = gemma  # Gemma 3's layers: GELU, norms after, x the only stream
        self._table_of: tuple[KVPool, ctypes.Array] | None = None  # the last pool's

    @classmethod
    def build(cls, model) -> NativeLayers | None:
        """None where some layer is not plain (module docstring) or the library is absent."""
        ops = model.ops
        if os.environ.get("SKIFF_CPU_LAYERS", "1") == "0":  # the modules' path (A/B, tests)
            return None
        if getattr(ops, "name", "") != "native" or not model.layers:
            return None
        layers = []
        gemma = hasattr(model.layers[0], "post_attn_norm")  # norms after, no residual stream
        for layer in model.layers:
            attn, mlp = layer.attn, layer.mlp
            qkv, wo = _parts(attn.qkv), _parts(attn.wo)
            gate_up = _parts(mlp.gate_up) if mlp.gated is None else None
            down = _parts(mlp.down)
            if None in (qkv, wo, gate_up, down) or len(qkv) > 3 or len(gate_up) > 2:
                return None
            norms = [layer.attn_norm, layer.ffn_norm, attn.q_norm, attn.k_norm]
            norms += [layer.post_attn_norm, layer.post_ffn_norm] if gemma else [None, None]
            vectors = [v for v in norms if v is not None]
            vectors += [p.bias for p in qkv + wo + gate_up + down if p.bias is not None]
            if any(v.dtype != _F32 or not v.is_contiguous() for v in vectors):
                return None
            layers.append((norms, qkv, wo[0], gate_up, down[0], attn))
        return cls(model, ops.lib, layers, gemma)

    def _table(self, kv: KVPool) -> ctypes.Array:
        if self._table_of is not None and self._table_of[0] is kv:
            return self._table_of[1]
        ops = self.model.ops
        table = (_Layer * len(self._layers))()
        for i, (norms, qkv, wo, gu, down, attn) in enumerate(self._layers):
            dim, base, scale, factors = attn.rope
            angles = ops._angles(dim, base, factors)
            L = table[i]
            ptrs = [None if v is None else v.data_ptr() for v in norms]
            L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm = ptrs[:4]
            L.post_attn_norm, L.post_ffn_norm = ptrs[4:]
            for j, p in enumerate(qkv):
                L.qkv[j] = _part(p)
            L.n_qkv = len(qkv)
            L.wo = _part(wo)
            for j, p in enumerate(gu):
                L.gate_up[j] = _part(p)
            L.n_gate_up, L.down = len(gu), _part(down)
            L.k_cache, L.v_cache = kv.k[attn.layer].data_ptr(), kv.v[attn.layer].data_ptr()
            L.rope_dim, L.inv_freq, L.rope_scale = dim, angles.data_ptr(), scale
            L.window = attn.sliding_window
        self._table_of = (kv, table)
        return table

    def usable(self, x: torch.Tensor, kv: KVPool) -> bool:
        """Whether this step's activations and cache are the library's."""
        return (
            x.dtype == _F32
            and x.device.type == "cpu"
            and kv.k[0].dtype in _CACHES
            and kv.v[0].dtype == kv.k[0].dtype
        )

    def run(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) after every layer: run_layers' result (Gemma 3: no residual)."""
        cfg = self.model.cfg
        t = x.shape[0]
        # the library writes both in place: copies (contiguous), the caller's stay as they are
        out = x.clone(memory_format=torch.contiguous_format)
        res = (torch.empty_like(out) if residual is None
               else residual.clone(memory_format=torch.contiguous_format))  # fmt: skip
        positions, slots = batch.positions.contiguous(), batch.slot_mapping.contiguous()
        tables = batch.block_tables.contiguous()
        qstart, seq_lens = batch.query_start_loc_t.contiguous(), batch.seq_lens_t.contiguous()
        step = _Step(
            t, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
            int(cfg.rope_neox), int(kv.k[0].dtype == torch.float16), int(self.gemma), cfg.rms_eps,
            cfg.attn_scale, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            tables.shape[1], qstart.data_ptr(), seq_lens.data_ptr(), len(batch.seq_lens),
            kv.k[0].shape[1], 1,
        )  # fmt: skip
        self.lib.skiff_llama_layers(
            self._table(kv), len(self._layers), ctypes.byref(step), out.data_ptr(),
            res.data_ptr(), int(residual is not None),
        )  # fmt: skip
        return out, (None if self.gemma else res)
