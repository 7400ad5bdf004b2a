"""Greedy answers of a server, one request at a time, as JSON lines: for comparing two serving
layouts (a combined worker, prefill and decode workers) on a device, where the e2e tests' model
files are not carried.

    python -m tools.greedy_answers URL OUT.jsonl [--n 12] [--max-tokens 32] [--vocab 128256]
    python -m tools.greedy_answers --compare A.jsonl B.jsonl

Prompts are random token ids of varied lengths (under a block up to 3,000 tokens, so that
prompts of one and of several chunks, with and without a partial last block, are handed on);
answers are compared by their text and their token count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from pathlib import Path

LENGTHS = (5, 16, 17, 100, 511, 512, 513, 1000, 2047, 3000)


def answer(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return {"text": out["choices"][0]["text"], "tokens": out["usage"]["completion_tokens"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("args", nargs=2, help="URL OUT.jsonl, or with --compare A.jsonl B.jsonl")
    p.add_argument("--compare", action="store_true")
    p.add_argument("--n", type=int, default=len(LENGTHS))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128256)
    a = p.parse_args()
    if a.compare:
        x, y = (Path(f).read_text().splitlines() for f in a.args)
        same = sum(json.loads(u) == json.loads(v) for u, v in zip(x, y, strict=True))
        print(json.dumps({"greedy_identical": same, "of": len(x)}))
        return 0 if same == len(x) else 1
    url, out = a.args
    rng = random.Random(0)
    low = min(1000, a.vocab // 8)
    with open(out, "w") as f:
        for i in range(a.n):
            n = LENGTHS[i % len(LENGTHS)]
            prompt = [rng.randrange(low, a.vocab - low) for _ in range(n)]
            f.write(json.dumps({"len": n, **answer(url, prompt, a.max_tokens)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
