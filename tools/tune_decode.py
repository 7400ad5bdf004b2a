"""Batch-1 configs of the rows GEMV timed inside the engine's decode steps, not one GEMV alone.

    python -m tools.tune_decode MODEL.gguf [--json winners.json] [--gen 64] [--runs 2]
        [--only KEY=VALUE ...]   # e.g. --only SPLIT_K=1 SPLIT_K=2: just those splits

BENCHMARKS.md (u): the configs that won when one GEMV was timed alone (weight cold in L2,
graph-replayed: the load-time tuner) made W1 25-34 % slower than the rows
GEMV's default split. This tool measures what W1 measures. For each distinct batch-1 shape of
the model's interleaved weights, most weights first, it sets that shape's table entry,
recaptures the decode graph and times greedy decode (``bench_w1.run_once``). It keeps the best
config before it moves to the next shape (coordinate descent). A candidate replaces the
default only if it is faster by more than ``MARGIN``.

The candidates of a shape: the default tile (4 warps) at every split, then at the default split
the same tile rounding its activations itself (QX) and the other rows tiles. Each is first
checked against the default config's product. The winners print (and with --json are written)
as table entries in ``qmatmul/tuned``'s format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

MARGIN = 0.005  # a candidate must beat the best so far by 0.5 % (W1's run-to-run spread: < 0.3 %)
SPLITS = (1, 2, 4, 8, 16)


def coordinate_search(
    keys: list[str],
    candidates: Callable[[str], list[dict]],
    measure: Callable[[dict[str, dict]], float],
    margin: float = MARGIN,
) -> tuple[dict[str, dict], float, float]:
    """Entries {key: config} chosen one key at a time: the key's candidates measured with the
    entries chosen so far (``measure`` returns tok/s, higher is better; a key without an entry
    takes its default), against those entries measured again just before. Returns (entries,
    tok/s with none, tok/s with them as last measured)."""
    chosen: dict[str, dict] = {}
    base = best = measure(chosen)
    for i, key in enumerate(keys):
        if i:  # the incumbent again: W1 drifted by up to 7 % over one search (BENCHMARKS.md (v))
            best = measure(chosen)
        pick = None
        for cfg in candidates(key):
            got = measure({**chosen, key: cfg})
            if got > best * (1 + margin):
                pick, best = cfg, got
        if pick is not None:
            chosen[key] = pick
    return chosen, base, best


def rows_trials(default_split: int) -> list[dict]:
    """The default tile (4 warps, no prefetch or prologue rounding) at every split, then at the
    default split the same tile with QX and the other rows tiles."""
    from shared.kernels.qmatmul.tuning import ROWS_TILES

    tile = {"ROWS": 1, "INT8": 1, "num_warps": 4, "PREFETCH": 0, "QX": 0}
    out = [{**tile, "SPLIT_K": s} for s in SPLITS if s != default_split]
    # the default tile rounding its activations in its prologue (QX: no rounding launch of its
    # own, 129 launches and 0.16 ms of a Q4_K_M step in BENCHMARKS.md (u)), then the other tiles
    for w, p, qx in ((4, 0, 1), *ROWS_TILES):
        if (w, p, qx) != (4, 0, 0):
            out.append({**tile, "num_warps": w, "PREFETCH": p, "QX": qx, "SPLIT_K": default_split})
    return out


def parse_only(items: list[str]) -> dict[str, set[int]]:
    """``["SPLIT_K=1", "SPLIT_K=2", "QX=0"]`` -> {"SPLIT_K": {1, 2}, "QX": {0}}."""
    out: dict[str, set[int]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise SystemExit(f"--only takes KEY=INTEGER, not {item!r}")
        out.setdefault(key, set()).add(int(value))
    return out


def selected(cfg: dict, only: dict[str, set[int]]) -> bool:
    """Whether a candidate passes the --only filter (a key it lacks counts as 0)."""
    return all(cfg.get(key, 0) in values for key, values in only.items())


def main(argv: list[str] | None = None) -> int:
    from shared.engine import Sequence
    from shared.engine.cuda_graphs import StepGraphs
    from shared.engine.factory import EngineConfig, build_engine
    from shared.kernels.qmatmul.packed_matmul import default_rows_split, packed_matmul
    from shared.kernels.qmatmul.tuning import INT8_TOL, agrees
    from shared.model.linear import QuantLinear
    from shared.sampling import SamplingParams
    from tools.bench_w1 import run_once

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--only", nargs="+", default=[], metavar="KEY=VALUE",
                   help="try only the candidates whose KEY equals one of these VALUEs")  # fmt: skip
    a = p.parse_args(argv)
    only = parse_only(a.only)
    if not torch.cuda.is_available():
        sys.exit("tune_decode needs a CUDA device")
    max_len = a.prompt + a.gen + 16
    loaded = build_engine(
        EngineConfig(
            model_path=str(a.model), device=a.device, dtype="bfloat16", max_model_len=max_len,
            kv_blocks=max_len // 16 + 64, max_batch_tokens=max(2048, a.prompt),
            prefix_caching=False, max_seqs=1, overlap=True, cuda_graphs="decode",
        )
    )  # fmt: skip
    engine, runner = loaded.engine, loaded.engine.runner
    layers = {}  # table key -> a packed weight of that shape
    tuner = None
    for m in runner.model.modules():
        if isinstance(m, QuantLinear) and m.packed is not None and m.tuner and m.packed.rows32:
            tuner = m.tuner
            layers.setdefault(tuner.table_key(m.packed, 1, m.compute_dtype), m.packed)
    if tuner is None:
        sys.exit("no interleaved packed weight in this model on this device")
    keys = sorted(layers, key=lambda k: -layers[k].shape[0] * layers[k].shape[1])

    def trials(key: str) -> list[dict]:
        pw = layers[key]
        x = torch.randn(1, pw.shape[1], device=pw.q.device, dtype=torch.bfloat16)
        ref = packed_matmul(x, pw, torch.float32, {"ROWS": 1, "num_warps": 4})
        cands = [c for c in rows_trials(default_rows_split(pw)) if selected(c, only)]
        return [c for c in cands if agrees(packed_matmul(x, pw, torch.float32, c), ref, INT8_TOL)]

    params = SamplingParams(temperature=0.0).validate()
    vocab = loaded.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (a.prompt,), generator=g).tolist()
    seq_id = iter(range(1, 1 << 30))

    def measure(entries: dict[str, dict]) -> float:
        tuner.set_entries(entries, drop=keys)  # the keys not in entries take their defaults
        runner.graphs = None
        torch.cuda.synchronize()
        graphs = StepGraphs(runner.model, runner.kv, 1, max_len, 0)
        graphs.capture()  # the configs are launch arguments baked into the graph
        runner.graphs = graphs
        run_once(engine, Sequence, params, prompt, 8, next(seq_id))  # warm-up
        tg = [
            run_once(engine, Sequence, params, prompt, a.gen, next(seq_id))[1]
            for _ in range(a.runs)
        ]
        tok_s = statistics.median(tg)
        print(f"  {tok_s:7.1f} tok/s  {json.dumps(entries)}", flush=True)
        return tok_s

    chosen, base, best = coordinate_search(keys, trials, measure)
    print(json.dumps({"model": a.model.name, "default_tok_s": round(base, 1),
                      "tuned_tok_s": round(best, 1), "entries": chosen}))  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(chosen, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
