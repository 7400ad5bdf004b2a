"""W8: the CPU worker beside llama.cpp (llama-cpp-python), same file, same threads.

    python -m tools.bench_cpu MODEL.gguf [MODEL.gguf ...] [--threads 2] [--prompt 512]
                              [--gen 64] [--streams 16] [--cpu-weights int4|float]

Each measurement runs in a process of its own (so that its RSS is its own). Skiff: the engine
on the CPU as the worker builds it (float32 activations, ``--cpu-weights``): prefill tok/s of
a prompt of random ids, single-stream greedy decode tok/s after it, the aggregate decode tok/s
of ``--streams`` sequences, and the process's peak RSS. llama.cpp: the same prompt evaluated
(``Llama.eval``), then ``--gen`` greedy tokens, with n_threads = ``--threads``. One JSON line
per model and engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def skiff(path: str, threads: int, prompt: int, gen: int, streams: int, weights: str) -> dict:
    import torch

    from shared.engine import Sequence
    from shared.engine.factory import EngineConfig, build_engine
    from shared.sampling import SamplingParams

    torch.set_num_threads(threads)
    t = time.perf_counter()
    loaded = build_engine(
        EngineConfig(
            model_path=path, device="cpu", max_model_len=prompt + gen + 16,
            kv_blocks=streams * ((prompt + gen) // 16 + 4) + 64, max_batch_tokens=prompt,
            prefix_caching=False, max_seqs=streams, cpu_weights=weights,
        )
    )  # fmt: skip
    load_s = time.perf_counter() - t
    engine, vocab = loaded.engine, loaded.tokenizer.vocab_size
    params = SamplingParams(temperature=0.0).validate()
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def run(prompts: list[list[int]], first_id: int) -> list[float]:
        for i, p in enumerate(prompts):
            engine.add(Sequence(first_id + i, p, params, gen))
        times = []
        while engine.has_work():
            times += [time.perf_counter() for _ in engine.step()]
        return times

    run([ids(32)], 0)  # warm-up
    t0 = time.perf_counter()
    one = run([ids(prompt)], 1)
    pp = prompt / (one[0] - t0)
    tg = (len(one) - 1) / (one[-1] - one[0])
    many = run([ids(32) for _ in range(streams)], 100)  # short prompts: the decode batches
    agg = (len(many) - streams) / (many[-1] - many[streams - 1])
    return {
        "engine": "skiff", "cpu_weights": weights, "load_s": round(load_s, 1),
        f"pp{prompt}_tok_s": round(pp, 1), "tg_tok_s": round(tg, 1),
        f"tg_{streams}_streams_tok_s": round(agg, 1), "peak_rss_mb": round(_peak_rss_mb()),
    }  # fmt: skip


def llama_cpp(path: str, threads: int, prompt: int, gen: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=path, n_ctx=prompt + gen + 16, n_threads=threads, n_threads_batch=threads,
        n_batch=prompt, verbose=False,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    llm.eval(rng.integers(0, vocab, 32).tolist())  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(rng.integers(0, vocab, prompt).tolist())
    pp = prompt / (time.perf_counter() - t0)
    t1 = time.perf_counter()
    for _ in range(gen):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
        token = int(np.argmax(logits))
        llm.eval([token])
    tg = gen / (time.perf_counter() - t1)
    return {
        "engine": "llama.cpp", f"pp{prompt}_tok_s": round(pp, 1), "tg_tok_s": round(tg, 1),
        "peak_rss_mb": round(_peak_rss_mb()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--cpu-weights", default="native", choices=["native", "int4", "float"])
    p.add_argument("--only", choices=["skiff", "llama.cpp"], help="run one engine, in-process")
    a = p.parse_args(argv)
    for model in a.models:
        if a.only:  # the child process
            if a.only == "skiff":
                out = skiff(str(model), a.threads, a.prompt, a.gen, a.streams, a.cpu_weights)
            else:
                out = llama_cpp(str(model), a.threads, a.prompt, a.gen)
            size = model.stat().st_size
            print(json.dumps({"model": model.name, "file_mb": round(size / 2**20), **out}))
            continue
        for engine in ("skiff", "llama.cpp"):
            cmd = [sys.executable, "-m", "tools.bench_cpu", str(model), "--only", engine]
            cmd += ["--threads", str(a.threads), "--prompt", str(a.prompt), "--gen", str(a.gen)]
            cmd += ["--streams", str(a.streams), "--cpu-weights", a.cpu_weights]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            error = {"model": model.name, "engine": engine, "error": done.stderr[-500:]}
            print(lines[-1] if lines else json.dumps(error), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
