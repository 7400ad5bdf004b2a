"""A step's inputs staged into a graph's buffers in one launch (shared.kernels.stage_inputs):
the buffers a torch reference fills in (the real values, then the padding) for decode and mixed
steps, with tokens in flight taken from the previous step's output, and sizes that do not fit
refused. On the CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

from shared.engine.cuda_graphs import StepGraphs
from shared.kernels.stage_inputs import stage_inputs
from shared.kv import KVPool
from shared.model import ForwardBatch, SeqChunk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel needs a CUDA device or TRITON_INTERPRET=1 (CPU interpreter)",
)
_NAMES = ("token_ids", "positions", "slot_mapping", "block_tables", "query_start_loc", "seq_lens",
          "mixed_rows", "attn_splits")  # fmt: skip


def _graphs() -> StepGraphs:
    kv = KVPool(1, 64, 16, 2, 8, torch.float32, DEVICE)
    g = StepGraphs(None, kv, max_seqs=8, max_model_len=256, max_batch_tokens=128)
    for name in _NAMES:  # stale values of an earlier step, to be overwritten or padded
        getattr(g, name).copy_(torch.randint(-5, 99, getattr(g, name).shape))
    g._chunk_splits = lambda batch, b: 3  # (the model's attention rule: no model here)
    return g


def _batch(lengths: list[int], logits: str = "last", extra=()) -> ForwardBatch:
    chunks = [
        SeqChunk([7 + i] * n, 20 + i, list(range(i * 6 + 1, i * 6 + 5 + i % 2)), logits)
        for i, n in enumerate(lengths)
    ]
    return ForwardBatch.build(chunks, 16, DEVICE, extra)


def _after(g: StepGraphs, batch: ForwardBatch, fill=None) -> dict:
    kind, b = g._key(batch)
    s_pad = b if kind == "decode" else g.max_seqs
    g._stage(batch, kind, b, s_pad, fill)
    return {name: getattr(g, name).clone() for name in _NAMES}


def _reference(g: StepGraphs, batch: ForwardBatch) -> dict:
    """The buffers after the step's inputs go in, from g's (stale) ones: the real values, and
    padding tokens 0 at position 0 writing no slot, padding logits rows 0, padding sequences
    starting at the token count and empty; a mixed step's split count (3, _graphs)."""
    kind, b = g._key(batch)
    s_pad = b if kind == "decode" else g.max_seqs
    want = {name: getattr(g, name).clone() for name in _NAMES}
    n, seqs = batch.token_ids.shape[0], batch.seq_lens_t.shape[0]
    rows, w = batch.logits_rows.shape[0], batch.block_tables.shape[1]
    for name, src, pad in (("token_ids", batch.token_ids, 0), ("positions", batch.positions, 0),
                           ("slot_mapping", batch.slot_mapping, -1)):  # fmt: skip
        want[name][:n] = src
        want[name][n:b] = pad
    if kind == "mixed":
        want["mixed_rows"][:rows] = batch.logits_rows
        want["mixed_rows"][rows : g._rows(kind, b)] = 0
        want["attn_splits"].fill_(3)
    want["block_tables"][:seqs, :w] = batch.block_tables
    want["query_start_loc"][: seqs + 1] = batch.query_start_loc_t
    want["query_start_loc"][seqs + 1 : s_pad + 1] = n
    want["seq_lens"][:seqs] = batch.seq_lens_t
    want["seq_lens"][seqs:s_pad] = 0
    return want


@pytest.mark.parametrize(
    ("lengths", "logits"),
    [([1, 1, 1], "last"), ([1] * 8, "last"), ([1, 1, 30], "last"), ([1, 40, 30], "none"),
     ([4, 4], "all")],
)  # fmt: skip
def test_staged_inputs_equal_the_reference(lengths: list[int], logits: str) -> None:
    batch = _batch(lengths, logits)
    g = _graphs()
    want = _reference(g, batch)
    staged = _after(g, batch)
    for name in _NAMES:
        assert torch.equal(staged[name], want[name]), name


def test_tokens_in_flight_come_from_the_previous_output() -> None:
    prev = torch.tensor([500, 501, 502, 503], device=DEVICE)
    batch = _batch([1, 1, 1])
    fill_rows = torch.tensor([2, -1, 0], device=DEVICE)  # tokens 0 and 2 in flight
    g = _graphs()
    _after(g, batch, fill=(fill_rows, prev))
    assert g.token_ids[:3].tolist() == [502, 8, 500]
    assert g.positions[:3].tolist() == batch.positions.tolist()


def test_the_runner_fills_tokens_in_flight_through_the_staging(monkeypatch) -> None:
    """ModelRunner's per-token rows (batch.extra's tail) say which token takes which row."""
    from shared.engine.model_runner import ModelRunner

    seen = {}

    class _Fake:
        last_key = ("decode", 4)

        def fits(self, batch):
            return True

        def run(self, batch, fill=None):
            seen["fill"] = None if fill is None else fill[0].tolist()
            seen["ids"] = batch.token_ids.tolist()
            return torch.zeros(batch.logits_rows.shape[0], 4, device=DEVICE)

    class _Seq:
        def __init__(self, n, inflight, row):
            self.num_computed, self.num_tokens = n - 1, n
            self.num_inflight, self.inflight_row = inflight, row
            self.block_table, self.num_verifying, self.draft = [1, 2], 0, []
            self.params = self.prompt_ids = self.output_ids = self.generator = None
            self.constraint = None

        def token_slice(self, a, b):
            return [3] * (b - a)

    kv = KVPool(1, 64, 16, 2, 8, torch.float32, DEVICE)
    runner = ModelRunner(None, kv, DEVICE, graphs=_Fake())
    monkeypatch.setattr(runner.sampler, "sample", lambda *a, **k: None)
    prev = type("P", (), {"token_ids": torch.tensor([9, 8, 7], device=DEVICE)})()
    runner.run([(_Seq(5, 1, 2), 1), (_Seq(9, 0, 0), 1), (_Seq(7, 1, 0), 1)], prev)
    assert seen["fill"] == [2, -1, 0]
    assert seen["ids"] == [3, 3, 3]  # the host's ids: the staging fills in the rest


def test_sizes_that_do_not_fit_are_refused() -> None:
    g = _graphs()
    batch = _batch([1, 1, 1])
    src = {"token_ids": batch.token_ids, "positions": batch.positions,
           "slot_mapping": batch.slot_mapping, "block_tables": batch.block_tables,
           "query_start_loc": batch.query_start_loc_t, "seq_lens": batch.seq_lens_t,
           "logits_rows": batch.logits_rows}  # fmt: skip
    dst = {name: getattr(g, name) for name in _NAMES[:6]}
    dst |= {"logits_rows": g.mixed_rows, "attn_splits": g.attn_splits}
    with pytest.raises(ValueError, match="3 tokens, 3 sequences"):
        stage_inputs(src, dst, 2, 4)
    wide = dict(src, block_tables=torch.zeros(3, 99, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="block tables"):
        stage_inputs(wide, dst, 4, 4)
