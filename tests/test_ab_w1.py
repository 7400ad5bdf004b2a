"""tools/ab_w1.py: each variant switches off what it names while its engine is built, and
everything is as before afterwards (the next variant starts from the defaults)."""

from __future__ import annotations

import importlib
import os
from contextlib import ExitStack

import pytest
import torch

import shared.engine.cuda_graphs as graphs
import shared.kernels.norm as norm
import shared.kernels.paged_attention as pa
import shared.kernels.qmatmul.norm_ahead as norm_ahead
import shared.kernels.qmatmul.packed_int8_pair as pair
import shared.kernels.qmatmul.packed_int8_rows as rows
import shared.kernels.qmatmul.packed_int8_rows_batch as rows_batch
import shared.kernels.qmatmul.packed_int8_rows_policy as policy
import shared.kernels.rope_kv as rope_kv
import shared.model.batch as batch
import shared.model.linear as linear
import shared.sampling.sampler as sampler
import tools.ab_w1 as ab
from shared.model.weights import WeightLoader

# the module (the package exports its function under the same name)
packed_matmul = importlib.import_module("shared.kernels.qmatmul.packed_matmul")


def _state() -> tuple:
    return (
        os.environ.get("SKIFF_NORM_ROUNDING"),
        norm._SLICED_ROWS,
        pa._rounds_heads(128, 32),
        linear.rounds_gated(14336, 32, 8),
        WeightLoader.split_linear,
        (
            pa.decode_tile_keys(128, torch.bfloat16, 1 << 15),
            graphs.decode_tile_keys(128, torch.bfloat16, 1 << 15),
        ),
        policy.DEFAULT_CACHE,
        rope_kv._MIN_PROGRAMS,
        sampler.argmax_rows,
        batch.to_device_packed,
        pa._PREFETCH,
        linear._PAIRED,
        rows_batch.BATCH_ROWS,
        rows_batch.BATCH_MAXNREG,
        linear.ROUND_AHEAD_ROWS,
        rows_batch.BATCH_WAVE,
        linear.QKV_ROPE,
        graphs.default_num_splits(1, 8, 513, 132),  # the decode graphs' rule (9 tiles)
        packed_matmul.WIDE_ROWS,
        packed_matmul.WIDE_MAXNREG,
        pa._ONE_SEQ,
        (
            pa.decode_tile_keys(128, torch.bfloat16, 640),
            graphs.decode_tile_keys(128, torch.bfloat16, 640),
        ),
        pa._pick_tiles(1, 4, 128, torch.bfloat16, True, 640).num_warps,  # decode's programs
        (
            pa.decode_tile_keys(128, torch.bfloat16, 640, seqs=1),  # one sequence's rule
            graphs.decode_tile_keys(128, torch.bfloat16, 640, seqs=1),
        ),
        (rows.pdl, pair.pdl),
        norm._LOADS_FIRST,
        tuple(
            policy.late_next(r, *t) for r in (True, False) for t in ((8,), (12,), (12, 14), (14,))
        ),
        (norm._slice(1, 4096, ((32, 8),)), norm._launch_config(4096)),
        linear.NORM_AHEAD,
        norm_ahead.EARLY_LOADS,
        tuple(policy.late_next(False, 12, kind=k) for k in ("act", "norm", "")),
        pa._KV_EVICT,
        (policy.cache_hints({}, 14), policy.cache_hints({}, 12, 14)),
        graphs.STAGED,
        (graphs.LOGITS_INTO, importlib.import_module("shared.model.causal_lm").WHOLE_ROWS),
        pa._COMBINE_WARPS,
        importlib.import_module("shared.model.causal_lm").FINAL_FUSED,
        importlib.import_module("shared.model.causal_lm").HEAD_STORES,
        importlib.import_module("shared.sampling.sampler").COUNTED_ARGMAX,
        importlib.import_module("shared.engine.model_runner").PINNED_INPUTS,
        importlib.import_module("shared.engine.engine").IDS_BY_KERNEL,
        importlib.import_module("shared.kernels.stage_inputs").EARLY,
    )


def test_variants_switch_one_thing_each_and_restore_it() -> None:
    before = _state()
    assert before[2] and before[3] and before[1] > 0
    assert before[6] == 3  # evict-first weight words and scales
    changed = {}
    for name in ab.VARIANTS:
        with ExitStack() as stack:
            ab.enter_variant(stack, name)
            changed[name] = {
                i for i, (a, b) in enumerate(zip(before, _state(), strict=True)) if a != b
            }
        assert _state() == before
    assert changed == {
        "default": set(),
        "norm-off": {0},
        "norm-whole": {1, 27},
        "combine-off": {2},
        "gated-off": {3},
        "qkv-unfused": {4},
        "attn-64": {5, 23},
        "cache-0": {6, 32},
        "cache-1": {6, 32},
        "rope-wide": {7},
        "argmax-torch": {8},
        "copies-apart": {9},
        "prefetch-off": {10},
        "pair-off": {11},
        "batch-rows-off": {12},
        "batch-rows-8": {12},
        "batch-regs-128": {13},
        "round-ahead-off": {14},
        "batch-wave-off": {15},
        "rope-apart": {16},
        "splits-floor": {17},
        "wide-off": {18},
        "wide-64": {19},
        "one-seq-off": {20},
        "attn-32": {21},
        "attn-16": {21, 23},
        "short-tiles-off": {23},
        "gemv-pdl-off": {24},
        "norm-loads-off": {25},
        "qkv-late-next": {26},
        "gemv-late-next": {26, 30},
        "late-act": {30},
        "late-norm": {30},
        "kv-last": {31},
        "cache-q6k-1": {32},
        "stage-off": {33},
        "step-io-off": {33, 34},
        "combine-w4": {35},
        "combine-w2": {35},
        "final-off": {36},
        "head-store-off": {37},
        "argmax-two": {38},
        "tail-off": {36, 37, 38},
        "inputs-copy": {39},
        "ids-copy": {40},
        "step-copies": {39, 40},
        "stage-late": {41},
        "qkv-late-q4k": {26},
        "qkv-late-pair": {26},
        "qkv-late-q8": {26},
        "qkv-late-off": {26},
        "norm-slice-256": {27},
        "norm-slice-1024": {27},
        "norm-warps-4": {27},
        "attn-w2": {22},
        "attn-32-w2": {21, 22},
        "attn-32-w1": {21, 22},
        "attn-64-w8": {22, 23},
        "norm-ahead-off": {28},
        "norm-early-off": {29},
    }
    with ExitStack() as stack:
        ab.enter_variant(stack, "attn-64")
        assert _state()[5] == (64, 64)
    with ExitStack() as stack:
        ab.enter_variant(stack, "attn-16")
        assert _state()[21] == _state()[23] == (16, 16)
        assert graphs.decode_rule(1, 8, 640, 132) == (40, 16)  # past the 32 slices of 32 keys
        assert graphs.decode_rule(2, 8, 640, 132)[0] == 16  # batch 2 keeps its rule
    for name, warps in (("attn-w2", 2), ("attn-32-w1", 1)):
        with ExitStack() as stack:
            ab.enter_variant(stack, name)
            assert pa._pick_tiles(1, 4, 128, torch.bfloat16, True, 640).num_warps == warps
            assert pa._pick_tiles(64, 4, 128).num_warps == 4  # prefill chunks keep theirs
    for name, hint in (("cache-0", 0), ("cache-1", 1)):
        with ExitStack() as stack:
            ab.enter_variant(stack, name)
            assert hint == policy.DEFAULT_CACHE
    # Q8_0's, Q4_K's and Q4_K + Q6_K's Q/K/V; not Q6_K's, nor any launch without RoPE
    assert before[26] == (True, True, True, False) + (False,) * 4
    variants = (
        ("qkv-late-q4k", (False, True, False, False)),
        ("qkv-late-pair", (False, False, True, False)),
        ("qkv-late-q8", (True, False, False, False)),
        ("qkv-late-off", (False,) * 4),
    )
    for name, late in variants:
        with ExitStack() as stack:
            ab.enter_variant(stack, name)
            assert _state()[26][:4] == late
    with ExitStack() as stack:  # "a+b": both
        ab.enter_variant(stack, "qkv-late-next+norm-slice-256")
        assert _state()[26] == (True,) * 4 + (False,) * 4
        assert _state()[27][0] == (256, 16)
    assert _state() == before
    for name in ("nope", "qkv-late-next+nope"):
        with pytest.raises(SystemExit, match="unknown variant"), ExitStack() as stack:
            ab.enter_variant(stack, name)
    assert _state() == before


def test_the_replaced_forms_compute_the_same() -> None:
    parts = [([1, 2, 3], torch.int64), ([4, 5], torch.int32)]
    apart = ab._separate_copies(parts, "cpu")
    packed = batch.to_device_packed(parts, "cpu")
    assert [t.tolist() for t in apart] == [t.tolist() for t in packed]
    assert [t.dtype for t in apart] == [torch.int64, torch.int32]
    x = torch.tensor([[0.0, 2.0, 2.0], [3.0, -1.0, 0.5]])
    assert ab._torch_argmax(x).tolist() == [1, 0]


def test_cache_hints_take_a_types_own_default_where_a_launchs_types_agree() -> None:
    """``packed_int8_rows_policy.cache_hints``: a config's CACHE first, then the weight types'
    common TYPE_CACHE entry (a pair launch of two types needs both to name the same), then
    DEFAULT_CACHE."""
    hints = policy.CACHE_HINTS
    with ExitStack() as stack:
        stack.enter_context(ab._patched(policy, "DEFAULT_CACHE", 3))
        stack.enter_context(ab._patched(policy, "TYPE_CACHE", {14: 1, 8: 1}))
        assert policy.cache_hints({}, 14) == hints[1]
        assert policy.cache_hints({}, 12) == hints[3]
        assert policy.cache_hints({}, 12, 14) == hints[3]  # Q4_K has none of its own
        assert policy.cache_hints({}, 14, 8) == hints[1]  # both name 1
        assert policy.cache_hints({"CACHE": 0}, 14) == hints[0]
        assert policy.cache_hints({}) == hints[3]
