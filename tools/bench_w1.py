"""W1: batch-1 decode through the engine's real path (scheduler, paged KV, CUDA graphs).

    python -m tools.bench_w1 MODEL.gguf [MODEL.gguf ...] [--prompt 512] [--gen 128] [--runs 3]
                             [--kv-dtype auto|fp8|...] [--kv-scales token|head] [--batch 1]

Per model: a 512-token prompt of random ids (prefix caching off, so every run prefills), then
128 tokens generated greedily with EOS ignored, with overlapped steps as the server runs them
(``--no-overlap``: one step at a time, the host's work between steps exposed). Prints one
JSON line per model: prefill tok/s (prompt tokens / time to the first token), decode tok/s
(tokens after the first / their time), the median over the runs, and the HBM bound: file
bytes / 4.3 TB/s. W6's decode speed at 32k context: ``--prompt 32000 --kv-dtype fp8`` against
``--kv-dtype bfloat16`` (``--kv-scales head``: FP8 with calibrated per-head scales).
``--batch B``: B sequences of the same prompt decoded together (decode batches of B rows, as
speculative checks and small servers run them): total decode tok/s and per sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HBM_BYTES_PER_S = 4.3e12


def run_once(
    engine, seq_cls, params, prompt: list[int], gen: int, seq_id: int, gaps: list | None = None
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s); gaps, if given, gets the times between tokens (s)."""
    seq = seq_cls(seq_id, prompt, params, gen, frozenset(), None)
    engine.add(seq)
    t0 = time.perf_counter()
    t_first = t_last = None
    n = 0
    while engine.has_work():
        for _ in engine.step():
            n += 1
            now = time.perf_counter()
            if t_last is not None and gaps is not None:
                gaps.append(now - t_last)
            t_last = now
            t_first = t_first or t_last
    assert n == gen, f"generated {n} tokens, wanted {gen}"
    return len(prompt) / (t_first - t0), (n - 1) / (t_last - t_first)


def run_batch(engine, seq_cls, params, prompts: list[list[int]], gen: int, first_id: int) -> float:
    """Decode tok/s of len(prompts) sequences run together: the tokens that came after every
    sequence had its first, over the time from then to the last."""
    for i, p in enumerate(prompts):
        engine.add(seq_cls(first_id + i, p, params, gen, frozenset(), None))
    times: list[float] = []
    while engine.has_work():
        times += [time.perf_counter() for _ in engine.step()]
    assert len(times) == gen * len(prompts), f"generated {len(times)}, wanted {gen}x{len(prompts)}"
    start = times[len(prompts) - 1]  # (prompts prefill in one step: each one's first token)
    return (len(times) - len(prompts)) / (times[-1] - start)


def bench(
    path: Path,
    device: str,
    prompt_len: int,
    gen: int,
    runs: int,
    overlap: bool = False,
    kv_dtype: str = "auto",
    kv_scales: str = "token",
    batch: int = 1,
) -> dict:
    from shared.engine import Sequence
    from shared.engine.factory import EngineConfig, build_engine
    from shared.sampling import SamplingParams

    t = time.perf_counter()
    loaded = build_engine(
        EngineConfig(
            model_path=str(path), device=device, dtype="bfloat16",
            max_model_len=prompt_len + gen + 16,
            kv_blocks=batch * ((prompt_len + gen) // 16 + 64),
            max_batch_tokens=max(2048, batch * prompt_len), prefix_caching=False,
            max_seqs=batch, overlap=overlap, kv_dtype=kv_dtype,
            kv_scales=kv_scales,
        )
    )  # fmt: skip
    load_s = time.perf_counter() - t
    engine, vocab = loaded.engine, loaded.tokenizer.vocab_size
    params = SamplingParams(temperature=0.0).validate()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(runs + 1)
    ]
    run_once(engine, Sequence, params, prompts[0], 16, 0)  # warm-up (compiles, allocator)
    if batch > 1:  # the same prompts, each run as `batch` sequences together
        run_batch(engine, Sequence, params, [prompts[0]] * batch, 16, 10_000)
        tg = [
            run_batch(engine, Sequence, params, [p] * batch, gen, 10_000 * (i + 2))
            for i, p in enumerate(prompts[1:])
        ]
        return {
            "model": path.name, "batch": batch, f"tg{gen}_tok_s": round(statistics.median(tg), 1),
            "tg_runs": [round(x, 1) for x in tg],
            "per_sequence_tok_s": round(statistics.median(tg) / batch, 1),
        }  # fmt: skip
    gaps: list[float] = []
    timings = [
        run_once(engine, Sequence, params, p, gen, i + 1, gaps) for i, p in enumerate(prompts[1:])
    ]
    pp, tg = [t[0] for t in timings], [t[1] for t in timings]
    size = path.stat().st_size
    bound = HBM_BYTES_PER_S / size
    tg_med = statistics.median(tg)
    return {
        "model": path.name, "file_gb": round(size / 1e9, 3), "load_s": round(load_s, 1),
        f"pp{prompt_len}_tok_s": round(statistics.median(pp), 1),
        f"tg{gen}_tok_s": round(tg_med, 1),
        "tg_runs": [round(x, 1) for x in tg], "bound_tok_s": round(bound, 1),
        "of_bound": round(tg_med / bound, 3),
        # between tokens (ms): a host stall shows as a long one, not in the median
        "gap_ms": _spread(gaps),
        "kv_cache": str(engine.runner.kv.k[0].dtype).removeprefix("torch.")
        + (" (per-head scales)" if engine.runner.kv.head_scales else ""),
    }  # fmt: skip


def _spread(gaps: list[float]) -> dict:
    """Median, 99th percentile and longest of the times between tokens, in ms; how many took
    over 1.5 times the median."""
    if not gaps:
        return {}
    ms = sorted(g * 1e3 for g in gaps)
    med = statistics.median(ms)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    over = sum(g > 1.5 * med for g in ms)
    return {"p50": round(med, 3), "p99": round(p99, 3), "max": round(ms[-1], 3), "over_1.5x": over}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--overlap", action=argparse.BooleanOptionalAction, default=True,
        help="overlapped engine steps, as the server runs them by default (--no-overlap: one "
        "step at a time; the W1 figures of BENCHMARKS.md up to (r) ran that way)",
    )  # fmt: skip
    p.add_argument("--kv-dtype", default="auto", help="the KV cache's dtype (EngineConfig)")
    p.add_argument("--kv-scales", default="token", choices=["token", "head"], help="fp8's scales")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    a = p.parse_args(argv)
    for path in a.models:
        result = bench(
            path, a.device, a.prompt, a.gen, a.runs, a.overlap, a.kv_dtype, a.kv_scales, a.batch
        )
        print(json.dumps(result | {"overlap": a.overlap}), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
