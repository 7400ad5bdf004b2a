"""W7: a model over pipeline stages against one stage, through the engine (no HTTP).

    python -m tools.bench_pipeline MODEL.gguf --layouts cuda:0 cuda:0,cuda:0 cuda:0,cpu
        [--split cuda:0,cpu=30,2] [--memory cuda:0,cuda:0=20,12] [--concurrency 1 64 256]
        [--prompt 64] [--gen 32]

Per layout (the first is the one-stage reference): the start (load, stages ready, warm-up),
the greedy tokens of four prompts against the reference's (how many agree, position by
position), then output tok/s with C sequences decoding together (random prompts, EOS ignored):
the tokens after every sequence had its first, over their time. One JSON line each. Each layout
runs in a process of its own (a layout's GPU memory and its caps never meet the next one's); the
reference's prompts and tokens pass to the others in a file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shared.engine import Sequence
from shared.engine.factory import EngineConfig, build_engine
from shared.sampling import SamplingParams


def _config(a: argparse.Namespace, layout: str, blocks: int) -> EngineConfig:
    devices = layout.split(",")
    split = dict(s.split("=") for s in a.split).get(layout, "")
    memory = dict(s.split("=") for s in a.memory).get(layout, "")
    return EngineConfig(
        model_path=a.model,
        device=devices[0],
        dtype="bfloat16" if devices[0].startswith("cuda") else "float32",
        max_model_len=a.prompt + a.gen + 16,
        kv_blocks=blocks,
        stages=tuple(devices[1:]),
        layer_split=tuple(int(n) for n in split.split(",") if n),
        memory_gib=tuple(float(g) for g in memory.split(",") if g),
    )


def _run(engine, prompts: list[list[int]], gen: int, first_id: int) -> tuple[dict, float]:
    """({seq: tokens}, tok/s after every sequence had its first token)."""
    greedy = SamplingParams(temperature=0.0).validate()
    for i, p in enumerate(prompts):
        engine.add(Sequence(first_id + i, p, greedy, gen, frozenset(), None))
    out: dict[int, list[int]] = {first_id + i: [] for i in range(len(prompts))}
    times: list[float] = []
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
            times.append(time.perf_counter())
    later = times[len(prompts) :] if len(times) > len(prompts) else times
    rate = (len(later) - 1) / (later[-1] - later[0]) if len(later) > 1 else 0.0
    return out, rate


def _layout(a: argparse.Namespace, layout: str, reference_file: Path) -> None:
    """One layout in this process: its JSON line; the first layout writes the reference."""
    rng = np.random.default_rng(0)
    most = max(a.concurrency)
    blocks = most * -(-(a.prompt + a.gen + 16) // 16) + 64
    reference = json.loads(reference_file.read_text()) if reference_file.exists() else None
    t0 = time.perf_counter()
    loaded = build_engine(_config(a, layout, blocks))
    start_s = time.perf_counter() - t0
    vocab = loaded.engine.runner.model.cfg.vocab_size
    try:
        checks = [rng.integers(3, vocab, a.prompt).tolist() for _ in range(4)]
        checks = reference[0] if reference else checks
        tokens, _ = _run(loaded.engine, checks, a.check, 0)
        got = [tokens[i] for i in range(4)]
        if reference is None:
            reference = (checks, got)
            reference_file.write_text(json.dumps(reference))
        pairs = zip(got, reference[1], strict=True)
        same = sum(x == y for g, w in pairs for x, y in zip(g, w, strict=True))
        row = {"layout": layout, "start_s": round(start_s, 1),
               "greedy_same": f"{same}/{4 * a.check}"}  # fmt: skip
        pipe = getattr(loaded, "pipeline", None)
        if pipe is not None:
            row["split"] = [len(loaded.engine.runner.model.model.layers)] + [
                r.layers[1] - r.layers[0] for r in pipe.ready
            ]
        for c in a.concurrency:
            prompts = [rng.integers(3, vocab, a.prompt).tolist() for _ in range(c)]
            _, rate = _run(loaded.engine, prompts, a.gen, 1000)
            row[f"tok_s_c{c}"] = round(rate, 1)
        print(json.dumps(row), flush=True)
    finally:
        loaded.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--layouts", nargs="+", default=["cuda:0", "cuda:0,cuda:0", "cuda:0,cpu"])
    p.add_argument("--split", nargs="*", default=[], help="LAYOUT=N,M: that layout's split")
    p.add_argument("--memory", nargs="*", default=[], help="LAYOUT=G,H: its stages' GiB caps")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--check", type=int, default=24, help="greedy tokens compared per prompt")
    p.add_argument("--reference-file", type=Path, help=argparse.SUPPRESS)  # of the layouts
    p.add_argument("--only", help=argparse.SUPPRESS)  # the layout this process runs
    a = p.parse_args()
    if a.only is not None:
        _layout(a, a.only, a.reference_file)
        return
    with tempfile.TemporaryDirectory() as tmp:
        reference = ["--reference-file", str(Path(tmp) / "reference.json")]
        for layout in a.layouts:
            argv = [*sys.argv[1:], *reference, "--only", layout]
            done = subprocess.run([sys.executable, "-m", "tools.bench_pipeline", *argv])
            if done.returncode != 0:
                print(json.dumps({"layout": layout, "failed": done.returncode}), flush=True)


if __name__ == "__main__":
    main()
