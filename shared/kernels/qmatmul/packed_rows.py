"""Row-interleaved planes: a packed weight (``packed``) with 32 rows' entries side by side.

In the packed layout a row's entries are contiguous, so a GEMV that gives each thread a row
(one activation load serves the whole warp) has its 32 threads read 32 rows at once: every
128-bit load touches 32 lines, and on the H200 (BENCHMARKS.md 2026-11-30 (r)) each sector
came from L2 twice. Interleaved, the rows of a tile of 32 take turns by ``unit`` entries::

    plane [N, E] with unit U  ->  [ceil(N / 32), E / U, 32, U]   (rows past N zero)
    entry (r, e) at  (r // 32) * 32 * E  +  ((e // U) * 32 + r % 32) * U  +  e % U

so a warp's load of one unit per row reads ``32 * U`` contiguous entries. Units: four words
of the quants (16 bytes) and the matching four high-bit entries; a chunk's entries of each
scale plane (``sc``/``mn`` bytes, ``d``/``m`` halves), one entry where a plane has one per
256 elements or fewer. The planes keep their ``[rows, E]`` shape (rows padded to a multiple
of 32), so ``stride(0)`` is still the entries a row; only the address of an entry changes.
The values are the packed weight's: ``deinterleave`` returns it exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from shared.kernels.qmatmul.layout import CHUNK, ROWS, ROWS_TYPES, PackedWeight

__all__ = ["deinterleave", "interleave", "unit", "wants_rows"]

_QUANT_UNIT = 4  # entries of q (int32 words) and hi a warp's thread loads at once
_QUANT_PLANES = ("q", "hi")
_SCALE_PLANES = ("sc", "mn", "d", "dmin")


def wants_rows(qtype: int) -> bool:
    """Whether a CUDA layer of this type keeps its planes interleaved (batch 1 then runs the
    rows GEMV; everything else reads either layout)."""
    return qtype in ROWS_TYPES


def unit(pw: PackedWeight, name: str) -> int:
    """Entries of plane `name` a row keeps together in pw's interleaved layout."""
    if name in _QUANT_PLANES:
        return _QUANT_UNIT
    chunks = pw.shape[1] // CHUNK[pw.qtype]
    return max(1, getattr(pw, name).shape[1] // chunks)


def _interleave(t: torch.Tensor, n: int, u: int) -> torch.Tensor:
    e = t.shape[1]
    pad = -n % ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, e)])
    tiles = t.shape[0] // ROWS
    return t.reshape(tiles, ROWS, e // u, u).transpose(1, 2).contiguous().reshape(-1, e)


def _deinterleave(t: torch.Tensor, n: int, u: int) -> torch.Tensor:
    e = t.shape[1]
    tiles = t.shape[0] // ROWS
    return t.reshape(tiles, e // u, ROWS, u).transpose(1, 2).reshape(-1, e)[:n].contiguous()


def _relaid(pw: PackedWeight, move, rows32: bool) -> PackedWeight:
    n = pw.shape[0]
    planes = {
        name: move(getattr(pw, name), n, unit(pw, name))
        for name in (*_QUANT_PLANES, *_SCALE_PLANES)
        if getattr(pw, name) is not None
    }
    return dataclasses.replace(pw, rows32=rows32, **planes)


def interleave(pw: PackedWeight) -> PackedWeight:
    """pw's planes row-interleaved (a new weight; pw is left as it is)."""
    if pw.rows32:
        raise ValueError("interleave: the weight is interleaved already")
    return _relaid(pw, _interleave, True)


def deinterleave(pw: PackedWeight) -> PackedWeight:
    """The plain packed weight of an interleaved one."""
    if not pw.rows32:
        raise ValueError("deinterleave: the weight is not interleaved")
    return _relaid(pw, _deinterleave, False)
