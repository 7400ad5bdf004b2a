"""W5 (BENCHMARKS.md) on the CPU worker: speculation on code edits and on prose, single stream,
`skiff serve` with `--spec off` against its default (`--spec ngram`) and, with `--spec
draft:PATH`, a draft model too, same run.

A server per configuration is started (KV tiers off), all at once; the prompts of
tools/w5_workload are asked one at a time (greedy, streamed), each of every server in turn (so
load beside the benchmark weighs on every configuration alike), and each gateway's /metrics
gives the drafted and accepted tokens and the verified steps. Decode tok/s is a request's tokens
after its first over the time from its first to its last. A benchmark, not a test.

Usage: python -m tools.bench_spec MODEL.gguf [--prompts 10] [--max-tokens 128]
           [--spec off --spec ngram --spec draft:DRAFT.gguf]  (default: off and ngram)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from tools.bench_serving import session, stream
from tools.cpu_server import cpu_server
from tools.w5_workload import code_edits, prose

DEFAULT_CONFIGS = ("off", "ngram")


def _name(spec: str) -> str:
    return "draft" if spec.startswith("draft:") else spec


SERVE = ("--kv-ram-gb", "0", "--kv-disk-gb", "0")


def _body(prompt: str, max_tokens: int) -> bytes:
    body = {"prompt": f"{prompt}\n\nAnswer:\n", "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}  # fmt: skip
    return json.dumps(body).encode()


def _spec_counts(url: str) -> dict[str, float]:
    time.sleep(0.7)  # a heartbeat carries the worker's counts
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("skiff_spec_tokens{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")]
                          .replace('"', "").split(","))  # fmt: skip
            key = f"{labels['event']}:{labels.get('source', '')}".rstrip(":")
            out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


async def _ask(url: str, prompts: list[str], max_tokens: int) -> list[float]:
    rates = []
    async with session() as s:
        for p in prompts:
            stamps: list[float] = []
            r = await stream(s, url, _body(p, max_tokens), stamps)
            if "error" in r:
                raise RuntimeError(r["error"])
            if len(stamps) > 2 and r["tokens"] > 1:
                rates.append((r["tokens"] - 1) / (stamps[-1] - stamps[0]))
    return rates


def _label(spec: str) -> str:
    """A configuration's name in the results: the draft's file name for a draft model."""
    return f"draft:{Path(spec[6:]).name}" if spec.startswith("draft:") else spec


def run(model: Path, specs: list[str], a: argparse.Namespace) -> list[dict]:
    """Every configuration's server up at once (idle but one), each prompt asked of each in
    turn: a machine whose load changes (other work beside it) weighs on all alike."""
    with ExitStack() as stack:
        urls = {}
        for i, spec in enumerate(specs):
            log = Path(a.logs) / f"spec-{model.stem}-{_name(spec)}-{i}.log"
            args = (*SERVE, "--spec", spec)
            urls[spec] = stack.enter_context(cpu_server(model, a.port + i, args, log))
        for url in urls.values():
            asyncio.run(_ask(url, prose(1), 8))  # warm-up
        out = []
        for name, prompts in (("code-edit", code_edits(a.prompts)), ("prose", prose(a.prompts))):
            before = {spec: _spec_counts(url) for spec, url in urls.items()}
            rates: dict[str, list[float]] = {spec: [] for spec in specs}
            for p in prompts:
                for spec, url in urls.items():
                    rates[spec] += asyncio.run(_ask(url, [p], a.max_tokens))
            for spec, url in urls.items():
                after = _spec_counts(url)
                delta = {k: v - before[spec].get(k, 0.0) for k, v in after.items()}
                out.append(_row(model, spec, name, rates[spec], delta))
                print(json.dumps(out[-1]), flush=True)
    return out


def _row(model: Path, spec: str, workload: str, rates: list[float], delta: dict) -> dict:
    steps = delta.get("steps", 0.0)
    accepted = sum(v for k, v in delta.items() if k.startswith("accepted"))
    return {
        "model": model.name,
        "config": _label(spec),
        "workload": workload,
        "decode_tok_s_median": round(statistics.median(rates), 2),
        "decode_tok_s_mean": round(statistics.fmean(rates), 2),
        "verified_steps": steps,
        "accepted_per_verified_step": round(accepted / steps, 3) if steps else 0.0,
        "by_source": {k: v for k, v in delta.items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", type=Path)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--logs", default="/tmp")
    p.add_argument(
        "--spec", action="append", default=None, help="off, ngram or draft:PATH (repeatable)"
    )
    a = p.parse_args(argv)
    specs = a.spec or list(DEFAULT_CONFIGS)
    if "off" not in specs:
        specs.insert(0, "off")  # the baseline every speed-up is against
    rows = run(a.model, specs, a)
    print("\n| model | workload | config | tok/s | speed-up | accepted / verified step |")
    for w in ("code-edit", "prose"):
        off = next(r for r in rows if r["config"] == "off" and r["workload"] == w)
        for on in (r for r in rows if r["config"] != "off" and r["workload"] == w):
            x = on["decode_tok_s_mean"] / off["decode_tok_s_mean"]
            print(f"| {a.model.name} | {w} | {on['config']} | {on['decode_tok_s_mean']} "
                  f"(off {off['decode_tok_s_mean']}) | {x:.2f}x "
                  f"| {on['accepted_per_verified_step']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
