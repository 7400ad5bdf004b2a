"""The benchmark's request loop and `skiff bench`'s entry point: prompts are sent at their
arrival times, at most --concurrency at once, and every request's timings are kept."""

from __future__ import annotations

import asyncio
import collections
import math
import sys
import time
from collections.abc import Sequence

import aiohttp

from shared.bench.client import (
    NO_TEXT,
    RequestResult,
    endpoint_path,
    first_model,
    request_body,
    stream_request,
)
from shared.bench.options import BenchConfig
from shared.bench.progress import ProgressBar
from shared.bench.report import format_table, summarize, write_json
from shared.bench.workload import arrival_times, load_dataset, random_prompts


def run_bench(cfg: BenchConfig) -> int:
    """Runs the benchmark, prints the table on stdout (and writes the JSON file): 0 when at
    least one request succeeded."""
    try:
        if cfg.dataset:
            prompts = load_dataset(cfg.dataset, cfg.num_prompts)
        else:
            prompts = random_prompts(cfg.num_prompts, cfg.input_len, cfg.seed)
    except ValueError as e:
        print(f"skiff bench: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_bench(cfg, prompts))
    except KeyboardInterrupt:
        print("\nskiff bench: interrupted", file=sys.stderr)
        return 130


def _session() -> aiohttp.ClientSession:
    # No pooled keep-alive: reusing connections gave spurious disconnects against llama-server
    # (tools/bench_serving.py); the concurrency cap is ours, not the connector's.
    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=6 * 3600))


async def _bench(cfg: BenchConfig, prompts: list[str]) -> int:
    url = cfg.url + endpoint_path(cfg.endpoint)
    async with _session() as session:
        try:
            model = cfg.model or await first_model(session, cfg.url, cfg.api_key)
        except RuntimeError as e:
            print(f"skiff bench: {e}", file=sys.stderr)
            return 1
        rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}/s"
        print(
            f"skiff bench: {len(prompts)} requests to {url}, model {model}, "
            f"concurrency {cfg.concurrency or 'no cap'}, request rate {rate}",
            file=sys.stderr,
        )
        # One short untimed request first: a wrong URL, model or key fails here, at once.
        body = request_body(cfg.endpoint, model, prompts[0], min(cfg.output_len, 4), False)
        test = await stream_request(session, url, body, cfg.api_key)
        if not test.ok and test.error != NO_TEXT:
            print(f"skiff bench: the test request failed: {test.error}", file=sys.stderr)
            return 1
        bodies = [
            request_body(cfg.endpoint, model, p, cfg.output_len, cfg.ignore_eos) for p in prompts
        ]
        times = arrival_times(len(bodies), cfg.request_rate, cfg.seed)
        progress = ProgressBar(len(bodies), cfg.progress)
        try:
            results, duration = await run_requests(
                session, url, bodies, times, cfg.concurrency, cfg.api_key, progress
            )
        finally:
            progress.close()
    summary = summarize(results, duration)
    print(format_table(summary, cfg.concurrency, cfg.request_rate))
    errors = collections.Counter(r.error for r in results if not r.ok)
    for error, count in errors.most_common(3):
        print(f"skiff bench: {count} failed with: {error}", file=sys.stderr)
    if cfg.json_path:
        settings = {**cfg.as_dict(), "model": model, "date": time.strftime("%Y%m%d-%H%M%S")}
        write_json(cfg.json_path, settings, summary, results)
        print(f"skiff bench: wrote {cfg.json_path}", file=sys.stderr)
    return 0 if summary["completed"] else 1


async def run_requests(
    session: aiohttp.ClientSession,
    url: str,
    bodies: Sequence[bytes],
    times: Sequence[float],
    concurrency: int | None,
    api_key: str | None,
    progress: ProgressBar,
) -> tuple[list[RequestResult], float]:
    """Sends bodies[i] at times[i] seconds from the start (once fewer than `concurrency` are in
    flight); the results in request order and the seconds from the start to the last end."""
    cap = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[RequestResult] = [RequestResult() for _ in bodies]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + times[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if cap is None:
            results[i] = await stream_request(session, url, bodies[i], api_key)
        else:
            async with cap:
                results[i] = await stream_request(session, url, bodies[i], api_key)
        progress.update(results[i].ok)

    await asyncio.gather(*(one(i) for i in range(len(bodies))))
    return results, time.perf_counter() - t0
