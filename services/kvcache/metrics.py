"""The kvcache's counters: plain ints the ROUTER loop bumps, read by a Prometheus collector at
scrape time (its own registry, `skiff_kvcache_*`) and by the periodic one-line summary."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import astuple, dataclass

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.kvcache.disk_tier import DiskTier
from services.kvcache.ram_tier import RamTier


@dataclass
class KVStats:
    ram_hits: int = 0  # blocks of a lookup found in RAM
    ram_misses: int = 0
    disk_hits: int = 0  # blocks missed in RAM, found (verified) on disk
    disk_misses: int = 0
    bytes_restored: int = 0  # disk -> RAM
    ram_bytes_found: int = 0  # the blocks found in RAM (each worker copies them into its pool)
    puts: int = 0  # blocks indexed by a KVPut
    dedupes: int = 0  # blocks put whose hash RAM held already
    stale: int = 0  # messages of an earlier kvcache instance
    malformed: int = 0  # undecodable frames, bad slots or hashes, failed handlers


def snapshot(stats: KVStats, ram: RamTier, disk: DiskTier) -> tuple:
    return (*astuple(stats), ram.held_blocks, disk.blocks, disk.writes, disk.writes_dropped)


def summary(stats: KVStats, ram: RamTier, disk: DiskTier) -> str:
    s = stats
    return (
        f"kvcache: RAM {ram.held_blocks} blocks {ram.held_bytes / 2**20:.0f} MiB, "
        f"disk {disk.blocks} blocks {disk.bytes / 2**20:.0f} MiB; "
        f"hits RAM {s.ram_hits} disk {s.disk_hits}, misses RAM {s.ram_misses} "
        f"disk {s.disk_misses}; found in RAM {s.ram_bytes_found / 2**20:.1f} MiB, restored "
        f"from disk {s.bytes_restored / 2**20:.1f} MiB; puts {s.puts} "
        f"(dedupe {s.dedupes}); disk writes {disk.writes} dropped {disk.writes_dropped} "
        f"failed {disk.write_errors}; corrupt {disk.corrupt}; stale {s.stale}; "
        f"malformed {s.malformed}"
    )


class KVCacheCollector:
    def __init__(self, stats: KVStats, ram: RamTier, disk: DiskTier) -> None:
        self.stats, self.ram, self.disk = stats, ram, disk

    def collect(self) -> Iterator[Metric]:
        s, ram, disk = self.stats, self.ram, self.disk
        blocks = GaugeMetricFamily("skiff_kvcache_blocks", "blocks held per tier", labels=["tier"])
        blocks.add_metric(["ram"], ram.held_blocks)
        blocks.add_metric(["disk"], disk.blocks)
        yield blocks
        held = GaugeMetricFamily("skiff_kvcache_bytes", "bytes held per tier", labels=["tier"])
        held.add_metric(["ram"], ram.held_bytes)
        held.add_metric(["disk"], disk.bytes)
        yield held
        slots = GaugeMetricFamily(
            "skiff_kvcache_slots", "RAM slots lent to workers: granted, pinned", labels=["state"]
        )
        slots.add_metric(["granted"], ram.granted_slots)
        slots.add_metric(["pinned"], ram.pinned_slots)
        yield slots
        hits = CounterMetricFamily("skiff_kvcache_hits", "lookup hits per tier", labels=["tier"])
        hits.add_metric(["ram"], s.ram_hits)
        hits.add_metric(["disk"], s.disk_hits)
        yield hits
        miss = CounterMetricFamily("skiff_kvcache_misses", "lookup misses", labels=["tier"])
        miss.add_metric(["ram"], s.ram_misses)
        miss.add_metric(["disk"], s.disk_misses)
        yield miss
        restored = CounterMetricFamily(
            "skiff_kvcache_restored_bytes",
            "bytes restored per tier: ram, of the blocks lookups found there (each worker copies "
            "them into its KV pool); disk, read from disk into RAM",
            labels=["tier"],
        )
        restored.add_metric(["ram"], s.ram_bytes_found)
        restored.add_metric(["disk"], s.bytes_restored)
        yield restored
        corrupt = CounterMetricFamily(
            "skiff_kvcache_corrupt",
            "entries dropped by a failed check (checksum, length, model key) per tier; the RAM "
            "tier's blocks are checked by the workers (token ids) and counted there",
            labels=["tier"],
        )
        corrupt.add_metric(["disk"], disk.corrupt)
        yield corrupt
        for name, doc, value in (
            ("puts", "blocks indexed by puts", s.puts),
            ("dedupes", "blocks put that RAM held already", s.dedupes),
            ("disk_writes", "blocks written to disk", disk.writes),
            ("disk_writes_dropped", "disk writes dropped on a full queue", disk.writes_dropped),
            ("disk_write_errors", "disk writes that failed", disk.write_errors),
            ("stale", "messages of an earlier kvcache instance", s.stale),
            ("malformed", "malformed messages ignored", s.malformed),
        ):
            yield CounterMetricFamily(f"skiff_kvcache_{name}", doc, value=value)


def serve_metrics(port: int, stats: KVStats, ram: RamTier, disk: DiskTier) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(KVCacheCollector(stats, ram, disk))
    start_http_server(port, addr="127.0.0.1", registry=registry)
    return registry
