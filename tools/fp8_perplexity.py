"""FP8 KV perplexity against fp16 KV over several windows of a text (W6's quality figure).

    python -m tools.fp8_perplexity MODEL.gguf [--text FILE] [--windows 6] [--tokens 512]

Teacher-forced logits on the CPU (tests/oracle.skiff_logits) for fp16 KV, FP8 with per-token
scales and FP8 with calibrated per-head scales; prints the perplexity ratio to fp16's as the
geometric mean over `windows` windows of `tokens` tokens (one window per 600 tokens of text).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from shared.loader import GGUFFile
from shared.tokenizer import load_tokenizer
from tests.oracle import skiff_logits
from tests.test_fp8_kv import perplexity

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def mean_log_perplexity(path: Path, windows: list[list[int]], **kv) -> float:
    logs = [math.log(perplexity(skiff_logits(path, ids, **kv), ids)) for ids in windows]
    return sum(logs) / len(logs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--tokens", type=int, default=512)
    a = p.parse_args(argv)
    ids = load_tokenizer(GGUFFile(a.model).metadata).encode(a.text.read_text())
    windows = [ids[i * 600 : i * 600 + a.tokens] for i in range(a.windows)]
    if any(len(w) < a.tokens for w in windows):
        raise SystemExit(f"{a.text} has {len(ids)} tokens: too few for {a.windows} windows")
    fp16 = mean_log_perplexity(a.model, windows, kv_dtype=torch.float16)
    print(f"{a.model.name}: fp16 KV perplexity {math.exp(fp16):.4f} over {a.windows} x {a.tokens}")
    for scales in ("token", "head"):
        fp8 = mean_log_perplexity(a.model, windows, kv_dtype=torch.float8_e4m3fn, kv_scales=scales)
        print(f"  fp8 KV, {scales} scales: {100 * (math.exp(fp8 - fp16) - 1):+.3f} %", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
