"""How a launch of the int8 rows GEMVs (``packed_int8_rows``, ``packed_int8_pair``,
``packed_int8_rows_batch``) is shaped on the host: the weight loads' cache hints, when it lets
the next kernel's programs in, and its register cap."""

from __future__ import annotations

from shared.kernels.qmatmul.packed_chunk import Q4_K, Q6_K, Q8_0

__all__ = ["LATE_NEXT_ROPE", "WEIGHT_HINTS", "late_next", "maxnreg", "register_cap"]

# how the weights are loaded: (the words' cache modifier, their eviction policy, the scale
# words' eviction policy). Each is read once, so both are marked first to leave L1 and L2. H200,
# W1 (BENCHMARKS.md 2026-12-01 (z), 2026-12-03 (aq)): evict-first words +4.2 % Q4_K_M, +1.7 %
# Q6_K and Q8_0 against plain loads (".cg" words never ahead); the scales evict-first too
# +1.3 / +1.4 % Q4_K_M, Q6_K within the noise.
WEIGHT_HINTS = ("", "evict_first", "evict_first")
# When a launch lets the next kernel's programs be placed (``gdc.launch_next``): first thing,
# or after its weight loop, before its epilogue. The decode attention placed while the Q/K/V
# GEMV runs sat on 52 of 132 SMs beside its programs and walked a tile in 3.25 µs, against
# 2.46 µs spread over all (BENCHMARKS.md 2026-12-02 (am)).
# LATE_NEXT_ROPE: the Q/K/V launches with the RoPE epilogue (whose next kernel is the
# attention) whose weights' types are one of these tuples (one type, or a pair launch's two)
# call it late. H200, W1, two rounds a call: Q8_0 +1.5 to +1.9 % (2026-12-02 (an)); once the
# norms folded into the GEMVs (norm_ahead), Q4_K_M's Q4_K and Q4_K + Q6_K launches +1.2 / +1.6
# % (2026-12-03 (ap)). Other types keep the early call (not measured), and so do the launches
# without the RoPE epilogue (all of them late: Q4_K_M -6.0 / -5.8 % in (ap); the gate/up or the
# norm-folding ones alone -2.8 % and -5.3 % in (aq)).
LATE_NEXT_ROPE = frozenset({(int(Q8_0),), (int(Q4_K),), (int(Q4_K), int(Q6_K))})


def late_next(rope: bool, *qtypes: int) -> bool:
    """Whether a rows or pair launch of weights of `qtypes` (with the RoPE epilogue or not)
    calls ``launch_next`` after its weight loop."""
    return rope and tuple(int(q) for q in qtypes) in LATE_NEXT_ROPE


def maxnreg(qtype: int) -> int | None:
    """The register cap a thread (None: the compiler's choice). Left to itself the compiler gave
    Q4_K 82: five 4-warp programs an SM, so the 896 programs of a 28672-row or 4096x14336 GEMV
    ran in 1.4 waves. 72 fits seven (924 programs on 132 SMs: one wave) and spills less than
    64 (ncu: 43,008 local-memory spill requests in the Q4_K 28672x4096 GEMV at 64, BENCHMARKS.md
    2026-11-30 (w)). On the H200, W1 Q4_K_M: 383.7 tok/s uncapped, 397.5 at 64 ((v)); in one
    call of (w), 385.0 at 64 and 399.9 at 72. Q8_0 keeps the compiler's choice: its 61 registers
    fit eight programs already, and the cap at 64 cost it 1.3 % ((v))."""
    return None if qtype == int(Q8_0) else 72


def register_cap(cfg: dict, *qtypes: int) -> int | None:
    """A launch's register cap: the config's MAXNREG, else the weights' common ``maxnreg``
    (None where they differ: the compiler's choice)."""
    return cfg.get("MAXNREG") or _common(maxnreg(q) for q in qtypes)


def _common(values):
    """The one value all of `values` share, else None (none, or they differ)."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None
