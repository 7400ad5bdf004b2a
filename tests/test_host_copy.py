"""shared.kernels.host_copy and shared.staging.PinnedRing: a step's ids stored into pinned memory
by a kernel, and pinned buffers handed out again only once their readers have run."""

from __future__ import annotations

import os

import pytest
import torch

from shared.kernels.host_copy import copy_to_host
from shared.staging import PinnedRing

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("n", [1, 7, 1500])
def test_copy_to_host_copies_every_value(n: int) -> None:
    """Under the interpreter host to host; on a GPU the device's values into pinned memory."""
    src = torch.randint(-(1 << 40), 1 << 40, (n,), dtype=torch.int64)
    dst = torch.full((n,), -1, dtype=torch.int64)
    dst = dst.pin_memory() if CUDA else dst
    assert copy_to_host(src.cuda() if CUDA else src, dst) is dst
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(dst, src)


def test_copy_to_host_refuses_mismatched_tensors() -> None:
    src = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="into"):
        copy_to_host(src, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="into"):
        copy_to_host(src, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        copy_to_host(torch.zeros(8, dtype=torch.int64)[::2], torch.zeros(4, dtype=torch.int64))


@pytest.mark.gpu
def test_copy_to_host_stores_device_values_into_pinned_memory() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    src = torch.arange(300, device="cuda", dtype=torch.int64) * 3 - 7
    dst = torch.zeros(300, dtype=torch.int64).pin_memory()
    copy_to_host(src, dst)
    torch.cuda.synchronize()
    assert dst.tolist() == [i * 3 - 7 for i in range(300)]
    with pytest.raises(ValueError, match="pinned"):
        copy_to_host(src, torch.zeros(300, dtype=torch.int64))


@pytest.mark.gpu
def test_pinned_ring_waits_for_a_buffers_reader_before_handing_it_out() -> None:
    """Four buffers: the fifth take is the first one's again, and returns only once the stream
    has passed the point recorded after that buffer's reader (here a kernel that sleeps)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ring = PinnedRing(4)
    first = ring.take(64)
    assert first.is_pinned() and first.numel() == 64
    torch.cuda._sleep(200_000_000)  # about 0.1 s of the stream before the reader's mark
    ring.read()
    mark = ring._done[0]
    for _ in range(3):
        ring.take(64)
        ring.read()
    assert not mark.query()  # the stream is still sleeping
    again = ring.take(32)
    assert mark.query() and again.data_ptr() == first.data_ptr()
    ring.read()
    big = ring.take(1 << 16)  # a larger request than the buffer held: a new one
    assert big.numel() == 1 << 16 and big.is_pinned()
    torch.cuda.synchronize()
