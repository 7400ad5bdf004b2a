"""The split-K combine inside a decode batch's attention kernel (``tickets``: the last slice's
program of each KV head sums the slices, ``paged_attention_combine.combine_in_last``): the
same outputs as the combine pass launched apart, its int8 rounding the same codes, the
counters back at zero after every launch, the count read on the device too; steps it does
not take (no or too few counters, prompt chunks, one slice) keep the separate pass. Helpers
and the interpreter / GPU selection: tests/test_kernel_paged_attention.py."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernel_paged_attention import DEVICE, F32, make_batch, pa, reference

BF16 = torch.bfloat16


class _Counted:
    """Stands in for the combine kernel: counts its launches, then runs it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def combine_launches(monkeypatch: pytest.MonkeyPatch) -> _Counted:
    counted = _Counted(pa._combine_splits_kernel)
    monkeypatch.setattr(pa, "_combine_splits_kernel", counted)
    return counted


def _run(batch, splits: int, tickets=None, layout=None, **kw):
    i32 = {"dtype": torch.int32, "device": batch.q.device}
    return pa.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
        torch.tensor(batch.query_start_loc, **i32), torch.tensor(batch.seq_lens, **i32), 0.125,
        max_query_len=batch.max_query_len, num_splits=splits, tickets=tickets,
        int8_layout=layout, **kw,
    )  # fmt: skip


def _tickets(n: int = 256) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    ("heads", "dtype", "splits"),
    [((8, 2), F32, 4), ((6, 2), F32, 16), ((8, 1), BF16, 3)],
    ids=["group4-f32", "group3-16-slices", "group8-bf16"],
)
def test_fused_combine_matches_the_separate_pass(
    heads: tuple[int, int], dtype: torch.dtype, splits: int, combine_launches: _Counted
) -> None:
    batch = make_batch([1, 1, 1], [300, 40, 129], *heads, head_dim=64, block_size=8)
    batch.q, batch.k_cache, batch.v_cache = (
        t.to(dtype) for t in (batch.q, batch.k_cache, batch.v_cache)
    )
    apart = _run(batch, splits)
    assert combine_launches.launches == 1
    tickets = _tickets()
    for _ in range(2):  # the counters are zero again for the next launch (the next layer)
        fused = _run(batch, splits, tickets)
        assert combine_launches.launches == 1  # no launch of its own
        assert not tickets.any()
        torch.testing.assert_close(fused, apart, rtol=1e-6, atol=1e-6 if dtype == F32 else 1e-2)
    if dtype == F32:
        torch.testing.assert_close(fused, reference(batch, 0.125), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [(32, 8), (16, 16)])
def test_fused_combine_rounds_for_the_next_gemv(layout: tuple[int, int]) -> None:
    batch = make_batch([1], [300], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    out, rounded = _run(batch, 4, _tickets(), layout)
    want_out, want = _run(batch, 4, None, layout)
    assert set(rounded) == set(want) == {layout}
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    if torch.equal(out, want_out):  # the same row: the same codes
        xq, xd, xs = rounded[layout]
        assert torch.equal(xq, want[layout][0]) and torch.equal(xd, want[layout][1])
        torch.testing.assert_close(xs, want[layout][2], rtol=1e-6, atol=1e-6)


def test_fused_combine_reads_the_count_on_the_device(combine_launches: _Counted) -> None:
    batch = make_batch([1, 1], [300, 77], n_heads=4, n_kv_heads=2, head_dim=64, block_size=8)
    tickets = _tickets()
    for used in (2, 4, 1):  # 1: the kernel writes the output itself, no ticket is drawn
        t = torch.tensor([used], dtype=torch.int32, device=DEVICE)
        fused = _run(batch, 4, tickets, num_splits_t=t)
        assert not tickets.any()
        torch.testing.assert_close(fused, _run(batch, used), rtol=1e-6, atol=1e-6)
    assert combine_launches.launches == 2  # only the references with 2 and 4 slices


def test_steps_it_does_not_take_keep_the_separate_pass(combine_launches: _Counted) -> None:
    decode = make_batch([1, 1], [300, 77], n_heads=4, n_kv_heads=2, head_dim=64, block_size=8)
    _run(decode, 4, _tickets(3))  # 2 x 2 (or more) programs, 3 counters
    assert combine_launches.launches == 1
    chunk = make_batch([3, 1], [70, 33], n_heads=4, n_kv_heads=2, head_dim=64, block_size=8)
    tickets = _tickets()
    torch.testing.assert_close(_run(chunk, 4, tickets), reference(chunk, 0.125), rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    assert combine_launches.launches == 2 and not tickets.any()
    _run(decode, 1, tickets)  # one slice: nothing to combine
    assert combine_launches.launches == 2
