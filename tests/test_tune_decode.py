"""tools/tune_decode.py's search (the engine glue needs a GPU): one key at a time, a candidate
kept only when it beats the best so far by the margin, the defaults measured first; its
candidates; and the tuner's entry replacement it drives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.tuning import Tuner
from tests.test_kernel_packed_matmul import random_raw
from tools.tune_decode import SPLITS, coordinate_search, parse_only, rows_trials, selected


def test_coordinate_search_keeps_only_clear_wins() -> None:
    speed = {("a", 1): 0.10, ("a", 2): 0.001, ("b", 1): -0.05, ("b", 2): 0.02}
    calls = []

    def measure(entries: dict) -> float:
        calls.append(dict(entries))
        return 100.0 * (1 + sum(speed[(k, c["v"])] for k, c in entries.items()))

    def candidates(key: str) -> list[dict]:
        return [{"v": 1}, {"v": 2}]

    chosen, base, best = coordinate_search(["a", "b"], candidates, measure, margin=0.005)
    assert calls[0] == {}  # the defaults first
    assert chosen == {"a": {"v": 1}, "b": {"v": 2}}
    assert base == 100.0 and abs(best - 100.0 * 1.12) < 1e-9
    # b's candidates were measured with a's winner in place, which was measured again first
    assert {"a": {"v": 1}, "b": {"v": 1}} in calls
    again = [i for i, c in enumerate(calls) if c == {"a": {"v": 1}}]
    assert len(again) == 2 and calls.index({"a": {"v": 1}, "b": {"v": 1}}) > again[1]
    # a gain inside the margin keeps the default
    tiny = {("a", 1): 0.004, ("a", 2): -0.1, ("b", 1): 0.0, ("b", 2): 0.0}
    speed.update(tiny)
    chosen, _, best = coordinate_search(["a", "b"], candidates, measure, margin=0.005)
    assert chosen == {} and best == 100.0


def test_rows_trials_sweep_the_split_then_the_tiles() -> None:
    trials = rows_trials(4)
    default_tile = [t for t in trials if (t["num_warps"], t["PREFETCH"], t["QX"]) == (4, 0, 0)]
    assert sorted(t["SPLIT_K"] for t in default_tile) == [s for s in SPLITS if s != 4]
    others = [t for t in trials if t not in default_tile]
    assert others and all(t["SPLIT_K"] == 4 and t["ROWS"] and t["INT8"] for t in others)
    assert {"ROWS": 1, "INT8": 1, "num_warps": 4, "PREFETCH": 0, "QX": 1, "SPLIT_K": 4} in others
    assert len({json.dumps(t, sort_keys=True) for t in trials}) == len(trials)


def test_set_entries_replaces_the_given_keys(tmp_path: Path) -> None:
    pw = pack(random_raw(T.Q4_K, 32, 512, seed=2), T.Q4_K, (32, 512))
    key = f"cpu|{int(T.Q4_K)}|32x512|m1|bfloat16"
    kept = f"cpu|{int(T.Q4_K)}|32x512|m16|bfloat16"
    old = {"BLOCK_N": 16, "SPLIT_K": 2, "num_warps": 1}
    (tmp_path / "qmatmul-tuning.json").write_text(json.dumps({key: old, kept: old}))
    tuner = Tuner(torch.device("cpu"), cache_dir=tmp_path)
    assert tuner.table_key(pw, 1, torch.bfloat16) == key
    assert tuner.config(pw, 1, torch.bfloat16) == old
    new = {"BLOCK_N": 32, "SPLIT_K": 4, "num_warps": 2}
    tuner.set_entries({key: new}, drop=[key])
    assert tuner.config(pw, 1, torch.bfloat16) == new  # the memo was cleared
    tuner.set_entries({}, drop=[key])
    assert key not in tuner.table and kept in tuner.table
    assert tuner.config(pw, 1, torch.bfloat16) != new  # back to the default


def test_default_rows_split_is_the_dispatch_default() -> None:
    """The split the tool starts from is the one the rows GEMV takes untuned: here one tile of
    32 rows, 16 chunks, one SM (the CPU): min(16, 31 // 4 // 1, 16 // 4) = 4."""
    from shared.kernels.qmatmul.packed_matmul import default_rows_split

    pw = pack(random_raw(T.Q4_K, 32, 4096, seed=1), T.Q4_K, (32, 4096))
    assert default_rows_split(pw) == 4


def test_only_keeps_the_named_values() -> None:
    only = parse_only(["SPLIT_K=1", "SPLIT_K=2", "QX=0"])
    assert only == {"SPLIT_K": {1, 2}, "QX": {0}}
    kept = [t for t in rows_trials(4) if selected(t, only)]
    assert sorted(t["SPLIT_K"] for t in kept) == [1, 2] and not any(t["QX"] for t in kept)
    # a key a candidate lacks counts as 0
    assert [t for t in rows_trials(4) if selected(t, parse_only(["OUT_W=0"]))] == rows_trials(4)
    assert not [t for t in rows_trials(4) if selected(t, parse_only(["OUT_W=1"]))]
    with pytest.raises(SystemExit, match="KEY=INTEGER"):
        parse_only(["SPLIT_K"])
