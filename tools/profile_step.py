"""Where a decode step's time goes: C sequences decoding together through the engine (no HTTP).

    python -m tools.profile_step MODEL.gguf [--concurrency 64] [--prompt 512] [--steps 20]
        [--dense-copies auto|on|off] [--timeline [--trace OUT.json.gz]]

Builds the engine as the server does (CUDA graphs, paged KV), admits C random prompts, steps
until every sequence decodes, then times `--steps` decode-only steps by wall clock and
profiles a few more with torch.profiler: the step time, and the kernels with the most device
time per step (graph replays included where CUPTI records them). Then one mixed step (a
512-token prompt chunk beside the C decodes). ``--timeline``: the engine's steps overlapped (as
the server and W1 run them) and the profiled decode steps charged kernel by kernel on the
device's timeline (``tools.step_timeline``: exposed run time, launch gaps, host gaps);
``--trace`` also keeps that profile's chrome trace (gzipped) for ``step_timeline --sequence``.
Prints text; it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def _step(engine) -> float:
    t = time.perf_counter()
    list(engine.step())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def _top(prof, steps: int, rows: int) -> None:
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) or 1
    print(f"  device time per step (kernels recorded): {total / steps / 1e3:.2f} ms")
    for e in events[:rows]:
        share = e.device_time_total / total
        print(
            f"  {e.device_time_total / steps / 1e3:7.3f} ms {share:6.1%} x{e.count / steps:5.1f}"
            f"  {e.key[:90]}"
        )


def _timeline(engine, rows: int, n: int = 20, keep: Path | None = None) -> None:
    import gzip
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from tools.step_timeline import report

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):  # no sync between steps: the engine overlaps them
            list(engine.step())
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
        trace = json.loads(raw)
        if keep is not None:
            keep.write_bytes(gzip.compress(raw))
    print(f"timeline of {n} overlapped decode steps:")
    report(trace, n, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dense-copies", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--trace", type=Path, default=None)
    return _run(p.parse_args(argv))


def _run(a: argparse.Namespace) -> int:
    from shared.engine import Sequence
    from shared.engine.factory import EngineConfig, build_engine
    from shared.sampling import SamplingParams

    c, gen = a.concurrency, 1000
    loaded = build_engine(
        EngineConfig(
            model_path=str(a.model), device=a.device, dtype="bfloat16",
            max_model_len=a.prompt + 1024, kv_blocks=(c + 1) * (a.prompt + 1024) // 16 + 64,
            max_batch_tokens=max(2048, a.prompt), prefix_caching=False, max_seqs=c + 1,
            dense_copies=a.dense_copies, overlap=a.timeline,
        )
    )  # fmt: skip
    engine, vocab = loaded.engine, loaded.tokenizer.vocab_size
    params = SamplingParams(temperature=0.0).validate()
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(0, vocab, (a.prompt,), generator=g).tolist()

    for i in range(c):
        engine.add(Sequence(i, prompt(), params, gen, frozenset(), None))
    t = time.perf_counter()
    prefill_steps = 0
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed < len(s.prompt_ids) for s in sched.running):
        _step(engine)
        prefill_steps += 1
    print(f"prefill of {c} x {a.prompt}: {prefill_steps} steps, {time.perf_counter() - t:.2f} s")
    for _ in range(3):
        _step(engine)  # warm: graphs, allocator
    times = [_step(engine) for _ in range(a.steps)]
    med = statistics.median(times)
    print(
        f"decode step, {c} sequences: median {med:.2f} ms (min {min(times):.2f}, "
        f"max {max(times):.2f}) -> {c / med * 1e3:.0f} tok/s"
    )
    from torch.profiler import ProfilerActivity, profile

    n = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            _step(engine)
    _top(prof, n, a.rows)
    if a.timeline:
        _timeline(engine, a.rows, keep=a.trace)
        return 0
    engine.add(Sequence(c, prompt(), params, gen, frozenset(), None))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms = _step(engine)
    print(f"mixed step ({c} decodes + a {a.prompt}-token prompt chunk): {ms:.2f} ms")
    _top(prof, 1, a.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
