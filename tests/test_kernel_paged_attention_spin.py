"""The decode combine that waits for counted slices (paged_attention._SPIN, tickets): the same
bits as the combine that waits for the attention launch's end, the counters zero again after
every launch (so the next launch, or the next layer's, can count from zero), and the cases
that keep the plain wait. Under the interpreter the launches run one after the other; on an
H200 the combine's programs start early (gdc) and really spin. Helpers:
tests/test_kernel_paged_attention.py."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.test_kernel_paged_attention import DEVICE, make_batch, pa, run_kernel

I32 = {"dtype": torch.int32, "device": DEVICE}


@pytest.fixture
def spin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa, "_SPIN", True)


def _decode(seqs: int = 3, seed: int = 0):
    lens = [300, 41, 97, 180][:seqs]
    return make_batch([1] * seqs, lens, n_heads=8, n_kv_heads=2, head_dim=64, block_size=8,
                      seed=seed)  # fmt: skip


def _int8(batch, layout, **kw):
    return pa.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
        torch.tensor(batch.query_start_loc, **I32), torch.tensor(batch.seq_lens, **I32), 0.125,
        max_query_len=1, int8_layout=layout, **kw,
    )  # fmt: skip


@pytest.mark.usefixtures("spin")
@pytest.mark.parametrize("splits", [2, 5])
def test_counted_slices_give_the_same_bits_and_leave_zero(splits: int) -> None:
    batch = _decode()
    want = run_kernel(batch, 0.125, num_splits=splits)  # no tickets: the plain wait
    tickets = torch.zeros(64, **I32)
    for _ in range(3):  # each launch counts from the zero the one before left
        got = run_kernel(batch, 0.125, num_splits=splits, tickets=tickets)
        assert torch.equal(got, want)
        assert not tickets.any()
    # the counts themselves: from an offset the reset never comes, so (token 1, KV head 0)
    # ends at offset + its slices + the group's heads counted past the wait (4 a KV head)
    tickets[2] = 100
    run_kernel(batch, 0.125, num_splits=splits, tickets=tickets)
    assert tickets[2].item() == 100 + splits + 4
    tickets[2] = 0
    assert not tickets.any()


@pytest.mark.usefixtures("spin")
def test_counted_slices_with_a_device_count() -> None:
    """A count read on the device (CUDA graphs): the slices past it neither store nor count;
    a count of one writes the output in the attention launch and leaves the counters alone."""
    batch = _decode(2, seed=1)
    tickets = torch.zeros(16, **I32)
    for used in (3, 1):
        t = torch.tensor([used], **I32)
        want = run_kernel(batch, 0.125, num_splits=4, num_splits_t=t)
        got = run_kernel(batch, 0.125, num_splits=4, num_splits_t=t, tickets=tickets)
        assert torch.equal(got, want)
        assert not tickets.any()


@pytest.mark.usefixtures("spin")
def test_counted_slices_round_for_the_next_gemv() -> None:
    batch = _decode(1, seed=2)
    out, rounded = _int8(batch, (32, 8), num_splits=4)
    tickets = torch.zeros(8, **I32)
    out2, rounded2 = _int8(batch, (32, 8), num_splits=4, tickets=tickets)
    assert torch.equal(out2, out)
    for a, b in zip(rounded[(32, 8)], rounded2[(32, 8)], strict=True):
        assert torch.equal(a, b)
    assert not tickets.any()


def test_which_launches_count(monkeypatch: pytest.MonkeyPatch) -> None:
    tickets = torch.zeros(8, **I32)
    dev = tickets.device
    assert not pa._spins(tickets, dev, 4, 1, 8)  # _SPIN off: the plain wait
    monkeypatch.setattr(pa, "_SPIN", True)
    assert pa._spins(tickets, dev, 4, 1, 8)
    assert not pa._spins(None, dev, 4, 1, 8)
    assert not pa._spins(tickets, dev, 1, 1, 8)  # one slice: no combine
    assert not pa._spins(tickets, dev, 4, 16, 8)  # prompt chunks keep the plain wait
    with pytest.raises(ValueError, match="9 \\(token, KV head\\)"):
        pa._spins(tickets, dev, 4, 1, 9)
    with pytest.raises(ValueError, match="int32"):
        pa._spins(tickets.long(), dev, 4, 1, 8)


def test_the_ops_backend_keeps_counters_only_when_spinning(monkeypatch: pytest.MonkeyPatch):
    from shared.model.ops_backend import TritonOps

    ops = TritonOps()
    dev = torch.device(DEVICE)
    assert ops._attention_tickets(dev, 8) is None
    monkeypatch.setattr(pa, "_SPIN", True)
    first = ops._attention_tickets(dev, 8)
    assert first is not None and first.dtype == torch.int32 and not first.any()
    assert ops._attention_tickets(dev, 64) is first  # big enough: shared by every layer
    bigger = ops._attention_tickets(dev, first.numel() + 1)
    assert bigger is not first and bigger.numel() >= first.numel() + 1


@pytest.mark.usefixtures("spin")
def test_padding_tokens_do_not_wait() -> None:
    """A CUDA graph's bucket past the batch: the last token belongs to no sequence (and the
    last sequence is empty), so no slice counts for it; at capture no sequence has a query.
    The combine must not wait for those (it waited forever on the H200 before, in W1)."""
    batch = _decode(2, seed=3)
    tickets = torch.zeros(16, **I32)
    q = torch.cat([batch.q, batch.q[:1]])  # token 2: padding
    starts = torch.tensor([0, 1, 2, 2], **I32)  # sequence 2: padding, no query
    lens = torch.tensor([*batch.seq_lens, 0], **I32)
    table = torch.cat([batch.block_tables, batch.block_tables[:1]])
    done = {}

    def run(starts, lens):
        done["out"] = pa.paged_attention(
            q, batch.k_cache, batch.v_cache, table, starts, lens, 0.125, max_query_len=1,
            num_splits=4, tickets=tickets,
        )  # fmt: skip
        if DEVICE == "cuda":  # on a GPU the wait is the synchronize
            torch.cuda.synchronize()

    for args in ((starts, lens), (torch.zeros_like(starts), torch.zeros_like(lens))):
        done.clear()
        worker = threading.Thread(target=run, args=args, daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert "out" in done, "the combine waited for a padding token's slices"
        assert not tickets.any()
    real = run_kernel(batch, 0.125, num_splits=4)
    run(starts, lens)
    assert torch.equal(done["out"][:2], real)
