"""W1 A/B in one process: the engine built once per variant, the variants interleaved by round.

    python -m tools.ab_w1 MODEL.gguf:default,norm-off[,...] [MODEL.gguf:...] [--rounds 2]
        [--prompt 512 --gen 128 --runs 3 --kv-dtype auto]   # W6: --prompt 32000 --gen 64
        [--batch 2 4] # sequences decoded together (each count in turn)

Each variant switches one GPU-path choice off (or to its earlier form) before the engine is
built, then ``tools.bench_w1.bench`` times it (512-token prompt, 128 tokens, three runs); one
JSON line per (model, round, variant). Same-call comparisons are what BENCHMARKS.md's A/B
figures are: W1 moved by several percent between calls and machines, by under 0.3 % within one.

Variants (``VARIANTS``, what each switches off): ``default``; ``norm-off`` (no int8 rounding
in the RMSNorm, ``SKIFF_NORM_ROUNDING=0``); ``norm-whole`` (the rounding norm in one program a row);
``combine-off`` (the attention's combine pass rounds nothing); ``gated-off`` (the gated GEMV
rounds nothing for the down projection); ``qkv-unfused`` (Q/K/V one launch each);
``attn-64`` (decode attention in 64-key tiles of 4 warps at every context, as before (y));
``cache-0`` (the rows GEMV's weight loads without the evict-first hint, as before (z));
``cache-1`` (evict-first on the rows GEMV's weight words only, the scale loads plain, as
before (aq)); ``cache-q6k-1`` (the same for Q6_K weights only); ``kv-last`` (the decode
attention's K and V loads evict-last); ``stage-off``
(a graph's inputs copied in by a copy or fill each, not by one ``stage_inputs`` launch, as
before (ar)); ``combine-w4`` / ``combine-w2`` (the attention's combine in programs of 4
warps, as before (ar), or 2, not 1); ``step-io-off`` (that, the logits converted and then
copied into the graph's buffer, and decode steps' final norm through a gather, all as before
(ar)); ``rope-wide``
(RoPE + KV write in programs of 16 heads at every token count, as before (ab));
``final-off`` (the last residual add, the final norm and the LM head's rounding
in a launch each, as before (as)); ``head-store-off`` (the LM head's logits in the
activations' dtype, then converted to float32 by a launch, as before (as)); ``argmax-two``
(greedy picks in two launches, as before (as)); ``tail-off`` (all three);
``inputs-copy`` (a graph step's inputs copied to the device, not read by its staging kernel
from pinned memory, as before (at)); ``ids-copy`` (the sampled ids copied to the host, not
stored there by a kernel, as before (at)); ``step-copies`` (both); ``stage-late`` (a graph
step's staging kernel launched after the greedy argmax, not early beside it, as before (at));
``argmax-torch`` (greedy picks by torch.argmax); ``copies-apart`` (a step's inputs in one
host->device copy each);
``prefetch-off`` (decode attention loads its first key tile after wait_prev, as before (ab));
``pair-off`` (a Q/K/V of two types, Q4_K_M's q/k and v, in one launch a type, as before (ac));
``batch-rows-off`` (decode batches of 2-4 rows by the decode-batch GEMMs instead of the batch
rows GEMV, as before (ad); with ``--batch``); ``batch-rows-8`` (batches of 5-8 rows by the
batch rows GEMV too, their rows in two programs); ``batch-regs-128`` (the batch rows GEMV's
programs of 2 rows given 128 registers, maxnreg); ``round-ahead-off`` (decode batches of 2-4 rows
rounded to int8 by the batch rows GEMV's own launch instead of by the RMSNorm ahead,
``linear.ROUND_AHEAD_ROWS`` 1; with ``--batch``); ``batch-wave-off`` (the batch rows GEMV's K
split by ``batch_split``'s warps an SM instead of one wave of programs as its registers allow,
``BATCH_WAVE`` off, as before (aj); with ``--batch``); ``rope-apart`` (batch 1's RoPE and KV
write in a launch of their own after the Q/K/V GEMV, ``linear.QKV_ROPE`` off, as before (aj)).
``splits-floor`` (a decode graph's attention slices from the context's whole key tiles, the
last partial one not counted, as before (ak)); ``wide-off`` (batch-1 rows GEMVs of one pass
split as other shapes, ``packed_matmul.WIDE_ROWS`` off, as before (ak)); ``wide-64`` (those
programs at 64 registers, two of 16 warps an SM: Q/K/V's 192 row tiles unsplit too, as before
(an));
``one-seq-off`` (attention over one sequence searches for its program's sequence as over
several, ``paged_attention._ONE_SEQ`` off, as before (al)); ``attn-32`` (decode attention in
32-key tiles where the rule gives 64, batches too: twice the slices, 116 registers a thread
instead of 168-183 on sm_90); ``attn-w2`` (decode attention's 64-key tiles in programs of 2
warps instead of 4); ``attn-32-w2``, ``attn-32-w1`` (32-key tiles in programs of 2 warps, of
1); ``attn-64-w8`` (64-key tiles in programs of 8 warps, one sequence too); ``attn-16``
(16-key tiles where the rule gives 64 or 32, batch 1's decode graphs cut into up to 64
slices); ``short-tiles-off`` (one sequence's decode attention over short contexts in 64-key
tiles, not 32: ``attention_plan.SHORT_DECODE_KEYS``'s rule off, as before (am));
``gemv-pdl-off`` (the batch-1 rows and paired GEMVs launched after the kernel before them
ends, no weights requested early: a diagnosis); ``norm-loads-off`` (the RMSNorm's loads in
three dependent round trips, as before (an): ``norm._LOADS_FIRST`` off); ``qkv-late-next``
(the Q/K/V launches with the RoPE epilogue of every type let the attention's programs be placed
after their weight loop, not first: ``packed_int8_rows_policy.LATE_NEXT_ROPE``; by default
Q8_0's, Q4_K's and the Q4_K + Q6_K pairs'), ``qkv-late-q4k`` (Q4_K's only), ``qkv-late-pair``
(those pairs only), ``qkv-late-q8`` (Q8_0's only, the default before (ap)), ``qkv-late-off``
(none); ``gemv-late-next`` (every rows and pair launch so: ``packed_int8_rows_policy.LATE_NEXT``);
``late-act``, ``late-norm`` (the gate/up launch, or the output and down projections that fold
the norm, so: ``LATE_NEXT_KINDS``);
``norm-slice-256``, ``norm-slice-1024`` (a decode row's RMSNorm in programs of 256 or 1,024
columns, not 512: ``norm._SLICE``); ``norm-warps-4`` (the RMSNorm's programs of 4 warps, not 8);
``norm-ahead-off`` (batch 1's residual add + RMSNorm in launches of their own, not folded into
the output and down projections' epilogues: ``linear.NORM_AHEAD`` off, as before (ao));
``norm-early-off`` (those epilogues load the residual and norm weight themselves, after the
tile's last split: ``norm_ahead.EARLY_LOADS`` off).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch


@contextmanager
def _patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextmanager
def _env(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _unfused_split_linear(self, names, outs, in_features):
    from shared.model.linear import SplitLinear

    parts = [
        self._fused([(n, o)], in_features, self.f.info(f"{n}.weight").qtype)
        for n, o in zip(names, outs, strict=True)
    ]
    return SplitLinear(parts, outs)


def _tile_keys_64(
    head_dim: int, cache_dtype, max_kv_len: int, shared_memory: int = 0, seqs: int = 0
) -> int:
    return 64 if head_dim <= 128 else 32


# the modules that call decode_tile_keys (each imported the name: each is patched)
_TILE_RULE_MODULES = (
    "shared.kernels.attention_plan",
    "shared.kernels.paged_attention",
    "shared.engine.cuda_graphs",
)


def _tile_rule(keys: Callable[..., int]) -> ExitStack:
    """decode_tile_keys replaced by `keys` in every module that calls it."""
    stack = ExitStack()
    for module in _TILE_RULE_MODULES:
        stack.enter_context(_patched(importlib.import_module(module), "decode_tile_keys", keys))
    return stack


def _decode_tiles(small: int = 32) -> ExitStack:
    """decode_tile_keys with `small`-key tiles where it gives 64 or 32 to heads of up to 128
    (W1's contexts; batches too), in every module that calls it; with 16, the decode graphs
    also cut batch 1 into up to 64 slices."""
    plan = importlib.import_module("shared.kernels.attention_plan")
    rule, splits = plan.decode_tile_keys, plan.default_num_splits

    def keys(
        head_dim: int, cache_dtype, max_kv_len: int, shared_memory: int = 1 << 30, seqs: int = 0
    ) -> int:
        k = rule(head_dim, cache_dtype, max_kv_len, shared_memory, seqs)
        return small if k in (32, 64) and head_dim <= 128 else k

    def slices(seqs: int, heads: int, max_kv_len: int, sms: int, tile_keys: int = 64) -> int:
        if tile_keys == 16 and seqs == 1:
            return min(64, -(-max_kv_len // 16))
        return splits(seqs, heads, max_kv_len, sms, tile_keys)

    stack = _tile_rule(keys)
    if small == 16:
        graphs = importlib.import_module("shared.engine.cuda_graphs")
        stack.enter_context(_patched(graphs, "default_num_splits", slices))
    return stack


def _short_tiles_off() -> ExitStack:
    """decode_tile_keys without its one-sequence rule (64-key tiles at batch 1 over short
    contexts, as before (am)), in every module that calls it."""
    rule = importlib.import_module("shared.kernels.attention_plan").decode_tile_keys

    def keys(
        head_dim: int, cache_dtype, max_kv_len: int, shared_memory: int = 1 << 30, seqs: int = 0
    ) -> int:
        return rule(head_dim, cache_dtype, max_kv_len, shared_memory)

    return _tile_rule(keys)


def _decode_warps(warps: int, keys: int = 0) -> ExitStack:
    """Decode attention in programs of `warps` warps (in `keys`-key tiles where the rule gives
    64 or 32, when keys is given: see _decode_tiles)."""
    from dataclasses import replace

    plan = importlib.import_module("shared.kernels.attention_plan")
    stack = _decode_tiles(keys) if keys else ExitStack()

    def tiles(max_query_len: int, *args, **kw):
        t = plan.pick_tiles(max_query_len, *args, **kw)
        return replace(t, num_warps=warps) if max_query_len <= 1 and t.tile_n <= 64 else t

    pa = importlib.import_module("shared.kernels.paged_attention")
    stack.enter_context(_patched(pa, "_pick_tiles", tiles))
    return stack


def _separate_copies(parts, device):
    """staging.to_device_packed as before (ab): one host->device copy a list."""
    from shared.staging import to_device

    return [to_device(torch.tensor(values, dtype=dtype), device) for values, dtype in parts]


def _torch_argmax(x, counts=None, host=None):
    out = x.argmax(dim=-1)
    if host is not None:  # argmax_rows stores its picks there too
        host.copy_(out, non_blocking=True)
    return out


def _floor_splits(seqs: int, heads: int, max_kv_len: int, sms: int, tile_keys: int = 64) -> int:
    """default_num_splits counting whole key tiles only, as before (ak)."""
    from shared.kernels.attention_plan import default_num_splits

    return default_num_splits(seqs, heads, max_kv_len // tile_keys * tile_keys, sms, tile_keys)


_POLICY = "shared.kernels.qmatmul.packed_int8_rows_policy"  # the rows launches' flags


def _late_every_rope() -> object:
    """packed_int8_rows_policy.LATE_NEXT_ROPE set to every rows type and every pair of them."""
    rows = importlib.import_module("shared.kernels.qmatmul.packed_rows")
    every = [int(t) for t in rows.ROWS_TYPES]
    late = [(a,) for a in every] + [(a, b) for a in every for b in every]
    return _patched(importlib.import_module(_POLICY), "LATE_NEXT_ROPE", frozenset(late))


def _norm_warps_4(n: int) -> tuple[int, int]:
    """norm._launch_config with programs of 4 warps, whatever the row."""
    return 1 << (n - 1).bit_length(), 4


def _off(module: str, name: str, value) -> Callable[[], object]:
    """A patch of module.name, imported when entered (the engine's modules load lazily)."""
    return lambda: _patched(importlib.import_module(module), name, value)


# each variant: the context managers (made fresh per build) that switch off what it names
VARIANTS: dict[str, tuple[Callable[[], object], ...]] = {
    "default": (),
    "norm-off": (lambda: _env("SKIFF_NORM_ROUNDING", "0"),),
    "norm-whole": (_off("shared.kernels.norm", "_SLICED_ROWS", 0),),
    "combine-off": (_off("shared.kernels.paged_attention", "_rounds_heads", lambda h, w: False),),
    "gated-off": (_off("shared.model.linear", "rounds_gated", lambda n, w, g: False),),
    "cache-0": (_off(_POLICY, "DEFAULT_CACHE", 0),),
    "cache-1": (_off(_POLICY, "DEFAULT_CACHE", 1),),
    "cache-q6k-1": (_off(_POLICY, "TYPE_CACHE", {14: 1}),),  # Q6_K's weights as before (aq)
    "attn-64": (lambda: _tile_rule(_tile_keys_64),),
    "attn-32": (_decode_tiles,),
    "attn-16": (lambda: _decode_tiles(16),),
    "short-tiles-off": (_short_tiles_off,),
    "norm-loads-off": (_off("shared.kernels.norm", "_LOADS_FIRST", False),),
    "qkv-late-next": (_late_every_rope,),
    "qkv-late-q4k": (_off(_POLICY, "LATE_NEXT_ROPE", frozenset({(12,)})),),  # Q4_K
    "qkv-late-pair": (_off(_POLICY, "LATE_NEXT_ROPE", frozenset({(12, 14)})),),  # Q4_K + Q6_K
    "qkv-late-q8": (_off(_POLICY, "LATE_NEXT_ROPE", frozenset({(8,)})),),  # before (ap)
    "qkv-late-off": (_off(_POLICY, "LATE_NEXT_ROPE", frozenset()),),
    "gemv-late-next": (_off(_POLICY, "LATE_NEXT", True),),
    "late-act": (_off(_POLICY, "LATE_NEXT_KINDS", frozenset({"act"})),),
    "late-norm": (_off(_POLICY, "LATE_NEXT_KINDS", frozenset({"norm"})),),
    "norm-slice-256": (_off("shared.kernels.norm", "_SLICE", 256),),
    "norm-slice-1024": (_off("shared.kernels.norm", "_SLICE", 1024),),
    "norm-warps-4": (_off("shared.kernels.norm", "_launch_config", _norm_warps_4),),
    "gemv-pdl-off": (
        _off("shared.kernels.qmatmul.packed_int8_rows", "pdl", lambda device, kernel: False),
        _off("shared.kernels.qmatmul.packed_int8_pair", "pdl", lambda device, kernel: False),
    ),
    "attn-w2": (lambda: _decode_warps(2),),
    "attn-32-w2": (lambda: _decode_warps(2, 32),),
    "attn-32-w1": (lambda: _decode_warps(1, 32),),
    "attn-64-w8": (lambda: _decode_warps(8, 64),),
    "rope-wide": (_off("shared.kernels.rope_kv", "_MIN_PROGRAMS", 0),),
    "argmax-torch": (_off("shared.sampling.sampler", "argmax_rows", _torch_argmax),),
    "copies-apart": (_off("shared.model.batch", "to_device_packed", _separate_copies),),
    "prefetch-off": (_off("shared.kernels.paged_attention", "_PREFETCH", False),),
    "kv-last": (_off("shared.kernels.paged_attention", "_KV_EVICT", "evict_last"),),
    "stage-off": (_off("shared.engine.cuda_graphs", "STAGED", False),),
    "final-off": (_off("shared.model.causal_lm", "FINAL_FUSED", False),),
    "head-store-off": (_off("shared.model.causal_lm", "HEAD_STORES", False),),
    "argmax-two": (_off("shared.sampling.sampler", "COUNTED_ARGMAX", False),),
    "tail-off": (
        _off("shared.model.causal_lm", "FINAL_FUSED", False),
        _off("shared.model.causal_lm", "HEAD_STORES", False),
        _off("shared.sampling.sampler", "COUNTED_ARGMAX", False),
    ),
    "combine-w4": (_off("shared.kernels.paged_attention", "_COMBINE_WARPS", 4),),
    "inputs-copy": (_off("shared.engine.model_runner", "PINNED_INPUTS", False),),
    "ids-copy": (_off("shared.engine.engine", "IDS_BY_KERNEL", False),),
    "stage-late": (_off("shared.kernels.stage_inputs", "EARLY", False),),
    "step-copies": (
        _off("shared.engine.model_runner", "PINNED_INPUTS", False),
        _off("shared.engine.engine", "IDS_BY_KERNEL", False),
    ),
    "combine-w2": (_off("shared.kernels.paged_attention", "_COMBINE_WARPS", 2),),
    "step-io-off": (
        _off("shared.engine.cuda_graphs", "STAGED", False),
        _off("shared.engine.cuda_graphs", "LOGITS_INTO", False),
        _off("shared.model.causal_lm", "WHOLE_ROWS", False),
    ),
    "pair-off": (_off("shared.model.linear", "_PAIRED", False),),
    "batch-rows-off": (_off("shared.kernels.qmatmul.packed_int8_rows_batch", "BATCH_ROWS", 1),),
    "batch-rows-8": (_off("shared.kernels.qmatmul.packed_int8_rows_batch", "BATCH_ROWS", 8),),
    "batch-regs-128": (
        _off("shared.kernels.qmatmul.packed_int8_rows_batch", "BATCH_MAXNREG", 128),
    ),
    "round-ahead-off": (_off("shared.model.linear", "ROUND_AHEAD_ROWS", 1),),
    "rope-apart": (_off("shared.model.linear", "QKV_ROPE", False),),
    "batch-wave-off": (_off("shared.kernels.qmatmul.packed_int8_rows_batch", "BATCH_WAVE", False),),
    "splits-floor": (
        lambda: _patched(
            importlib.import_module("shared.engine.cuda_graphs"),
            "default_num_splits",
            _floor_splits,
        ),
    ),
    "wide-off": (_off("shared.kernels.qmatmul.packed_matmul", "WIDE_ROWS", False),),
    "wide-64": (_off("shared.kernels.qmatmul.packed_matmul", "WIDE_MAXNREG", 64),),
    "norm-ahead-off": (_off("shared.model.linear", "NORM_AHEAD", False),),
    "norm-early-off": (_off("shared.kernels.qmatmul.norm_ahead", "EARLY_LOADS", False),),
    "one-seq-off": (_off("shared.kernels.paged_attention", "_ONE_SEQ", False),),
    "qkv-unfused": (
        lambda: _patched(
            importlib.import_module("shared.model.weights").WeightLoader,
            "split_linear",
            _unfused_split_linear,
        ),
    ),
}


def enter_variant(stack: ExitStack, name: str) -> None:
    """Switch off what variant `name` names until `stack` closes ("a+b": both a's and b's)."""
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"unknown variant {part!r}: one of {', '.join(VARIANTS)}")
        for make in VARIANTS[part]:
            stack.enter_context(make())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="+", help="MODEL.gguf:variant,variant,...")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kv-dtype", default="auto", help="the KV cache's dtype (EngineConfig)")
    p.add_argument("--kv-scales", default="token", choices=["token", "head"], help="fp8's scales")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences decoded together")
    a = p.parse_args(argv)
    from tools.bench_w1 import bench

    plans = []
    for spec in a.specs:
        path, _, names = spec.rpartition(":")
        plans.append((Path(path), names.split(",")))
    if unknown := {p for _, names in plans for n in names for p in n.split("+")} - VARIANTS.keys():
        raise SystemExit(f"unknown variants {sorted(unknown)}: one of {', '.join(VARIANTS)}")
    for path, names in plans:
        for r in range(a.rounds):
            for batch, name in ((b, n) for b in a.batch for n in names):
                with ExitStack() as stack:
                    enter_variant(stack, name)
                    res = bench(
                        path,
                        a.device,
                        a.prompt,
                        a.gen,
                        a.runs,
                        True,
                        a.kv_dtype,
                        a.kv_scales,
                        batch,
                    )
                print(json.dumps({"variant": name, "round": r} | res), flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
