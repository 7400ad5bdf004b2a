"""Compile a wrapper's own kernel launches for an NVIDIA target on a machine without a GPU: the
fused kernels as the engine launches them at Llama-3-8B shapes (paged attention, add + RMSNorm,
RoPE + KV write, the greedy argmax), for tools/kernel_sass.py to count their instructions."""

from __future__ import annotations

import contextlib

import torch
from triton.backends.compiler import GPUTarget


class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver so that a wrapper's own launches compile (the JIT's
    warmup path, with its real argument specialization) on a machine without a GPU."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def _compile_only(arch: int, module: object, **patches: object):
    """Within: a wrapper's own kernel launches compile for sm_`arch` (the JIT's warmup path,
    with its real argument specialization) instead of running, into the yielded dict by
    kernel name; `module`'s attributes in `patches` replaced (device queries a CPU cannot
    answer), and its launches early (``pdl``) as on a GPU of that architecture."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: dict = {}

    def compile_only(self, grid):
        return lambda *args, **kw: compiled.setdefault(
            self.fn.__name__, self.warmup(*args, grid=grid, **kw)
        )

    if hasattr(module, "pdl"):
        patches = {"pdl": lambda device, kernel: arch >= 90, **patches}
    saved = {name: getattr(module, name) for name in patches}
    saved_getitem, saved_driver = JITFunction.__getitem__, driver._active
    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.__getitem__ = compile_only
    for name, value in patches.items():
        setattr(module, name, value)
    try:
        yield compiled
    finally:
        JITFunction.__getitem__, driver._active = saved_getitem, saved_driver
        for name, value in saved.items():
            setattr(module, name, value)


def compile_attention(
    kv: str, query_len: int, arch: int = 90, device_splits: bool = False, b: int = 16
):
    """The paged-attention kernel as ``paged_attention`` launches it for a Llama-3-8B-like batch
    (b sequences of 32k context, 32 / 8 heads of 128, bf16 queries) with a bf16 or FP8 cache;
    device_splits: split-K with the count read on the device (mixed-step CUDA graphs)."""
    import shared.kernels.paged_attention as pa

    fp8, sms = (lambda device: True), (lambda device: 132)
    with _compile_only(arch, pa, _native_fp8=fp8, _num_sms=sms) as compiled:
        ctx, bs, n_kv, hd = 32768, 16, 8, 128
        blocks = b * ctx // bs
        kv_dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
        k = torch.empty(blocks, bs, n_kv, hd, dtype=kv_dtype)
        q = torch.empty(b * query_len, 4 * n_kv, hd, dtype=torch.bfloat16)
        table = torch.arange(blocks, dtype=torch.int32).reshape(b, -1)
        starts = torch.arange(b + 1, dtype=torch.int32) * query_len
        lens = torch.full((b,), ctx, dtype=torch.int32)
        scales = {
            "bf16": None,
            "fp8": torch.empty(blocks, bs, n_kv),
            "fp8-head": torch.empty(n_kv).expand(blocks, bs, n_kv),  # one scale per KV head
        }[kv]
        splits = {"num_splits": 8, "num_splits_t": lens[:1]} if device_splits else {}
        pa.paged_attention(
            q, k, torch.empty_like(k), table, starts, lens, 0.088, max_query_len=query_len,
            k_scale=scales, v_scale=scales, max_seq_len=ctx, **splits,
        )  # fmt: skip
    return compiled["_paged_attention_kernel"]


def compile_norm(layouts: tuple[tuple[int, int], ...], arch: int = 90, rows: int = 1):
    """The fused residual add + RMSNorm as ``add_rms_norm_int8`` launches it for `rows`
    Llama-3-8B rows (4096, bf16), rounding them to int8 for `layouts` in the same launch."""
    import shared.kernels.norm as norm

    with _compile_only(arch, norm) as compiled:
        x = torch.empty(rows, 4096, dtype=torch.bfloat16)
        norm.add_rms_norm_int8(x, torch.empty_like(x), torch.empty(4096), 1e-5, layouts)
    return compiled["_rms_norm_kernel"]


def compile_argmax(arch: int = 90, host: bool = False) -> dict:
    """The greedy argmax as ``argmax_rows`` launches it for one row of Llama-3's 128,256
    float32 logits (one counted launch); with host, its picks stored into host memory too.
    {name: kernel}."""
    import shared.kernels.argmax as argmax

    with _compile_only(arch, argmax) as compiled:
        counts = torch.zeros(64, dtype=torch.int32)
        ids = torch.zeros(1, dtype=torch.int64) if host else None
        argmax.argmax_rows(torch.empty(1, 128256), counts, ids)
    return compiled


def compile_stage(fill: bool, arch: int = 90) -> dict:
    """``stage_inputs`` as a decode graph of 8 tokens takes a step of 8 sequences (blocks of
    16, 40 a table), with the tokens in flight filled in or not. {name: kernel}."""
    import shared.kernels.stage_inputs as stage

    i64, i32 = torch.int64, torch.int32
    src = {"token_ids": torch.zeros(8, dtype=i64), "positions": torch.zeros(8, dtype=i64),
           "slot_mapping": torch.zeros(8, dtype=i64), "block_tables": torch.zeros(8, 40, dtype=i32),
           "query_start_loc": torch.zeros(9, dtype=i32), "seq_lens": torch.zeros(8, dtype=i32),
           "logits_rows": torch.zeros(8, dtype=i64)}  # fmt: skip
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dst["block_tables"] = torch.zeros(64, 256, dtype=i32)
    dst["attn_splits"] = torch.zeros(1, dtype=i32)
    with _compile_only(arch, stage) as compiled:
        fills = (torch.zeros(8, dtype=i64), torch.zeros(8, dtype=i64)) if fill else None
        stage.stage_inputs(src, dst, 8, 8, fill=fills)
    return compiled


def compile_host_copy(arch: int = 90) -> dict:
    """``copy_to_host`` of 64 int64 ids (a decode batch's sampled ids). {name: kernel}."""
    import shared.kernels.host_copy as host_copy

    with _compile_only(arch, host_copy) as compiled:
        host_copy.copy_to_host(
            torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
        )
    return compiled


def compile_rope_kv(kv: str, arch: int = 90):
    """RoPE + KV write as ``rope_and_write_kv`` launches it for 64 Llama-3-8B tokens (32 / 8
    heads of 128, bf16) into a bf16 cache, an FP8 cache with per-token scales ("fp8") or one
    with per-head scales ("fp8-head": zero block and slot strides)."""
    import shared.kernels.rope_kv as rope_kv

    with _compile_only(arch, rope_kv) as compiled:
        t, n_kv, hd = 64, 8, 128
        qkv = torch.empty(t, 48 * hd, dtype=torch.bfloat16)
        q, k, v = qkv[:, : 32 * hd], qkv[:, 32 * hd : 40 * hd], qkv[:, 40 * hd :]
        q, k, v = q.view(t, 32, hd), k.view(t, n_kv, hd), v.view(t, n_kv, hd)
        dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
        cache = torch.empty(128, 16, n_kv, hd, dtype=dtype)
        scales = {
            "bf16": None,
            "fp8": torch.empty(128, 16, n_kv),
            "fp8-head": torch.empty(n_kv).expand(128, 16, n_kv),
        }[kv]
        pos = torch.arange(t)
        rope_kv.rope_and_write_kv(
            q, k, v, pos, cache, torch.empty_like(cache), pos, hd, 5e5, True,
            k_scale_cache=scales, v_scale_cache=scales,
        )  # fmt: skip
    return compiled["_rope_write_kv_kernel"]


def compile_pair(types: tuple[int, int], arch: int = 90, rope: bool = False):
    """Two rows GEMVs in one launch as ``SplitLinear`` makes it at batch 1 for Llama-3-8B's
    q/k (5,120 rows) and v (1,024 rows) of the two types, bf16 activations; with rope, the
    RoPE epilogue writing k and v into bf16 caches (``qkv_rope``), as the Q/K/V launch."""
    import shared.kernels.qmatmul.packed_int8_pair as pair
    from shared.kernels.qmatmul.int8_activations import int8_buffers
    from shared.kernels.qmatmul.packed import pack
    from shared.kernels.qmatmul.packed_rows import interleave
    from shared.kernels.qmatmul.qkv_rope import QKVRope
    from shared.quant import block_geometry

    def weight(qtype: int, n: int):
        block, size = block_geometry(qtype)
        raw = torch.zeros(n, 4096 // block * size, dtype=torch.uint8)
        return interleave(pack(raw, qtype, (n, 4096)))

    with _compile_only(arch, pair) as compiled:
        a, b = weight(types[0], 5120), weight(types[1], 1024)
        x = torch.empty(1, 4096, dtype=torch.bfloat16)
        splits = pair.pair_splits(a, b, 4)
        cfg = {"ROWS": 1, "num_warps": 4}
        target = None
        if rope:
            pos, cache = torch.zeros(1, dtype=torch.int64), torch.empty(128, 16, 8, 128)
            cache = cache.to(torch.bfloat16)
            target = (QKVRope(pos, pos, cache, torch.empty_like(cache), 32, 128, 5e5), 0)
        pair.rows_gemv_pair(x, a, b, int8_buffers(x[0], a), int8_buffers(x[0], b), cfg, splits,
                            False, target)  # fmt: skip
    return compiled["gemv_int8_pair_kernel"]
