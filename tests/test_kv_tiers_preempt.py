"""Preemption swaps to the RAM tier: a sequence preempted in a KV pool too small for two, whose
blocks are evicted while the other runs on, comes back with them restored from the kvcache's RAM
tier (not recomputed), and its greedy output is the same as a run without preemption. With the
scheduler's resume hook off, the same run restores nothing (it recomputes). One process: the
kvcache's handler serves a real ZMQ socket on a thread, as in test_kv_tiers_stress."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import zmq

from services.kvcache.disk_tier import DiskTier
from services.kvcache.metrics import KVStats
from services.kvcache.ram_tier import RamTier
from services.kvcache.service import KVCacheService
from shared.engine import Sequence
from shared.engine.factory import EngineConfig, build_engine
from shared.kv.block_io import block_bytes, tier_key
from shared.kv.tier_client import TierClient
from shared.sampling import SamplingParams
from shared.worker.kv_tiers import KVTiers
from tests.test_kv_tiers_stress import _serve
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

SPEC = SynthSpec("llama", n_layers=2, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32,
                 ffn_dim=128, vocab=300, seed=23)  # fmt: skip
ENDPOINT = "inproc://kvcache"  # as _serve binds
PROMPTS = [[(7 * i + 3 * k) % 290 + 5 for i in range(70)] for k in (1, 2)]
MAX_TOKENS = 60  # 130 tokens a sequence: 9 blocks of 16 each, in a pool of 12


def _engine(model: Path, kv_blocks: int):
    return build_engine(
        EngineConfig(
            model_path=str(model),
            device="cpu",
            max_model_len=160,
            kv_blocks=kv_blocks,
            max_batch_tokens=64,
            max_seqs=2,
        )  # fmt: skip
    ).engine


def _run(engine, tiers: KVTiers | None) -> list[Sequence]:
    greedy = SamplingParams(temperature=0.0).validate()
    seqs = [Sequence(i, list(p), greedy, MAX_TOKENS) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        if tiers is None or not tiers.admit(seq):
            engine.add(seq)
    for _ in range(5000):
        if not (engine.has_work() or (tiers is not None and tiers.waiting)):
            break
        if tiers is not None:
            for seq in tiers.poll():
                engine.add(seq)
        if engine.has_work():
            engine.step()
        engine.scheduler.check_integrity()
    assert all(len(s.output_ids) == MAX_TOKENS for s in seqs)
    return seqs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("preempt") / "tiny.gguf", SPEC)


@pytest.fixture(scope="module")
def unpreempted(model: Path) -> list[list[int]]:
    seqs = _run(_engine(model, kv_blocks=40), None)
    assert not any(s.num_preemptions for s in seqs)
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("resume", [True, False], ids=["restored", "recomputed"])
def test_preempted_sequence_comes_back_from_the_ram_tier(
    model: Path, unpreempted: list[list[int]], tmp_path: Path, resume: bool
) -> None:
    engine = _engine(model, kv_blocks=12)
    kv = engine.runner.kv
    ram = RamTier(str(tmp_path), "preempt", 64 * block_bytes(kv))
    service = KVCacheService("preempt", ram, DiskTier(str(tmp_path / "disk"), 0), KVStats())
    ctx = zmq.Context()
    stop = threading.Event()
    server = threading.Thread(target=_serve, args=(ctx, service, stop), daemon=True)
    server.start()
    client = TierClient(ctx, ENDPOINT, "w", kv, tier_key(kv, engine.blocks.extra_key))
    try:
        assert client.wait_attached(5)
        tiers = KVTiers(engine, client)
        if not resume:
            engine.scheduler.on_resume = None
        before = client.stats["stored"]
        seqs = _run(engine, tiers)
        assert sum(s.num_preemptions for s in seqs) >= 1
        assert client.stats["stored"] > before
        if resume:
            assert tiers.stats["resumed"] >= 1
            assert tiers.stats["blocks_restored"] > 0, (tiers.stats, client.stats)
            assert tiers.timer.latency.count >= 1  # each restore timed
            counts = tiers.counts()  # what the heartbeat carries
            assert counts["resumed"] == tiers.stats["resumed"]
            assert counts["restored_bytes"] == tiers.stats["blocks_restored"] * block_bytes(kv)
            assert set(tiers.histograms()) == {"latency", "copy"}
        else:
            assert tiers.stats["resumed"] == 0 and tiers.stats["blocks_restored"] == 0
        assert [s.output_ids for s in seqs] == unpreempted
        for _ in range(20):  # the last releases
            tiers.poll()
    finally:
        stop.set()
        server.join(5)
        client.close()
        ctx.term()
    engine.blocks.check_integrity({})
    seg = next(iter(ram.segments.values()))
    seg.check_integrity()
    assert all(seg.pins(s) == 0 for s in range(seg.slots)), "a slot is still pinned"
    ram.close()
