"""Serving benchmarks through HTTP (BENCHMARKS.md W2 and W3), for Skiff or llama-server alike.

W2 burst: C concurrent streaming requests, random-id prompts of 512 tokens, 256 generated
(ignore_eos): output tok/s, TTFT p50/p99, TPOT p50/p99.
W3 co-tenant stall: 7 streams (128-token prompts, 1,500 generated); after 3 s one 32,000-token
prompt arrives: the streams' inter-token gaps before and during its prefill, and its TTFT.
W3-cpu (BENCHMARKS.md): the same with --streams 3 --long-len 3000 (or 6000) on the CPU worker.

Usage: python -m tools.bench_serving URL w2 --concurrency 16 64 256 [--vocab 128256]
       python -m tools.bench_serving URL w3
Prints one JSON line per run (and a table); a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    low = min(1000, vocab // 8)  # away from the special tokens at both ends of a vocabulary
    return [rng.randrange(low, vocab - low) for _ in range(n)]


def random_text(rng: random.Random, n_words: int) -> str:
    """Text of about n_words tokens (common words), for prompts a server has to tokenize."""
    words = ("the", "cache", "holds", "keys", "and", "values", "of", "every", "token", "seen")
    return " ".join(rng.choice(words) for _ in range(n_words))


def completion_body(prompt: list[int] | str, max_tokens: int) -> bytes:
    """A streamed greedy completion request, JSON-encoded ahead of sending: encoding W3's
    32,000-token prompt in the client's event loop would hold up the streams it times."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    return json.dumps(body).encode()


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    stamps: list[float],
) -> dict:
    """Streams one completion (a completion_body); appends the arrival time of every token
    chunk to `stamps`."""
    t0 = time.perf_counter()
    n = 0
    usage = None
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return {"error": str(chunk["error"])[:200]}
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
                n += 1
    # a chunk can carry several tokens (or none while UTF-8 is incomplete): trust usage
    return {"start": t0, "tokens": usage if usage is not None else n}


def _steps(stamps: list[float], burst_s: float = 0.002) -> list[float]:
    """Arrival times with the tokens of one engine step as one arrival: a verified draft's
    tokens arrive together, and their sub-millisecond spacing is no gap between steps."""
    out: list[float] = []
    for t in stamps:
        if not out or t - out[-1] > burst_s:
            out.append(t)
    return out


def session() -> aiohttp.ClientSession:
    # keep-alive reuse produced spurious disconnects against llama-server (GPU.md)
    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600))


async def w2(url: str, c: int, vocab: int, prompt_len: int = 512, gen: int = 256) -> dict:
    rng = random.Random(c)
    prompts = [random_prompt(rng, prompt_len, vocab) for _ in range(c)]
    stamps: list[list[float]] = [[] for _ in range(c)]
    async with session() as s:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(
                stream(s, url, completion_body(p, gen), st)
                for p, st in zip(prompts, stamps, strict=True)
            )
        )
        wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    ttft = [st[0] - r["start"] for r, st in zip(results, stamps, strict=True) if st]
    tpot = [(st[-1] - st[0]) / (len(st) - 1) for st in stamps if len(st) > 1]
    out = sum(r.get("tokens", 0) for r in results)
    return {
        "workload": "W2",
        "concurrency": c,
        "output_tokens": out,
        "wall_s": round(wall, 2),
        "output_tok_s": round(out / wall, 1),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
        "tpot_p50_ms": round(1000 * percentile(tpot, 50), 2),
        "tpot_p99_ms": round(1000 * percentile(tpot, 99), 2),
        "errors": errors[:3],
        "n_errors": len(errors),
    }


async def w3(
    url: str,
    vocab: int,
    long_len: int = 32000,
    streams: int = 7,
    long_text: bool = False,
    stream_prompt: int = 128,
    stream_tokens: int = 1500,
    settle_s: float = 3.0,
    seed: int = 3,
    min_before: int = 0,
) -> dict:
    """The streams are cancelled (the server aborts them) a second after the long prompt's
    answer ends: what follows its prefill is not measured."""
    rng = random.Random(seed)  # another seed: other prompts (no prefix-cache hit of a run)
    stamps: list[list[float]] = [[] for _ in range(streams)]
    long_stamps: list[float] = []
    async with session() as s:
        tasks = [
            asyncio.create_task(
                stream(
                    s,
                    url,
                    completion_body(random_prompt(rng, stream_prompt, vocab), stream_tokens),
                    st,
                )
            )  # fmt: skip
            for st in stamps
        ]
        long_prompt = (
            random_text(rng, long_len) if long_text else random_prompt(rng, long_len, vocab)
        )
        long_body = completion_body(long_prompt, 16)  # encoded before timing starts
        await asyncio.sleep(settle_s)
        # a loaded machine may not have started every stream yet: gaps before are needed
        deadline = time.perf_counter() + 120
        while min(map(len, stamps)) < min_before and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
        t_long = time.perf_counter()
        long_result = await stream(s, url, long_body, long_stamps)
        await asyncio.sleep(1.0)
        for t in tasks:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        results = [r for r in done if isinstance(r, dict)] + [long_result]
    errors = [r["error"] for r in results if "error" in r]
    first = long_stamps[0] if long_stamps else float("nan")
    before, during = [], []
    for st in map(_steps, stamps):
        for a, b in zip(st, st[1:], strict=False):
            if b <= t_long:
                before.append(b - a)
            elif a >= t_long and b <= first:
                during.append(b - a)
            elif a < first and b > t_long:
                during.append(b - a)  # a gap overlapping the prefill counts as during
    ms = lambda x: round(1000 * x, 2)  # noqa: E731
    return {
        "workload": "W3",
        "gap_before_median_ms": ms(percentile(before, 50)),
        "gap_before_max_ms": ms(max(before, default=float("nan"))),
        "gap_during_median_ms": ms(percentile(during, 50)),
        "gap_during_max_ms": ms(max(during, default=float("nan"))),
        "gap_during_p99_ms": ms(percentile(during, 99)),
        "gaps_during_over_50ms": sum(g > 0.05 for g in during),
        "long_prompt_ttft_s": round(first - t_long, 3),
        "gaps_during": len(during),
        "errors": errors[:3],
        "n_errors": len(errors),
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url")
    p.add_argument("workload", choices=["w2", "w3"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--label", default="")
    p.add_argument("--long-len", type=int, default=32000)
    p.add_argument("--long-text", action="store_true", help="W3's long prompt as text, not ids")
    p.add_argument("--streams", type=int, default=7, help="W3's decoding streams")
    p.add_argument("--stream-prompt", type=int, default=128, help="W3's streams' prompt tokens")
    p.add_argument("--stream-tokens", type=int, default=1500, help="W3's streams' max tokens")
    p.add_argument("--settle", type=float, default=3.0, help="W3: seconds before the long one")
    a = p.parse_args()
    runs = []
    if a.workload == "w2":
        await w2(a.url, 4, a.vocab, 64, 8)  # warm-up
        for c in a.concurrency:
            runs.append(await w2(a.url, c, a.vocab))
            print(json.dumps({"label": a.label, **runs[-1]}), flush=True)
    else:
        runs.append(
            await w3(a.url, a.vocab, a.long_len, a.streams, a.long_text, a.stream_prompt,
                     a.stream_tokens, a.settle)
        )  # fmt: skip
        print(json.dumps({"label": a.label, **runs[-1]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
