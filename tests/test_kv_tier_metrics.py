"""The KV tiers on /metrics, read back from the exposition text: the kvcache's per-tier blocks,
bytes, hits, misses, restored bytes and corrupt entries; the worker's restore-time histograms
(RestoreTimer), carried by its heartbeat to the gateway as `skiff_kv_restore_seconds`."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics
from services.kvcache.metrics import KVCacheCollector
from shared.protocol import Heartbeat, Histogram, KVBlock, KVHello, KVLookup, KVPut, decoder
from shared.worker.restore_timing import BOUNDS_S, LatencyHistogram, RestoreTimer
from tests.test_kvcache_service import A, _call, _service
from tests.test_kvcache_tiers import BB, KEY, _payload


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, for every sample of the exposition."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_kvcache_metrics_per_tier(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    att = _call(svc, A, KVHello("a", KEY, BB, 10))
    seg = svc.ram.segments[KEY]
    for i, h in enumerate((100, 101)):
        seg.view(att.granted[i])[:] = np.frombuffer(_payload(h), dtype=np.uint8)
    blocks = [KVBlock(100, att.granted[0], [1]), KVBlock(101, att.granted[1], [2])]
    _call(svc, A, KVPut("inst", blocks))
    found = _call(svc, A, KVLookup("inst", 1, [100, 101, 102]))
    assert [b.hash for b in found.blocks] == [100, 101]
    assert svc.disk.flush() and svc.disk.blocks == 2
    assert svc.disk.get(KEY, 100, BB * 2) is None  # a value of the wrong size: corrupt, dropped
    registry = CollectorRegistry()
    registry.register(KVCacheCollector(svc.stats, svc.ram, svc.disk))
    m = _samples(generate_latest(registry))
    ram, disk = (("tier", "ram"),), (("tier", "disk"),)
    assert m[("skiff_kvcache_blocks", ram)] == 2 and m[("skiff_kvcache_blocks", disk)] == 1
    assert m[("skiff_kvcache_bytes", ram)] == 2 * BB
    assert BB < m[("skiff_kvcache_bytes", disk)] < 2 * BB  # one value: the block and its header
    assert m[("skiff_kvcache_hits_total", ram)] == 2 and m[("skiff_kvcache_hits_total", disk)] == 0
    assert m[("skiff_kvcache_misses_total", ram)] == 1
    assert m[("skiff_kvcache_misses_total", disk)] == 1
    assert m[("skiff_kvcache_restored_bytes_total", ram)] == 2 * BB
    assert m[("skiff_kvcache_restored_bytes_total", disk)] == 0
    assert m[("skiff_kvcache_corrupt_total", disk)] == 1
    svc.ram.close()
    svc.disk.close()


def test_latency_histogram_buckets() -> None:
    h = LatencyHistogram((0.001, 0.01, 0.1))
    for s in (0.0005, 0.001, 0.002, 0.05, 3.0):
        h.observe(s)
    assert h.counts == [2, 1, 1, 1] and h.count == 5  # a bound is its bucket's upper edge
    assert h.sum == pytest.approx(3.0535)
    wire = msgspec.msgpack.encode(h.wire())
    back = msgspec.msgpack.decode(wire, type=Histogram)
    assert back == Histogram([0.001, 0.01, 0.1], h.counts, h.sum)


def test_restore_timer_on_the_cpu_observes_latency_and_copy() -> None:
    t = RestoreTimer(cuda=False)
    began = t.begin()
    t.end(began[0] - 0.004, began)  # a lookup sent 4 ms before its copies
    assert t.copy.count == 1 and t.latency.count == 1
    assert t.latency.sum >= 0.004 and t.copy.sum < t.latency.sum
    assert t.copy_us == int(t.copy.sum * 1e6)
    assert set(t.histograms()) == {"latency", "copy"}


def test_gateway_exposes_heartbeat_restore_histograms() -> None:
    latency = LatencyHistogram()
    for s in (0.0003, 0.004, 0.004, 0.2):
        latency.observe(s)
    copy = LatencyHistogram()
    copy.observe(0.0002)
    hb = Heartbeat("w1", 3, 5, 0, 0, {"restored": 7},
                   kv_restore={"latency": latency.wire(), "copy": copy.wire()})  # fmt: skip
    hb = decoder(Heartbeat).decode(msgspec.msgpack.encode(hb))  # as the wire carries it
    workers = SimpleNamespace(
        all_workers=lambda: [SimpleNamespace(worker_id="w1", heartbeat=hb)],
        ready_workers=lambda: [],
    )
    m = _samples(GatewayMetrics().render(workers))
    lat = (("stage", "latency"), ("worker", "w1"))
    assert m[("skiff_kv_restore_seconds_count", lat)] == 4
    assert m[("skiff_kv_restore_seconds_sum", lat)] == pytest.approx(0.2083)
    buckets = {
        dict(labels)["le"]: v
        for (name, labels), v in m.items()
        if name == "skiff_kv_restore_seconds_bucket" and dict(labels)["stage"] == "latency"
    }
    assert len(buckets) == len(BOUNDS_S) + 1
    by_le = sorted((float(le), v) for le, v in buckets.items())
    assert by_le[-1] == (math.inf, 4)
    assert [v for _, v in by_le] == sorted(v for _, v in by_le)  # cumulative
    assert dict(by_le)[0.0005] == 1 and dict(by_le)[0.005] == 3 and dict(by_le)[0.1] == 3
    cp = (("stage", "copy"), ("worker", "w1"))
    assert m[("skiff_kv_restore_seconds_count", cp)] == 1
    assert m[("skiff_kv_tier_events", (("event", "restored"), ("worker", "w1")))] == 7
