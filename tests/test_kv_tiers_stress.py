"""The worker's side of the KV tiers against the kvcache's handler over a real ZMQ socket, in one
process: 500 requests with shared prefixes, random cancels, a KV pool small enough to preempt
and a RAM tier smaller than the working set. Afterwards every block and slot is accounted for:
the pool's integrity check with nothing held, the RAM tier's, no pins left, and the worker's
grants the only slots granted."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import zmq

from services.kvcache.disk_tier import DiskTier
from services.kvcache.metrics import KVStats
from services.kvcache.ram_tier import RamTier
from services.kvcache.service import KVCacheService
from shared.engine import Sequence
from shared.engine.factory import EngineConfig, build_engine
from shared.kv.block_io import block_bytes, tier_key
from shared.kv.tier_client import TierClient
from shared.protocol import encoder
from shared.sampling import SamplingParams
from shared.worker.kv_tiers import KVTiers
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

SPEC = SynthSpec("llama", n_layers=2, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32,
                 ffn_dim=128, vocab=300, seed=11)  # fmt: skip
ENDPOINT = "inproc://kvcache"


def _serve(ctx: zmq.Context, service: KVCacheService, stop: threading.Event) -> None:
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(ENDPOINT)
    enc = encoder()
    while not stop.is_set():
        if not sock.poll(5):
            continue
        reply = service.handle(sock.recv_multipart())
        if reply:
            sock.send_multipart([reply[0], enc.encode(reply[1])])
    sock.close(linger=0)


def test_500_requests_leave_no_block_or_slot_behind(tmp_path: Path) -> None:
    model = write_synthetic_gguf(tmp_path / "tiny.gguf", SPEC)
    loaded = build_engine(
        EngineConfig(
            model_path=str(model), device="cpu", max_model_len=192, kv_blocks=24,
            max_batch_tokens=128, max_seqs=6,
        )
    )  # fmt: skip
    engine = loaded.engine
    kv = engine.runner.kv
    n_bytes = block_bytes(kv)
    ram = RamTier(str(tmp_path), "stress", 40 * n_bytes)  # fewer slots than the working set
    service = KVCacheService("stress", ram, DiskTier(str(tmp_path / "disk"), 64 << 20), KVStats())
    ctx = zmq.Context()
    stop = threading.Event()
    server = threading.Thread(target=_serve, args=(ctx, service, stop), daemon=True)
    server.start()
    client = TierClient(ctx, ENDPOINT, "w", kv, tier_key(kv, engine.blocks.extra_key))
    try:
        assert client.wait_attached(5)
        tiers = KVTiers(engine, client)
        rng = random.Random(5)
        prefixes = [[rng.randrange(3, SPEC.vocab) for _ in range(rng.randrange(40, 100))]
                    for _ in range(6)]  # fmt: skip
        greedy = SamplingParams(temperature=0.0).validate()
        admitted = finished = cancelled = 0
        live: set[int] = set()
        seqs: list[Sequence] = []
        while admitted < 500 or live or tiers.waiting:
            for _ in range(rng.randrange(0, 3)):
                if admitted == 500:
                    break
                ids = rng.choice(prefixes) + [
                    rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))
                ]
                seq = Sequence(admitted, ids, greedy, rng.randrange(1, 12))
                seqs.append(seq)
                engine.check(seq)
                if not tiers.admit(seq):
                    engine.add(seq)
                live.add(admitted)
                admitted += 1
            if live and rng.random() < 0.08:  # a cancel, wherever the request is
                victim = rng.choice(sorted(live))
                if tiers.abort(victim) or engine.abort(victim):
                    live.discard(victim)
                    cancelled += 1
            for seq in tiers.poll():
                engine.add(seq)
            if engine.has_work():
                for ev in engine.step():
                    if ev.finish_reason is not None:
                        live.discard(ev.seq_id)
                        finished += 1
            engine.scheduler.check_integrity()
        assert finished + cancelled == 500 and cancelled > 10
        assert (
            engine.scheduler.num_preemptions
            if hasattr(engine.scheduler, "num_preemptions")
            else True
        )
        for _ in range(50):  # the last releases and puts
            tiers.poll()
        stop.set()
        server.join(5)
    finally:
        stop.set()
        client.close()
        ctx.term()
    # the pool: nothing held, every block free
    engine.blocks.check_integrity({})
    assert engine.blocks.num_free == engine.blocks.num_blocks
    # the tiers were used: blocks copied out, restored into the pool
    assert client.stats["stored"] > 50 and tiers.stats["blocks_restored"] > 50, (
        client.stats, tiers.stats)  # fmt: skip
    seg = next(iter(ram.segments.values()))
    seg.check_integrity()
    assert all(seg.pins(s) == 0 for s in range(seg.slots)), "a slot is still pinned"
    identity = service._by_id["w"]
    assert seg.granted_to(identity) == sorted(client.granted), "slots granted but not held"
    assert sum(len(seg.granted_to(o)) for o in service._workers) == len(client.granted)
