"""Mask time per step for a batch of constrained sequences: llguidance against xgrammar (issue 47's
choice of grammar engine), on a GGUF model's vocabulary, on this machine's cores.

    python -m tools.bench_grammar MODEL.gguf [--batch 64] [--steps 40] [--threads N]

B sequences, each under one of a few JSON schemas, step together: each step fills the batch's
token masks (one 32-bit word per 32 tokens) and each sequence then takes a random allowed token.
Prints per engine: the vocabulary's setup time, a grammar's compile time, and the masks' fill
time per step (median and p90 over the steps), one JSON line each. xgrammar is optional (it
needs transformers at import; it is not a dependency of Skiff): missing, its line says so.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llguidance
import llguidance.numpy as llnp
import numpy as np

from shared.grammar.constraint import GrammarCompiler, Vocabulary
from shared.loader import GGUFFile
from shared.tokenizer import load_tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
     "age": {"type": "integer", "minimum": 0, "maximum": 150},
     "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
     "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
               "required": ["x", "y"], "additionalProperties": False}},
     "required": ["city", "point"], "additionalProperties": False},
]  # fmt: skip
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _llguidance(tok, vocab: int, batch: int, steps: int, threads: int | None) -> dict:
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, vocab)
    setup = time.perf_counter() - t0
    grammars = [llguidance.LLMatcher.grammar_from_json_schema(s, defaults=LAYOUT) for s in SCHEMAS]
    t0 = time.perf_counter()
    matchers = [compiler.compile(grammars[i % len(grammars)]).matcher for i in range(batch)]
    compile_ms = (time.perf_counter() - t0) / batch * 1e3
    executor = llguidance.LLExecutor(threads)
    masks = llnp.allocate_token_bitmask(batch, vocab)
    rng, times = random.Random(0), []
    for _ in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            break
        t0 = time.perf_counter()
        llnp.fill_next_token_bitmask_par(executor, live, masks)
        times.append(time.perf_counter() - t0)
        for m, i in live:
            m.consume_token(int(rng.choice(_allowed(masks[i], vocab))))
    return _row("llguidance", setup, compile_ms, times, batch)


def _xgrammar(tok, vocab: int, batch: int, steps: int, threads: int | None) -> dict:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        return {"engine": "xgrammar", "missing": str(exc)}
    t0 = time.perf_counter()
    stops = sorted(tok.stop_ids) or [tok.eos_id]
    info = xgr.TokenizerInfo(Vocabulary(tok, stops).tokens, xgr.VocabType.RAW,
                             vocab_size=vocab, stop_token_ids=stops)  # fmt: skip
    compiler = xgr.GrammarCompiler(info, max_threads=threads or 8)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = [compiler.compile_json_schema(s, any_whitespace=False, separators=(", ", ": "))
                for s in SCHEMAS]  # fmt: skip
    compile_ms = (time.perf_counter() - t0) / len(SCHEMAS) * 1e3
    matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(batch)]
    runner = xgr.BatchGrammarMatcher(threads or "auto")
    masks = xgr.allocate_token_bitmask(batch, vocab)
    rng, times = random.Random(0), []
    for _ in range(steps):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        runner.batch_fill_next_token_bitmask([matchers[i] for i in live], masks, indices=live)
        times.append(time.perf_counter() - t0)
        for i in live:
            matchers[i].accept_token(int(rng.choice(_allowed(masks[i].numpy(), vocab))))
    return _row("xgrammar", setup, compile_ms, times, batch)


def _row(engine: str, setup: float, compile_ms: float, times: list[float], batch: int) -> dict:
    ms = sorted(t * 1e3 for t in times)
    return {
        "engine": engine, "batch": batch, "steps": len(ms), "vocab_setup_s": round(setup, 2),
        "compile_ms_per_grammar": round(compile_ms, 2),
        "mask_ms_per_step_median": round(statistics.median(ms), 3) if ms else None,
        "mask_ms_per_step_p90": round(ms[int(0.9 * (len(ms) - 1))], 3) if ms else None,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    f = GGUFFile(a.model)
    tok = load_tokenizer(f.metadata)
    vocab = tok.vocab_size
    for bench in (_llguidance, _xgrammar):
        row = bench(tok, vocab, a.batch, a.steps, a.threads)
        print(json.dumps({"model": a.model.rsplit("/", 1)[-1], **row}), flush=True)


if __name__ == "__main__":
    main()
