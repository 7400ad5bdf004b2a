"""W4 on the device at hand: a long prompt's time to first token cold, again from the kvcache's
RAM tier after another prompt displaced it from the KV pool, and from the disk tier after the
kvcache and the engine restart; the restore rate beside it.

    python -m tools.bench_tiers MODEL.gguf [--device cpu] [--prompt 2048] [--threads 2]

With --copy-bench (no model): the block copies alone, between a KV pool of an 8B model's shape
(32 layers, 8 KV heads of 128, blocks of 16 tokens; --kv-dtype) and pinned host slots, in GB/s:
save_blocks / load_blocks (batched, through the staging buffer), save_block / load_block (piece
by piece) and one plain pinned copy of the same bytes, each way. Blocks and slots in shuffled
order, as a pool and a RAM tier hand them out.

    python -m tools.bench_tiers --copy-bench --device cuda [--copy-blocks 1024]

The engine runs in this process with the worker's tier code (``KVTiers``, ``TierClient``); the
kvcache is a real `python -m services.kvcache` process. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _kvcache(endpoint: str, disk: str, shm: str, ram_gb: float) -> subprocess.Popen:
    argv = [sys.executable, "-m", "services.kvcache", "--endpoint", endpoint, "--ram-gb",
            str(ram_gb), "--disk-dir", disk, "--disk-gb", "16", "--shm-dir", shm]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for _ in range(20):
        if "ready" in proc.stderr.readline():
            return proc
    raise RuntimeError("the kvcache did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ram-gb", type=float, default=2.0)
    p.add_argument("--copy-bench", action="store_true", help="block copies' GB/s, no model")
    p.add_argument("--copy-blocks", type=int, default=1024, help="blocks moved per copy")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-dtype", default="float16", choices=["float16", "bfloat16", "fp8"])
    a = p.parse_args()
    if a.copy_bench:
        from tools.bench_copies import copy_bench

        print(json.dumps(copy_bench(a.device, a.copy_blocks, a.layers, a.kv_dtype)), flush=True)
        return
    if a.model is None:
        p.error("a model is needed (or --copy-bench)")

    import torch
    import zmq

    from shared.engine import Sequence
    from shared.engine.factory import EngineConfig, build_engine
    from shared.kv.block_io import tier_key
    from shared.kv.tier_client import TierClient
    from shared.sampling import SamplingParams
    from shared.worker.kv_tiers import KVTiers

    torch.set_num_threads(a.threads)
    blocks = a.prompt // 16 + 8
    cfg = EngineConfig(model_path=a.model, device=a.device, max_model_len=a.prompt + 32,
                       kv_blocks=blocks, max_batch_tokens=512, max_seqs=2)  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="bench-tiers-")
    endpoint = f"ipc://{tmp}/kv.sock"
    ctx = zmq.Context()
    greedy = SamplingParams(temperature=0.0).validate()
    g = torch.Generator().manual_seed(0)
    ids = {k: torch.randint(3, 30000, (a.prompt,), generator=g).tolist() for k in "ab"}
    counter = iter(range(1_000_000))

    def ttft(engine, tiers, prompt: list[int]) -> tuple[float, int]:
        seq = Sequence(next(counter), prompt, greedy, 2)
        t0 = time.perf_counter()
        if tiers is None or not tiers.admit(seq):
            engine.add(seq)
        first = None
        while engine.has_work() or (tiers is not None and tiers.waiting):
            if tiers is not None:
                for s in tiers.poll():
                    engine.add(s)
            for _ in engine.step():
                first = first or time.perf_counter()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        return (first or time.perf_counter()) - t0, seq.num_cached_tokens

    def engine_with_tiers():
        loaded = build_engine(cfg)
        engine = loaded.engine
        kv = engine.runner.kv
        client = TierClient(ctx, endpoint, "bench", kv, tier_key(kv, engine.blocks.extra_key))
        assert client.wait_attached(10), "no answer from the kvcache"
        return engine, KVTiers(engine, client)

    out = {"model": os.path.basename(a.model), "device": a.device, "prompt": a.prompt}
    kvc = _kvcache(endpoint, f"{tmp}/disk", tmp, a.ram_gb)
    try:
        engine, tiers = engine_with_tiers()
        ttft(engine, tiers, ids["b"][:64])  # warm-up
        out["cold_ttft_s"], _ = ttft(engine, tiers, ids["a"])
        ttft(engine, tiers, ids["b"])  # displaces a from the pool
        t, cached = ttft(engine, tiers, ids["a"])
        out["ram_ttft_s"], out["ram_cached_tokens"] = t, cached
        restored = tiers.stats["blocks_restored"]
        tiers.client.close()
        kvc.terminate()
        kvc.wait(30)
        kvc = _kvcache(endpoint, f"{tmp}/disk", tmp, a.ram_gb)  # restart: the disk tier
        engine, tiers = engine_with_tiers()
        ttft(engine, tiers, ids["b"][:64])
        t, cached = ttft(engine, tiers, ids["a"])
        out["disk_ttft_s"], out["disk_cached_tokens"] = t, cached
        tiers.client.close()
        from shared.kv.block_io import block_bytes

        out["block_bytes"] = block_bytes(engine.runner.kv)
        out["ram_blocks_restored"] = restored
    finally:
        kvc.kill()
        ctx.term()
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
