"""Which steps replay a captured CUDA graph, and at which padded size (no GPU needed: the
bucket choice is host logic; tests/test_gpu_model.py replays the graphs on a device)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.cuda_graphs import (
    BUCKETS,
    DecodeGraph,
    StepGraphs,
    decode_buckets,
    decode_graphs,
    mixed_buckets,
    pick_decode_graph,
)
from shared.kv import KVPool
from shared.model import ForwardBatch, SeqChunk


def test_mixed_buckets_reach_the_token_budget() -> None:
    assert mixed_buckets(0) == []
    assert mixed_buckets(512) == [64, 96, 128, 160, 192, 256, 320, 384, 448, 512]
    assert mixed_buckets(100) == [64, 96, 128]
    assert mixed_buckets(3000)[-3:] == [1536, 2048, 3008]
    assert mixed_buckets(10) == [64]


def test_decode_buckets_are_captured_at_the_split_counts_of_short_contexts() -> None:
    """Llama-3-8B's 8 KV heads on 132 SMs, bf16 cache: batch 1 at 512 / 1024 keys wants 16 /
    32 slices of 32-key tiles, at 4096 32 of 64 keys and at 32k 32 of 128 keys (a graph each);
    batch 2 wants 8 / 16 / 16 of 64 keys and 16 of 128 keys; batch 64 one slice of either."""

    def slices(b: int, max_model_len: int, dtype=torch.bfloat16) -> list[tuple[int, int]]:
        return [
            (g.splits, g.tile_keys) for g in decode_graphs(b, 8, max_model_len, 132, 128, dtype)
        ]

    assert slices(1, 32768) == [(16, 32), (32, 32), (32, 64), (32, 128)]
    assert slices(2, 32768) == [(8, 64), (16, 64), (16, 128)]
    assert slices(4, 32768) == [(8, 64), (8, 128)]
    assert slices(64, 32768) == [(1, 64), (1, 128)]
    assert slices(1, 4096) == [(16, 32), (32, 32), (32, 64)]  # no long context
    assert slices(1, 256) == [(8, 32)]  # no context above max_model_len
    assert slices(1, 32768, torch.float32) == [(8, 64), (16, 64), (32, 64)]
    assert slices(2, 1024) == [(8, 64), (16, 64)]
    # a graph is captured at the shortest context of its (slices, tile)
    assert [g.context for g in decode_graphs(1, 8, 32768, 132)] == [512, 1024, 4096, 32768]
    graphs = [DecodeGraph(n, 64, 0) for n in (8, 16, 32)] + [DecodeGraph(32, 128, 0)]
    picks = [pick_decode_graph(graphs, n, 64) for n in (1, 8, 9, 16, 17, 32, 40)]
    assert [(g.splits, g.tile_keys) for g in picks] == [
        (8, 64), (8, 64), (16, 64), (16, 64), (32, 64), (32, 64), (32, 64),
    ]  # fmt: skip
    assert pick_decode_graph(graphs, 32, 128) == graphs[3]
    assert pick_decode_graph(graphs, 9, 128) == graphs[3]  # the only graph of that tile
    assert pick_decode_graph(graphs[:3], 32, 128) == graphs[2]  # no graph of it: any tile
    assert pick_decode_graph([DecodeGraph(1, 64, 0)], 2, 64).splits == 1


def _graphs(max_batch_tokens: int) -> StepGraphs:
    kv = KVPool(1, 64, 16, 2, 8, torch.float32, "cpu")
    return StepGraphs(None, kv, max_seqs=8, max_model_len=256, max_batch_tokens=max_batch_tokens)


def _batch(lengths: list[int], logits: str = "last", start: int = 20) -> ForwardBatch:
    chunks = [
        SeqChunk(list(range(n)), start, list(range(i * 6, i * 6 + 6)), logits)
        for i, n in enumerate(lengths)
    ]
    return ForwardBatch.build(chunks, 16, "cpu")


@pytest.mark.parametrize(
    ("lengths", "logits", "key"),
    [
        ([1, 1, 1], "last", ("decode", 4)),  # three decodes: bucket 4
        ([1] * 8, "last", ("decode", 8)),
        ([1, 1, 30], "last", ("mixed", 64)),  # decodes beside a prompt chunk
        ([1, 40, 30], "none", ("mixed", 96)),  # 71 tokens, no logits for the chunks
        ([1, 40, 60], "none", ("mixed", 128)),
        ([1, 1], "none", ("mixed", 64)),  # single tokens without logits are not decodes
        ([30, 30, 30, 30, 30], "last", None),  # 150 tokens: above the largest bucket
        ([4, 4], "all", ("mixed", 64)),  # 8 logits rows fit min(64, max_seqs = 8)
        ([8, 8], "all", None),  # 16 logits rows do not
    ],
)
def test_steps_pick_the_next_bucket(lengths, logits, key) -> None:
    g = _graphs(128)
    assert g._key(_batch(lengths, logits)) == key
    assert g.fits(_batch(lengths, logits)) == (key is not None)


def test_without_mixed_buckets_only_decodes_fit() -> None:
    g = _graphs(0)
    assert g.fits(_batch([1, 1]))
    assert not g.fits(_batch([1, 5]))
    assert g._key(_batch([1] * 8)) == ("decode", 8)


def test_decode_buckets_end_at_max_seqs() -> None:
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(10) == [1, 2, 4, 8, 10]
    assert decode_buckets(1) == decode_buckets(0) == [1]
    assert decode_buckets(1000) == list(BUCKETS)  # none above the largest bucket
    kv = KVPool(1, 64, 16, 2, 8, torch.float32, "cpu")
    g = StepGraphs(None, kv, max_seqs=3, max_model_len=256)
    assert g._key(_batch([1, 1, 1])) == ("decode", 3)  # was no graph: bucket 2 was the last
    assert g._key(_batch([1, 1])) == ("decode", 2)


def test_more_sequences_than_captured_run_eagerly() -> None:
    g = _graphs(128)
    assert not g.fits(_batch([1] * 9))  # 9 decodes > max_seqs 8 (buckets stop at 8)
    assert not g.fits(_batch([1] * 7 + [3, 3]))


class _Graphs:
    """Stands in for StepGraphs: capture fails for the token counts in `fails`."""

    def __init__(self, tokens: int, fails: set[int]) -> None:
        self.tokens, self.fails = tokens, fails

    def capture(self) -> None:
        if self.tokens in self.fails:
            raise RuntimeError(f"capture of {self.tokens} failed")


@pytest.mark.parametrize(
    ("fails", "kept"), [(set(), 512), ({512}, 0), ({512, 0}, None)], ids=["all", "decode", "none"]
)
def test_a_failed_capture_falls_back(fails: set[int], kept: int | None, caplog) -> None:
    from shared.engine.cuda_graphs import capture_graphs

    graphs = capture_graphs(lambda tokens: _Graphs(tokens, fails), 512)
    assert (graphs.tokens if graphs else None) == kept
    assert ("failed" in caplog.text) == bool(fails)
