"""Small host inputs of a step (token ids, positions, sampling parameters) moved to the device.

A pageable host->GPU copy blocks until the stream drains (i.e. the forward pass in flight);
staging through pinned memory and copying asynchronously keeps the CPU running ahead of the GPU.
Each copy still holds the stream for a few microseconds, so a step's integer inputs travel
together (``to_device_packed``): one buffer, one copy, views for each.

A kernel can also read pinned memory itself (it is mapped into the device's address space), so a
step whose only reader of its inputs is one kernel (``stage_inputs``, a CUDA graph's staging)
needs no copy at all: ``pack`` writes them into a buffer of a ``PinnedRing``, which hands a
buffer out again only once the stream has passed the point recorded after its reader.
"""

from __future__ import annotations

import torch

__all__ = ["PinnedRing", "pack", "to_device", "to_device_packed", "views"]

# every view starts 16 bytes into the buffer's multiple (its base is the allocator's, aligned
# wider): kernels are specialized on pointer alignment, so a view's offset must not change it
_ALIGN_BYTES = 16

Layout = list[tuple[int, int, torch.dtype]]  # (byte offset, elements, dtype) a part


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _padded(n: int, itemsize: int) -> int:
    per = _ALIGN_BYTES // itemsize
    return -(-n // per) * per


def pack(parts: list[tuple[list[int], torch.dtype]], into=None) -> tuple[torch.Tensor, Layout]:
    """Integer lists (int64 or int32 each) in one uint8 host buffer, each part 16-byte aligned:
    (the buffer, its layout for ``views``). into(nbytes): where the buffer comes from (a
    ``PinnedRing.take``), else a new pageable tensor."""
    layout, total = [], 0  # offsets in bytes
    for values, dtype in parts:
        layout.append((total, len(values), dtype))
        total += _padded(len(values), dtype.itemsize) * dtype.itemsize
    host = torch.zeros(total, dtype=torch.uint8) if into is None else into(total)
    for (values, dtype), (at, n, _) in zip(parts, layout, strict=True):
        if values:
            host[at : at + n * dtype.itemsize].view(dtype).copy_(torch.tensor(values, dtype=dtype))
    return host, layout


def views(buf: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The parts of a ``pack``ed buffer (or of its copy on a device) as 1-D tensors."""
    return [buf[at : at + n * dtype.itemsize].view(dtype) for at, n, dtype in layout]


def to_device_packed(
    parts: list[tuple[list[int], torch.dtype]], device: torch.device | str
) -> list[torch.Tensor]:
    """Integer lists (int64 or int32 each) as 1-D device tensors, in one host->device copy:
    views of one buffer, each contiguous and 16-byte aligned."""
    host, layout = pack(parts)
    return views(to_device(host, device), layout)


class PinnedRing:
    """A few pinned host buffers that kernels read in place, taken in turn. A buffer is handed
    out again only after the event recorded on the stream once its last reader was launched
    (``read``: a kernel of theirs, or a copy from them) has passed, so the host never rewrites
    inputs a queued reader has yet to read. Each ``take`` is followed by its ``read``."""

    def __init__(self, buffers: int = 4) -> None:
        self._bufs: list[torch.Tensor | None] = [None] * buffers
        self._done: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0
        self._taken: int | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of nbytes, free of readers (waits for the stream if not)."""
        i = self._next
        if (done := self._done[i]) is not None:
            done.synchronize()  # normally long past: the ring is deeper than the steps in flight
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[i] = torch.empty(max(nbytes, 4096), dtype=torch.uint8).pin_memory()
        self._done[i], self._taken = None, i
        self._next = (i + 1) % len(self._bufs)
        return buf[:nbytes]

    def read(self, event: torch.cuda.Event | None = None) -> None:
        """The last taken buffer's readers are launched on the current stream: record when the
        stream is past them (or take `event`, recorded there after them: one record fewer)."""
        if self._taken is not None:
            if event is None:
                event = torch.cuda.Event()
                event.record()
            self._done[self._taken], self._taken = event, None
