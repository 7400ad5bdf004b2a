"""The split-K combine folded into the paged attention's launch (paged_attention: tickets): for
decode batches the last slice of each sequence's KV head combines the group's heads. It equals
the combine launch, rounds like it, leaves the counters zero, and is not used where it cannot
be (prompt chunks, too few counters, one slice). Helpers: tests/test_kernel_paged_attention.py
(interpreter on the CPU, native on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernel_paged_attention import (
    BF16,
    DEVICE,
    F32,
    TOL,
    assert_close,
    make_batch,
    pa,
    reference,
    run_kernel,
)


def tickets(n: int = 256) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=DEVICE)


@pytest.fixture
def combine_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the combine kernel's launches."""
    launched = []
    kernel = pa._combine_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(1)
            return kernel[grid]

    monkeypatch.setattr(pa, "_combine_splits_kernel", Spy())
    return launched


@pytest.mark.parametrize(
    ("group", "head_dim", "dtype", "splits"),
    [(4, 64, F32, 4), (3, 32, F32, 5), (1, 64, BF16, 16), (4, 64, BF16, 2)],
)
def test_folded_combine_matches_the_combine_launch(group, head_dim, dtype, splits,
                                                   combine_launches) -> None:  # fmt: skip
    """A decode batch (one sequence without a query, one shorter than the slices, one whose
    four key tiles fill 2 or 4 slices): the folded combine's rows equal the combine launch's up
    to summation order, and the reference."""
    q_lens, ctx = [1, 1, 0, 1], [255, 3, 9, 70]
    batch = make_batch(q_lens, ctx, group * 2, 2, head_dim, block_size=8, dtype=dtype)
    launched = run_kernel(batch, 0.125, num_splits=splits)
    assert len(combine_launches) == 1
    t = tickets()
    folded = run_kernel(batch, 0.125, num_splits=splits, tickets=t)
    assert len(combine_launches) == 1, "the folded launch launched the combine"
    assert not bool(t.any()), "the counters must be zero after the launch"
    rows = torch.tensor([0, 1, 2], device=DEVICE)  # the tokens (the empty sequence has none)
    tol = 1e-6 if dtype == F32 else 1e-2
    torch.testing.assert_close(folded[rows], launched[rows], rtol=tol, atol=tol)
    assert_close(folded, reference(batch, 0.125), TOL[dtype])
    again = run_kernel(batch, 0.125, num_splits=splits, tickets=t)  # the counters reused
    assert torch.equal(again, folded)


@pytest.mark.parametrize("layout", [(32, 8), (16, 16)])
def test_folded_combine_rounds_like_the_combine_launch(layout, combine_launches) -> None:
    """One decode token over static slices: the fold rounds the output row to int8 in the
    layout asked for, as the combine launch does (four key tiles, one a slice)."""
    batch = make_batch([1], [255], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    out, want = _int8(batch, layout, num_splits=4)
    t = tickets()
    folded, got = _int8(batch, layout, num_splits=4, tickets=t)
    assert len(combine_launches) == 1 and not bool(t.any())
    torch.testing.assert_close(folded, out, rtol=1e-6, atol=1e-6)
    (xq, xd, xs), (wq, wd, ws) = got[layout], want[layout]
    assert torch.equal(xq, wq)
    torch.testing.assert_close(xd, wd, rtol=1e-6, atol=0)
    torch.testing.assert_close(xs, ws, rtol=1e-5, atol=1e-5)


def test_folded_combine_with_the_count_read_on_the_device(combine_launches) -> None:
    batch = make_batch([1, 1], [90, 33], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    plain = run_kernel(batch, 0.125, num_splits=2)
    t = tickets()
    for used in (1, 2, 3):  # one slice: straight to the output, no ticket drawn
        count = torch.tensor([used], dtype=torch.int32, device=DEVICE)
        out = run_kernel(batch, 0.125, num_splits=4, num_splits_t=count, tickets=t)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        assert not bool(t.any())
    assert len(combine_launches) == 1  # plain's


def test_the_combine_launches_where_the_fold_does_not_apply(combine_launches) -> None:
    """Too few counters, a step with a prompt chunk, or _FOLD off: the combine launch, and the
    counters untouched."""
    decode = make_batch([1, 1], [90, 33], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    few = tickets(3)
    out = run_kernel(decode, 0.125, num_splits=4, tickets=few)
    assert len(combine_launches) == 1 and not bool(few.any())
    assert_close(out, reference(decode, 0.125), TOL[F32])
    chunk = make_batch([5, 1], [40, 20], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    run_kernel(chunk, 0.125, num_splits=2, tickets=tickets())
    assert len(combine_launches) == 2
    pa_fold = pa._FOLD
    try:
        pa._FOLD = False
        run_kernel(decode, 0.125, num_splits=4, tickets=tickets())
    finally:
        pa._FOLD = pa_fold
    assert len(combine_launches) == 3
    run_kernel(decode, 0.125, num_splits=1, tickets=tickets())  # one slice: nothing to combine
    assert len(combine_launches) == 3


def test_tickets_must_be_int32_on_the_device() -> None:
    batch = make_batch([1], [40], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    bad = torch.zeros(64, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="tickets must be contiguous int32"):
        run_kernel(batch, 0.125, num_splits=2, tickets=bad)


def test_the_ops_backend_keeps_counters_for_decode_steps() -> None:
    """TritonOps hands decode attention one zeroed buffer, grown when a batch needs more, the
    older ones kept (CUDA graphs captured on them)."""
    from shared.model.ops_backend import TritonOps

    ops, dev = TritonOps(), torch.device(DEVICE)
    first = ops._attention_tickets(dev, 8)
    assert first.dtype == torch.int32 and first.numel() >= 16 and not bool(first.any())
    assert ops._attention_tickets(dev, 8) is first
    big = ops._attention_tickets(dev, first.numel())  # needs twice as many
    assert big is not first and big.numel() >= 2 * first.numel()
    assert ops._tickets[dev] == [first, big]


def _int8(batch, layout, **kw):
    i32 = {"dtype": torch.int32, "device": batch.q.device}
    return pa.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
        torch.tensor(batch.query_start_loc, **i32), torch.tensor(batch.seq_lens, **i32), 0.125,
        max_query_len=1, int8_layout=layout, **kw,
    )  # fmt: skip
