"""Where a batch-1 decode step's attention time goes, program by program: W1 through the engine
with the attention's and its combine's probe records (``shared.kernels.probe``).

    python -m tools.probe_attention MODEL.gguf [--variants default,attn-32] [--prompt 512]
        [--gen 64] [--keep DIR]   # the last steps' records a variant, for a closer look

Every program of the decode attention and of its combine pass records when it started, when
``wait_prev`` returned (the kernel before it had finished: for the attention, the Q/K/V GEMV),
when it had walked its keys, and when it finished, on the GPU's global nanosecond timer, with
its SM. Each layer's times are taken from the attention's first ``wait_prev`` return (w0, about
the Q/K/V's end); the table gives their medians over the decode layers (and the 10th and 90th
percentiles). It is a benchmark, not a test: the probes add a few instructions and one atomic a
program, so its times run a little long.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

# a record's words (shared.kernels.probe.RECORD): times, cycles, then the kernels' own words
T_START, T_WAIT, T_WALKED, T_END = 0, 1, 2, 3
C_START, C_WAIT, C_WALKED, C_END = 4, 5, 6, 7
SM, GRID, KIND = 8, 12, 13  # KIND: 0 attention program with nothing to do, 1 computed, 2 combine
T_Q = 15  # an attention program's: when its queries came (global ns)


def launches(rec: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Cut the records (in the order written) into launches: ("attention" | "combine", rows).
    A launch's programs all finish before the next launch's: its records are consecutive. A
    last launch cut short by a full buffer is left out."""
    out, i, n = [], 0, rec.shape[0]
    while i < n:
        grid = int(rec[i, GRID])
        rows = rec[i : i + grid]
        kind = "combine" if int(rec[i, KIND]) == 2 else "attention"
        if rows.shape[0] < grid and bool(((rows[:, KIND] == 2) == (kind == "combine")).all()):
            break  # the buffer filled up during this launch
        if rows.shape[0] < grid or any((rows[:, KIND] == 2) != (kind == "combine")):
            raise ValueError(f"records {i}..{i + grid}: not one whole {kind} launch")
        out.append((kind, rows))
        i += grid
    return out


def layers(rec: torch.Tensor, grid: int) -> list[dict[str, float]]:
    """Per decode layer (an attention launch of `grid` programs and the combine after it), the
    times in µs from w0, the attention's first wait_prev return."""
    ls = launches(rec)
    found = []
    for (kind, a), (kind2, c) in zip(ls, ls[1:], strict=False):
        if kind != "attention" or kind2 != "combine" or a.shape[0] != grid:
            continue
        w0 = int(a[:, T_WAIT].min())
        live = a[a[:, KIND] == 1]
        if live.shape[0] == 0:  # a warm-up's padding: nothing to attend
            continue

        def us(x, w0=w0) -> float:
            return (float(x) - w0) / 1e3

        cyc = (live[:, C_WALKED] - live[:, C_WAIT]).double() / 1.98e3  # µs at 1,980 MHz
        found.append({
            "attention first start": us(a[:, T_START].min()),
            "attention last start": us(a[:, T_START].max()),
            "started after w0 (share)": float((a[:, T_START] > w0).double().mean()),
            "attention last wait return": us(a[:, T_WAIT].max()),
            "queries came (median)": us(live[:, T_Q].median()),
            "queries came (last)": us(live[:, T_Q].max()),
            "keys walked (median)": us(live[:, T_WALKED].median()),
            "keys walked (last)": us(live[:, T_WALKED].max()),
            "wait to walked, cycles (median, µs)": float(cyc.median()),
            "attention last end": us(a[:, T_END].max()),
            "combine first start": us(c[:, T_START].min()),
            "combine first wait return": us(c[:, T_WAIT].min()),
            "combine last end": us(c[:, T_END].max()),
            "attention SMs": float(len(set(a[:, SM].tolist()))),
            "live programs": float(live.shape[0]),
        })  # fmt: skip
    return found


def table(found: list[dict[str, float]]) -> str:
    """Medians (10th / 90th percentiles) of each figure over the layers."""
    if not found:
        return "no decode layers recorded"
    lines = [f"{len(found)} decode layers; µs from the attention's first wait_prev return"]
    for key in found[0]:
        xs = sorted(f[key] for f in found)
        p10, p90 = xs[len(xs) // 10], xs[(len(xs) * 9) // 10]
        lines.append(f"  {key:40s} {statistics.median(xs):8.2f}   ({p10:.2f} / {p90:.2f})")
    return "\n".join(lines)


def timer_step_ns(rec: torch.Tensor) -> int:
    """The smallest step between distinct global times seen (the timer's resolution, or less)."""
    t = torch.unique(rec[:, :4].flatten())
    d = t[1:] - t[:-1]
    return int(d.min()) if d.numel() else 0


@contextmanager
def _measured_run_only(buf: torch.Tensor):
    """Within: bench_w1's runs after its first (the warm-up, the engine's graph captures
    before it) start from an empty probe buffer."""
    w1 = importlib.import_module("tools.bench_w1")
    run_once, runs = w1.run_once, []

    def counted(*args, **kw):
        if runs:
            buf[0] = 0
        runs.append(1)
        return run_once(*args, **kw)

    w1.run_once = counted
    try:
        yield
    finally:
        w1.run_once = run_once


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--variants", default="default", help="tools.ab_w1's variants, by commas")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--capacity", type=int, default=1 << 22, help="records the buffer holds")
    p.add_argument("--keep", type=Path, help="save each variant's last 8 steps' records here")
    a = p.parse_args(argv)
    from shared.kernels import probe
    from tools.ab_w1 import enter_variant
    from tools.bench_w1 import bench

    attn = importlib.import_module("shared.kernels.paged_attention")
    for variant in a.variants.split(","):
        buf = probe.new_buffer(a.capacity, a.device)
        with ExitStack() as stack:
            enter_variant(stack, variant)
            saved = attn.paged_attention
            attn.paged_attention = functools.partial(saved, probe=buf)
            stack.callback(setattr, attn, "paged_attention", saved)
            stack.enter_context(_measured_run_only(buf))
            res = bench(a.model, a.device, a.prompt, a.gen, 1, True)
        rec = probe.records(buf)
        del buf
        torch.cuda.empty_cache()
        print(f"{a.model.name} {variant}: tg{a.gen} {res[f'tg{a.gen}_tok_s']} tok/s (probed); "
              f"{rec.shape[0]} records, timer step {timer_step_ns(rec)} ns")  # fmt: skip
        grids = sorted({int(r) for r in rec[rec[:, KIND] != 2][:, GRID].unique()})
        for grid in grids:
            if found := layers(rec, grid):
                print(f"attention grid {grid}:")
                print(table(found), flush=True)
        if a.keep:
            a.keep.mkdir(parents=True, exist_ok=True)
            torch.save(rec[-8 * 32 * (max(grids) + 32) :].clone(), a.keep / f"{variant}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
