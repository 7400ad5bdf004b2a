"""A run's numbers: percentiles, the summary, the table printed like `vllm bench serve`'s, and the
JSON file (vLLM's key names where vLLM has one: summary times in ms, per-request times in s)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from shared.bench.client import RequestResult

# (key in the summary, section title, row label)
_METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)
_PERCENTILES = (50, 90, 99)


def percentile(xs: Sequence[float], p: float) -> float | None:
    """The p-th percentile with linear interpolation between ranks (numpy's default); None
    for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Each metric's values in seconds over the successful requests (ITL: every gap of every
    request, pooled)."""
    ok = [r for r in results if r.ok]
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for t in (r.tpot for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok if r.latency is not None],
    }


def summarize(results: Sequence[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    reported = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    input_tokens = sum(reported) if reported else None
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + (input_tokens or 0))
        if input_tokens is not None
        else None,
    }
    for key, values in samples(results).items():
        ms = [1000 * v for v in values]
        out[f"mean_{key}_ms"] = statistics.fmean(ms) if ms else None
        out[f"median_{key}_ms"] = percentile(ms, 50)
        for p in _PERCENTILES[1:]:
            out[f"p{p}_{key}_ms"] = percentile(ms, p)
    return out


def format_table(summary: dict, concurrency: int | None, request_rate: float) -> str:
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: float | int | str | None, fmt: str = "{:.2f}") -> None:
        text = "n/a" if value is None else value if isinstance(value, str) else fmt.format(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", summary["completed"], "{}")
    row("Failed requests:", summary["failed"], "{}")
    row("Maximum request concurrency:", concurrency if concurrency else "none", "{}")
    row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"], "{}")
    row("Total generated tokens:", summary["total_output_tokens"], "{}")
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for key, title, label in _METRICS:
        lines.append(f"{title:-^50}")
        row(f"Mean {label} (ms):", summary[f"mean_{key}_ms"])
        row(f"Median {label} (ms):", summary[f"median_{key}_ms"])
        for p in _PERCENTILES[1:]:
            row(f"P{p} {label} (ms):", summary[f"p{p}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def write_json(
    path: str | Path, settings: dict, summary: dict, results: Sequence[RequestResult]
) -> None:
    """Settings, summary and every request's own numbers (lists in request order)."""
    doc = {
        **settings,
        **summary,
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens if r.ok else 0 for r in results],
        "ttfts": [r.ttft if r.ok else None for r in results],
        "tpots": [r.tpot for r in results],
        "e2els": [r.latency if r.ok else None for r in results],
        "itls": [r.itl if r.ok else [] for r in results],
        "errors": [r.error for r in results],
    }
    Path(path).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
