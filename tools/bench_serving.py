"""Serving benchmarks through HTTP (BENCHMARKS.md W2 and W3), for Skiff or llama-server alike.

W2 burst: C concurrent streaming requests, random-id prompts of 512 tokens, 256 generated
(ignore_eos): output tok/s, TTFT p50/p99, TPOT p50/p99.
W3 co-tenant stall: 7 streams (128-token prompts, 1,500 generated); after 3 s one 32,000-token
prompt arrives: the streams' inter-token gaps before and during its prefill, and its TTFT.
W3-cpu (BENCHMARKS.md): the same with --streams 3 --long-len 3000 (or 6000) on the CPU worker.

W2 constrained (--constrained K): every K-th request (the first, then K on) carries a
response_format JSON schema that the output cannot complete before max_tokens (an array of at
least 200 objects), so it is masked every step to its end; from a Skiff server the run also
reports the grammar counters of /metrics (their change over the run) and the masks' host time
per masked step.

Usage: python -m tools.bench_serving URL w2 --concurrency 16 64 256 [--vocab 128256]
       python -m tools.bench_serving URL w2 --concurrency 64 --constrained 4
       python -m tools.bench_serving URL w3
Prints one JSON line per run (and a table); a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
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


# W2 --constrained: a schema no output of 256 tokens completes (200 objects take thousands)
ITEMS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "n": {"type": "integer", "minimum": 0, "maximum": 99999},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    },
    "minItems": 200,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "items", "schema": ITEMS_SCHEMA, "strict": True},
}
JSON_HEAD = '[{"name": "'  # how every constrained output begins (Skiff's JSON layout)
GRAMMAR_LINE = re.compile(r'^skiff_grammar\{.*event="([^"]+)".*\} (\S+)$')


def completion_body(
    prompt: list[int] | str, max_tokens: int, response_format: dict | None = None
) -> bytes:
    """A streamed greedy completion request, JSON-encoded ahead of sending: encoding W3's
    32,000-token prompt in the client's event loop would hold up the streams it times."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if response_format is not None:
        body["response_format"] = response_format
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
    head = ""  # the text's first characters
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
                if len(head) < 32:
                    head += chunk["choices"][0]["text"]
    # a chunk can carry several tokens (or none while UTF-8 is incomplete): trust usage
    return {"start": t0, "tokens": usage if usage is not None else n, "head": head}


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


async def grammar_counts(s: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """Skiff's skiff_grammar gauges in /metrics, summed over workers by event; {} from a server
    without them (or without /metrics)."""
    try:
        async with s.get(f"{url}/metrics") as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = GRAMMAR_LINE.match(line)
        if m:
            counts[m[1]] = counts.get(m[1], 0) + int(float(m[2]))
    return counts


def mask_times(before: dict[str, int], after: dict[str, int]) -> dict:
    """The grammar counters' change over a run and, per masked step, the rows and the host
    microseconds of filling, applying and waiting for the tokens in flight."""
    delta = {k: after[k] - before.get(k, 0) for k in sorted(after)}
    steps = delta.get("steps", 0)
    out: dict = {"grammar": delta}
    for key in ("rows", "fill_us", "apply_us", "catch_up_us"):
        if steps and key in delta:
            out[f"{key}_per_step"] = round(delta[key] / steps, 1)
    return out


async def w2(
    url: str,
    c: int,
    vocab: int,
    prompt_len: int = 512,
    gen: int = 256,
    constrained: int = 0,
    seed: int | None = None,
) -> dict:
    """constrained K > 0: requests 0, K, 2K, ... carry RESPONSE_FORMAT. seed: other prompts
    than another seed's (default: the same for a concurrency every run), so that repeated runs
    against one server find none of theirs in its prefix cache."""
    rng = random.Random(c if seed is None else f"{seed}:{c}")
    prompts = [random_prompt(rng, prompt_len, vocab) for _ in range(c)]
    stamps: list[list[float]] = [[] for _ in range(c)]
    masked = [constrained > 0 and i % constrained == 0 for i in range(c)]
    bodies = [
        completion_body(p, gen, RESPONSE_FORMAT if m else None)
        for p, m in zip(prompts, masked, strict=True)
    ]
    async with session() as s:
        before = await grammar_counts(s, url)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(stream(s, url, b, st) for b, st in zip(bodies, stamps, strict=True))
        )
        wall = time.perf_counter() - t0
        if before:
            await asyncio.sleep(0.5)  # the workers' heartbeats (every 0.2 s) carry the counts
        after = await grammar_counts(s, url) if before else {}
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
        "constrained": sum(masked),
        # constrained outputs that begin as the schema's JSON does
        "constrained_json": sum(
            m and r.get("head", "").startswith(JSON_HEAD)
            for m, r in zip(masked, results, strict=True)
        ),
        **(mask_times(before, after) if after else {}),
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
    p.add_argument(
        "--constrained", type=int, default=0, metavar="K",
        help="W2: every K-th request under a JSON schema (4: a quarter; 0: none)",
    )  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=512, help="W2's prompt tokens")
    p.add_argument("--gen", type=int, default=256, help="W2's generated tokens")
    p.add_argument("--seed", type=int, default=None, help="W2's prompts (default: by C)")
    a = p.parse_args()
    runs = []
    if a.workload == "w2":
        # warm-up; constrained too with --constrained (a worker's first grammar builds its
        # vocabulary's llguidance form: seconds for 128k tokens)
        await w2(a.url, 4, a.vocab, 64, 8, a.constrained)
        for c in a.concurrency:
            runs.append(await w2(a.url, c, a.vocab, a.prompt_len, a.gen, a.constrained, a.seed))
            print(json.dumps({"label": a.label, **runs[-1]}), flush=True)
    else:
        runs.append(
            await w3(a.url, a.vocab, a.long_len, a.streams, a.long_text, a.stream_prompt,
                     a.stream_tokens, a.settle)
        )  # fmt: skip
        print(json.dumps({"label": a.label, **runs[-1]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
