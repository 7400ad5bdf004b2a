"""The attention probe: records cut into launches and layers (CPU), and the kernels' records
on a GPU (the probe reads PTX timers: not under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import probe
from tools import probe_attention as pa_probe


def _record(start, wait, walked, end, kind, grid, sm=0):
    r = torch.zeros(probe.RECORD, dtype=torch.int64)
    r[:4] = torch.tensor([start, wait, walked, end])
    r[4:8] = r[:4] * 2  # cycles at 2 GHz
    r[pa_probe.SM], r[pa_probe.GRID], r[pa_probe.KIND] = sm, grid, kind
    r[pa_probe.T_Q] = wait + 400 if kind == 1 else 0  # the queries came 0.4 us after the wait
    return r


def _layer(t0: int) -> list[torch.Tensor]:
    """One decode layer: 4 attention programs (one with nothing to do), then 2 combine ones."""
    a = [
        _record(t0 - 3000, t0, t0 + 2000, t0 + 2500, 1, 4, sm=0),
        _record(t0 - 1000, t0 + 100, t0 + 2200, t0 + 2600, 1, 4, sm=1),
        _record(t0 + 500, t0 + 600, t0 + 3000, t0 + 3100, 1, 4, sm=2),
        _record(t0 - 500, t0 + 50, t0 + 50, t0 + 50, 0, 4, sm=3),
    ]
    c = [_record(t0 + 1000, t0 + 3300, t0 + 4000, t0 + 4000, 2, 2, sm=k) for k in (0, 1)]
    return a + c


def test_layers_are_timed_from_the_first_wait_return():
    prefill = [_record(0, 10, 20, 30, 1, 2), _record(0, 10, 25, 35, 1, 2)]
    rec = torch.stack(prefill + _layer(100_000) + _layer(200_000))
    kinds = [k for k, _ in pa_probe.launches(rec)]
    assert kinds == ["attention", "attention", "combine", "attention", "combine"]
    found = pa_probe.layers(rec, 4)
    assert len(found) == 2
    f = found[0]
    assert f["attention first start"] == -3.0
    assert f["attention last start"] == 0.5
    assert f["started after w0 (share)"] == 0.25
    assert f["attention last wait return"] == 0.6
    assert f["queries came (median)"] == 0.5 and f["queries came (last)"] == 1.0
    assert f["keys walked (last)"] == 3.0
    assert f["attention last end"] == 3.1
    assert f["combine first wait return"] == 3.3
    assert f["combine last end"] == 4.0
    assert f["attention SMs"] == 4 and f["live programs"] == 3
    # walked - wait in cycles (2 per ns here) over 1.98 GHz: 2000, 2100, 2400 ns -> median 2100
    assert f["wait to walked, cycles (median, µs)"] == pytest.approx(2 * 2100 / 1.98e3)
    assert "2 decode layers" in pa_probe.table(found)


def test_a_mixed_launch_is_an_error_and_a_full_buffer_is_not():
    rec = torch.stack(_layer(100_000)[:3] + _layer(200_000)[4:])
    with pytest.raises(ValueError, match="not one whole attention launch"):
        pa_probe.launches(rec)
    full = torch.stack(_layer(100_000) + _layer(200_000)[:3])  # the second launch cut short
    assert [k for k, _ in pa_probe.launches(full)] == ["attention", "combine"]


def test_records_are_read_up_to_the_capacity():
    buf = probe.new_buffer(2, "cpu")
    buf[0] = 5  # five programs asked for a slot; two fit
    buf[probe.RECORD : 3 * probe.RECORD] = torch.arange(2 * probe.RECORD)
    rec = probe.records(buf)
    assert rec.shape == (2, probe.RECORD) and int(rec[1, 0]) == probe.RECORD


@pytest.mark.gpu
def test_probed_decode_attention_records_every_program_and_changes_nothing():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from shared.kernels.paged_attention import paged_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bs, n_kv, hd, ctx = 16, 8, 128, 600
    blocks = ctx // bs + 2
    k = torch.randn(blocks, bs, n_kv, hd, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, bs, n_kv, hd, device=dev, generator=g).to(torch.bfloat16)
    q = torch.randn(1, 4 * n_kv, hd, device=dev, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, device=dev, generator=g).to(torch.int32)[None]
    starts = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    args = (q, k, v, table, starts, lens, hd**-0.5)
    kw = {"max_query_len": 1, "max_seq_len": ctx, "num_splits": 16}
    plain = paged_attention(*args, **kw)
    buf = probe.new_buffer(1024, dev)
    probed = paged_attention(*args, **kw, probe=buf)
    torch.cuda.synchronize()
    assert torch.equal(plain, probed)
    rec = probe.records(buf)
    kinds = [(kind, rows.shape[0]) for kind, rows in pa_probe.launches(rec)]
    assert kinds == [("attention", 8 * 16), ("combine", 32)]
    times = rec[:, :4]
    assert bool((times[:, 1:] >= times[:, :-1]).all()), "points out of order"
    live = rec[rec[:, pa_probe.KIND] == 1]
    came = live[:, pa_probe.T_Q]
    assert bool(((came >= live[:, 1]) & (came <= live[:, 2])).all()), "queries outside the walk"
    # a split count fixed at launch: every slice computes (slices 10-15 over no keys)
    assert bool((rec[: 8 * 16, pa_probe.KIND] == 1).all())
    found = pa_probe.layers(rec, 8 * 16)
    assert len(found) == 1 and found[0]["combine last end"] > found[0]["attention last end"]
    # a count read on the device (the decode graphs'): slices past it return early, marked 0
    buf = probe.new_buffer(1024, dev)
    splits_t = torch.tensor([10], dtype=torch.int32, device=dev)
    dyn = paged_attention(*args, **kw, num_splits_t=splits_t, probe=buf)
    torch.cuda.synchronize()
    torch.testing.assert_close(dyn, plain, rtol=0, atol=2e-2)
    kinds = probe.records(buf)[: 8 * 16, pa_probe.KIND]
    assert int((kinds == 1).sum()) == 8 * 10 and int((kinds == 0).sum()) == 8 * 6


def test_the_probe_counts_from_the_measured_run(monkeypatch):
    import tools.bench_w1 as w1

    buf = probe.new_buffer(4, "cpu")
    seen = []

    def run(*args, **kw):
        seen.append(int(buf[0]))
        buf[0] += 3  # the run's programs took slots
        return 1.0, 2.0

    monkeypatch.setattr(w1, "run_once", run)
    with pa_probe._measured_run_only(buf):
        assert w1.run_once() == (1.0, 2.0)  # the warm-up: counted on
        w1.run_once()  # the measured run: from zero
    assert seen == [0, 0] and int(buf[0]) == 3 and w1.run_once is run
