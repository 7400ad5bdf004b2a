"""How a launch of the int8 rows GEMVs (``packed_int8_rows``, ``packed_int8_pair``,
``packed_int8_rows_batch``) is shaped on the host: the weight loads' cache hints, when it lets
the next kernel's programs in, and its register cap. Module flags read at each call, so that
a patched one (``tools/ab_w1``) reaches every launcher: patch them here."""

from __future__ import annotations

from shared.kernels.qmatmul.packed_chunk import Q4_K, Q6_K, Q8_0

__all__ = [
    "CACHE_HINTS",
    "DEFAULT_CACHE",
    "LATE_NEXT",
    "LATE_NEXT_KINDS",
    "LATE_NEXT_ROPE",
    "TYPE_CACHE",
    "cache_hints",
    "late_next",
    "maxnreg",
    "register_cap",
]

# config key CACHE: how the weights are loaded, (the words' cache modifier, their eviction policy,
# the scale words' eviction policy). Each is read once: 1 marks the words first to leave L1 and
# L2, 3 the scales too, 2 keeps the words out of L1 (".cg"; ptxas refuses it with a policy), 0
# plain loads.
CACHE_HINTS = {
    0: ("", "", ""),
    1: ("", "evict_first", ""),
    2: (".cg", "", ""),
    3: ("", "evict_first", "evict_first"),
}
# a config without CACHE: evict-first, the weight words and the scale words. H200 (BENCHMARKS.md
# 2026-12-01 (z)): no shape of Q4_K_M lost with evict-first words beyond the noise (0.3 %) and
# ".cg" was never ahead (tools.tune_decode); W1 against plain loads +4.2 % Q4_K_M, +1.7 % Q6_K
# and Q8_0; the scales evict-first too (3) within noise then. After the norm fold (2026-12-03
# (aq), W1, two rounds a call): 3 against 1 Q4_K_M +1.3 / +1.4 % (call 1) and +1.4 / +1.3 %
# (call 2), Q6_K -0.5 / -0.2 % (call 2; within-call spread up to 0.4 %), Q8_0 not A/B'd.
DEFAULT_CACHE = 3
# TYPE_CACHE: a weight type's own default instead (a pair launch takes it where both of its
# types name the same one). Empty: every type takes DEFAULT_CACHE. (aq) call 2: the Q6_K file
# -0.5 / -0.2 % with 3 against 1, but Q4_K_M's file (Q6_K weights among its Q4_K) was measured
# with every weight at 3 only: ab_w1's cache-q6k-1 for that.
TYPE_CACHE: dict[int, int] = {}
# When a launch lets the next kernel's programs be placed (``gdc.launch_next``): first thing
# (the default), or after its weight loop, before its epilogue. The decode attention placed
# while the Q/K/V GEMV runs sat on 52 of 132 SMs beside its programs and walked a tile in
# 3.25 µs, against 2.46 µs spread over all (BENCHMARKS.md 2026-12-02 (am)).
# LATE_NEXT_ROPE: the Q/K/V launches with the RoPE epilogue (whose next kernel is the
# attention) whose weights' types are one of these tuples (one type, or a pair launch's two).
# H200, W1, two rounds a call (2026-12-02 (an)): Q8_0 +1.7 / +1.6 % and +1.5 / +1.9 %; Q4_K_M
# with every launch late -0.5 / -0.5 % and -0.7 / -0.8 %, its Q4_K launches alone -1.2 / -0.9
# %, so Q8_0 only then. Once the norms folded into the GEMVs (norm_ahead), Q4_K_M's Q4_K and
# Q4_K + Q6_K launches late too won: +1.2 / +1.6 % (2026-12-03 (ap); its Q4_K ones alone
# +0.3 / +0.5 %). Other types keep the early call (not measured). LATE_NEXT: every rows and
# pair launch (Q4_K_M -3.7 % in (an) and -6.0 / -5.8 % in (ap), Q6_K -3.3 %, Q8_0 +0.5 %: off).
LATE_NEXT_ROPE = frozenset({(int(Q8_0),), (int(Q4_K),), (int(Q4_K), int(Q6_K))})
LATE_NEXT = False
# LATE_NEXT_KINDS: the batch-1 rows launches late by what they end in: "act" (gate/up, the
# gated rounding; the next kernel is the down projection), "norm" (the output and down
# projections with the norm folded in, norm_ahead; next: gate/up or the next layer's Q/K/V).
# H200, W1 Q4_K_M, two rounds (2026-12-03 (aq)): "act" -2.8 / -2.6 %, "norm" -5.3 / -5.2 %: none.
LATE_NEXT_KINDS: frozenset[str] = frozenset()


def late_next(rope: bool, *qtypes: int, kind: str = "") -> bool:
    """Whether a rows or pair launch of weights of `qtypes` (with the RoPE epilogue or not;
    `kind` as LATE_NEXT_KINDS names it, "" for none) calls ``launch_next`` after its weight
    loop (the flags read at the call, so that a patched one reaches every launcher)."""
    if LATE_NEXT or kind in LATE_NEXT_KINDS:
        return True
    return rope and tuple(int(q) for q in qtypes) in LATE_NEXT_ROPE


def cache_hints(cfg: dict, *qtypes: int) -> tuple[str, str, str]:
    """(CM, EP, SEP) for a rows config of weights of `qtypes`: its CACHE key, else the types'
    common TYPE_CACHE entry, else DEFAULT_CACHE (read at the call, so that a patched one
    reaches every launcher)."""
    own = _common(TYPE_CACHE.get(int(q)) for q in qtypes)
    return CACHE_HINTS[cfg.get("CACHE", DEFAULT_CACHE if own is None else own)]


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
