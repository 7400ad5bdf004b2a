"""In-kernel timestamps: where a program's time goes inside a chain of launches (PDL), which a
profiler's kernel spans do not show (it sees one span a launch, not when each program started,
passed `wait_prev` or finished).

A kernel compiled with its PROBE flag reads the GPU's nanosecond timer (``%globaltimer``, one
clock for every SM) and its SM's cycle counter at a few points and appends one record a program
to a probe buffer (`new_buffer`): ``RECORD`` int64 words, the first ``TIMES`` of them the
points' global times, then as many cycle counts, then the caller's words (program ids, SM).
Word 0 of the buffer counts the records taken, word 1 holds its capacity; records start at
word ``RECORD``. A program takes its slot when it writes, after its last point, so the records
of one launch in a chain come before those of the next. NVIDIA GPUs only (inline PTX); never
under the interpreter. ``tools/probe_attention.py`` reads the decode attention's records.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RECORD = 16  # int64 words a record (write_record's offsets: 4 times, 4 cycle counts, 8 words)
TIMES = 4  # points a record: global times, then the same points' SM cycle counts
_RECORD = tl.constexpr(RECORD)

__all__ = ["RECORD", "TIMES", "new_buffer", "now", "now_each", "records", "sm_id", "write_record"]


@triton.jit
def now(dep):
    """(global ns, SM cycles) read once `dep` (an int32 scalar) is computed."""
    t = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1
    )
    c = tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1
    )
    return t, c


@triton.jit
def now_each(dep):
    """Global ns read by each element once it (an int32 tensor: a load's values) is there."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def sm_id(dep):
    """The program's SM, read once `dep` (an int32 scalar) is computed."""
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def write_record(probe_ptr, t0, t1, t2, t3, c0, c1, c2, c3, w0, w1, w2, w3, w4, w5, w6, w7):
    """Append one record (four times, their cycle counts, eight words of the caller's)."""
    slot = tl.atomic_add(probe_ptr, 1).to(tl.int64)
    if slot < tl.load(probe_ptr + 1):
        r = probe_ptr + (slot + 1) * _RECORD
        tl.store(r + 0, t0)
        tl.store(r + 1, t1)
        tl.store(r + 2, t2)
        tl.store(r + 3, t3)
        tl.store(r + 4, c0)
        tl.store(r + 5, c1)
        tl.store(r + 6, c2)
        tl.store(r + 7, c3)
        tl.store(r + 8, tl.cast(w0, tl.int64))
        tl.store(r + 9, tl.cast(w1, tl.int64))
        tl.store(r + 10, tl.cast(w2, tl.int64))
        tl.store(r + 11, tl.cast(w3, tl.int64))
        tl.store(r + 12, tl.cast(w4, tl.int64))
        tl.store(r + 13, tl.cast(w5, tl.int64))
        tl.store(r + 14, tl.cast(w6, tl.int64))
        tl.store(r + 15, tl.cast(w7, tl.int64))


def new_buffer(capacity: int, device: torch.device | str) -> torch.Tensor:
    """A probe buffer for `capacity` records: zero records taken."""
    buf = torch.zeros((capacity + 1) * RECORD, dtype=torch.int64, device=device)
    buf[1] = capacity
    return buf


def records(buf: torch.Tensor) -> torch.Tensor:
    """The records taken, [n, RECORD] int64 on the CPU, in the order their programs wrote."""
    host = buf.cpu()
    n = min(int(host[0]), int(host[1]))
    return host[RECORD : (n + 1) * RECORD].view(n, RECORD)
