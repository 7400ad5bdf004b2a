"""FP8 KV perplexity and KL divergence against fp16 KV over several windows of a text (W6's
quality figures).

    python -m tools.fp8_perplexity MODEL.gguf [--text FILE] [--windows 6] [--tokens 512]

Teacher-forced logits on the CPU (tests/oracle.skiff_logits) for fp16 KV, FP8 with per-token
scales and FP8 with calibrated per-head scales. Prints, per FP8 mode, the perplexity ratio to
fp16's (the geometric mean over `windows` windows of `tokens` tokens, one window per 600 tokens
of text) and the mean KL divergence of its next-token distributions from fp16's, in nats a token.
Over a few thousand tokens the perplexity ratio moves by tenths of a percent with the rounding
pattern, either way (a perturbation can lower it); the KL divergence counts every perturbation
as a loss, so it ranks two ways of quantizing more steadily.
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

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
MODES = {"token": {"kv_dtype": torch.float8_e4m3fn, "kv_scales": "token"},
         "head": {"kv_dtype": torch.float8_e4m3fn, "kv_scales": "head"}}  # fmt: skip


def log_probs(path: Path, ids: list[int], **kv) -> torch.Tensor:
    """[len(ids) - 1, vocab] float64 log-probabilities of each next token."""
    logits = torch.from_numpy(skiff_logits(path, ids, **kv)[:-1]).double()
    return torch.log_softmax(logits, -1)


def compare(path: Path, windows: list[list[int]]) -> tuple[float, dict[str, tuple[float, float]]]:
    """(fp16 KV's perplexity, {mode: (perplexity ratio - 1, mean KL in nats a token)})."""
    nll = dict.fromkeys(["fp16", *MODES], 0.0)
    kl = dict.fromkeys(MODES, 0.0)
    n = 0
    for ids in windows:
        nxt = torch.tensor(ids[1:])
        rows = torch.arange(len(ids) - 1)
        base = log_probs(path, ids, kv_dtype=torch.float16)
        p_base = base.exp()
        nll["fp16"] -= float(base[rows, nxt].sum())
        for mode, kv in MODES.items():
            lp = log_probs(path, ids, **kv)
            nll[mode] -= float(lp[rows, nxt].sum())
            kl[mode] += float((p_base * (base - lp)).sum())
        n += len(ids) - 1
    out = {m: (math.exp((nll[m] - nll["fp16"]) / n) - 1, kl[m] / n) for m in MODES}
    return math.exp(nll["fp16"] / n), out


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
    ppl, modes = compare(a.model, windows)
    print(f"{a.model.name}: fp16 KV perplexity {ppl:.4f} over {a.windows} x {a.tokens}")
    for mode, (ratio, kl) in modes.items():
        print(f"  fp8 KV, {mode} scales: perplexity {100 * ratio:+.3f} %, KL {kl:.5f} nats/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
