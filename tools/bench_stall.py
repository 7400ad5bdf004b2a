"""W3-cpu (BENCHMARKS.md): decoding streams beside a long prompt's prefill on the CPU worker,
`skiff serve` at its defaults against the old fixed budget (`--step-target-ms -1`), same run.

For each configuration a server is started (`python -m shared.cli serve MODEL --devices cpu`),
W3 runs through HTTP (tools/bench_serving.w3: the streams' inter-token gaps before and during
the long prompt's prefill, its TTFT), and the server is stopped. A benchmark, not a test.

Usage: python -m tools.bench_stall MODEL.gguf --vocab 49152 --long-len 3000 6000 [--streams 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tools.bench_serving import w3
from tools.cpu_server import cpu_server

CONFIGS = {"auto": (), "fixed": ("--step-target-ms", "-1")}
# the scheduling alone: no KV tiers (a run's prompts restored from disk would skip prefills)
SERVE = ("--kv-ram-gb", "0", "--kv-disk-gb", "0")


def run(model: Path, config: str, port: int, a: argparse.Namespace) -> list[dict]:
    args = (*SERVE, *CONFIGS[config], *a.serve_args)
    log = Path(a.logs) / f"stall-{model.stem}-{config}.log"
    out = []
    with cpu_server(model, port, args, log) as url:
        for i, long_len in enumerate(a.long_len):
            seed = 100 * list(CONFIGS).index(config) + i  # prompts of their own: no cache hits
            r = asyncio.run(
                w3(url, a.vocab, long_len, a.streams, a.long_text, a.stream_prompt,
                   a.stream_tokens, a.settle, seed)
            )  # fmt: skip
            r = {"model": model.name, "config": config, "long_len": long_len, **r}
            print(json.dumps(r), flush=True)
            out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", type=Path)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--long-len", type=int, nargs="+", default=[3000, 6000])
    p.add_argument("--long-text", action="store_true")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--stream-prompt", type=int, default=128)
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--logs", default="/tmp")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    a = p.parse_args(argv)
    rows = [r for c in a.configs for r in run(a.model, c, a.port, a)]
    keys = ("gap_before_median_ms", "gap_during_median_ms", "gap_during_max_ms",
            "long_prompt_ttft_s", "n_errors")  # fmt: skip
    print("\n| model | config | long | " + " | ".join(keys) + " |")
    for r in rows:
        vals = " | ".join(str(r[k]) for k in keys)
        print(f"| {r['model']} | {r['config']} | {r['long_len']} | {vals} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
