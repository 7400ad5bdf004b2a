"""Which steps replay a captured CUDA graph, and at which padded size (no GPU needed: the
bucket choice is host logic; tests/test_gpu_model.py replays the graphs on a device)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.cuda_graphs import (
    StepGraphs,
    decode_split_counts,
    mixed_buckets,
    pick_split_count,
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
    """Llama-3-8B's 8 KV heads on 132 SMs: batch 1 at 512 / 1024 / 32k keys wants 8 / 16 / 32
    slices, batch 2 wants 8 / 16 / 16, batch 4 always 8."""
    assert decode_split_counts(1, 8, 32768, 132) == [8, 16, 32]
    assert decode_split_counts(2, 8, 32768, 132) == [8, 16]
    assert decode_split_counts(4, 8, 32768, 132) == [8]
    assert decode_split_counts(64, 8, 32768, 132) == [1]
    assert decode_split_counts(1, 8, 256, 132) == [4]  # no context above max_model_len
    counts = [8, 16, 32]
    assert [pick_split_count(counts, n) for n in (1, 8, 9, 16, 17, 32, 40)] == [
        8, 8, 16, 16, 32, 32, 32,
    ]  # fmt: skip
    assert pick_split_count([1], 2) == 1


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
    from shared.engine.factory import capture_graphs

    graphs = capture_graphs(lambda tokens: _Graphs(tokens, fails), 512)
    assert (graphs.tokens if graphs else None) == kept
    assert ("failed" in caplog.text) == bool(fails)
