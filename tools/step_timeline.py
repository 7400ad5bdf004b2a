"""Where decode steps' wall clock goes, kernel by kernel, from a torch.profiler chrome trace.

    python -m tools.step_timeline TRACE.json[.gz] --steps N [--rows 30] [--sequence FROM:COUNT]

Kernels are taken in start order. Each one is charged the time by which it moved the end of
the work done so far: ``max(0, end - frontier)``, where the frontier is the latest end of the
kernels before it. The charges of a window add up to its span, so they say what each kernel
(and each gap) costs the step, overlapped launches (PDL) included: a kernel that starts early
and ends after its predecessor is charged only the part after it. A charge splits into the
gap before the kernel started (``start - frontier`` when positive: launch latency, host time)
and its exposed run time. Rows are kernel name and grid (the grid tells the GEMV shapes
apart); copies and memsets count as work; gaps of 20 µs or more are counted apart as host
time between steps, and the longest idle stretches are listed with their neighbours.
``--sequence FROM:COUNT`` lists COUNT kernels from the FROM-th one by one instead: start and
end against the first one's start, run time, and the start against the frontier (negative:
it started that long before the work ahead of it ended, as PDL launches do).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

HOST_GAP_US = 20.0


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernels(trace: dict) -> list[dict]:
    """The trace's device work (kernels, copies, memsets), by start time."""
    ks = [e for e in trace.get("traceEvents", []) if e.get("cat") in _DEVICE_CATS and "dur" in e]
    return sorted(ks, key=lambda e: e["ts"])


def largest_gaps(ks: list[dict], n: int = 8) -> list[tuple[float, str, str]]:
    """The n longest idle stretches of the device: (µs, work before, work after)."""
    gaps, frontier, before = [], None, ""
    for e in ks:
        if frontier is not None and e["ts"] > frontier:
            gaps.append((e["ts"] - frontier, before, _key(e)))
        end = e["ts"] + e["dur"]
        if frontier is None or end >= frontier:
            frontier, before = end, _key(e)
    return sorted(gaps, reverse=True)[:n]


def _key(e: dict) -> str:
    name = re.sub(r"<.*", "", e["name"])[:48]
    grid = e.get("args", {}).get("grid")
    return f"{name} {tuple(grid) if grid else ''}"


def charges(ks: list[dict]) -> tuple[dict, dict]:
    """Per row: [launches, run µs, exposed µs, gap µs]; totals: span, host gaps, run, exposed."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    tot = {"span": 0.0, "host": 0.0, "gaps": 0.0, "run": 0.0, "exposed": 0.0}
    if not ks:
        return rows, tot
    frontier = ks[0]["ts"]
    for e in ks:
        start, end = e["ts"], e["ts"] + e["dur"]
        gap = max(0.0, start - frontier)
        moved = max(0.0, end - frontier)
        frontier = max(frontier, end)
        if gap >= HOST_GAP_US:
            tot["host"] += gap
            moved -= gap
            gap = 0.0
        r = rows[_key(e)]
        r[0] += 1
        r[1] += e["dur"]
        r[2] += moved - gap
        r[3] += gap
        tot["run"] += e["dur"]
        tot["exposed"] += moved - gap
        tot["gaps"] += gap
    tot["span"] = frontier - ks[0]["ts"]
    return rows, tot


def report(trace: dict, steps: int, top: int = 30) -> None:
    ks = kernels(trace)
    rows, tot = charges(ks)
    per = {k: v / steps for k, v in tot.items()}
    print(
        f"  timeline per step: span {per['span']:.1f} µs = exposed kernel time "
        f"{per['exposed']:.1f} + launch gaps {per['gaps']:.1f} + host gaps (>= {HOST_GAP_US:.0f} "
        f"µs) {per['host']:.1f}; kernels ran {per['run']:.1f} µs in all, "
        f"{sum(r[0] for r in rows.values()) / steps:.0f} launches"
    )
    print("  exposed µs  gap µs  launches  µs a launch  kernel (grid)")
    for key, (n, run, exposed, gap) in sorted(rows.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))[
        :top
    ]:
        print(
            f"  {exposed / steps:10.1f} {gap / steps:7.1f} {n / steps:9.1f} {run / n:12.2f}  {key}"
        )
    print("  longest idle stretches (µs, after, before):")
    for gap, before, after in largest_gaps(ks):
        print(f"  {gap:8.1f}  {before}  ->  {after}")


def sequence(ks: list[dict], first: int, count: int) -> None:
    """Kernels first .. first + count - 1 one by one (µs): start, end, run time, start minus
    the frontier of the kernels before it."""
    window = ks[first : first + count]
    if not window:
        return
    t0 = window[0]["ts"]
    frontier = max((e["ts"] + e["dur"] for e in ks[:first]), default=t0)
    print("   start     end     run  vs frontier  kernel (grid)")
    for e in window:
        start, end = e["ts"], e["ts"] + e["dur"]
        print(
            f"  {start - t0:7.2f} {end - t0:7.2f} {e['dur']:7.2f} {start - frontier:12.2f}  "
            f"{_key(e)}"
        )
        frontier = max(frontier, end)


def load(path: Path) -> dict:
    """A chrome trace, gzipped (.gz) or not."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--sequence", default=None, help="FROM:COUNT kernels one by one")
    a = p.parse_args(argv)
    trace = load(a.trace)
    if a.sequence:
        first, count = (int(v) for v in a.sequence.split(":"))
        sequence(kernels(trace), first, count)
        return 0
    report(trace, a.steps, a.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
