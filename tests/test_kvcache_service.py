"""The kvcache service: the socket-free handler over both tiers, and one real `python -m
services.kvcache` process restarted from its disk dir. CPU only, a few seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import zmq

from services.kvcache.metrics import KVStats, summary
from services.kvcache.ram_tier import RamTier
from services.kvcache.service import KVCacheService
from shared.protocol import (
    KVAlive,
    KVAttach,
    KVBlock,
    KVFound,
    KVGrant,
    KVHello,
    KVLookup,
    KVPut,
    KVRelease,
    KVStale,
    KVToWorker,
    decoder,
    encoder,
)
from tests.test_kvcache_tiers import BB, KEY, _disk, _payload

ROOT = Path(__file__).resolve().parents[1]
OTHER_KEY = "cd" * 16
A, B = b"worker-a", b"worker-b"


def _service(tmp_path: Path, slots: int = 8) -> KVCacheService:
    ram = RamTier(str(tmp_path), "inst", slots * BB)
    return KVCacheService("inst", ram, _disk(tmp_path / "disk"), KVStats())


def _call(svc: KVCacheService, who: bytes, msg: object, now: float = 0.0) -> KVToWorker | None:
    out = svc.handle([who, msgspec.msgpack.encode(msg)], now)
    return out[1] if out else None


def test_handler_put_lookup_release_and_stale(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    att = _call(svc, A, KVHello("a", KEY, BB, 10))
    assert isinstance(att, KVAttach) and att.slots == 8 and len(att.granted) == 4  # half
    seg = svc.ram.segments[KEY]
    put = KVPut("inst", [KVBlock(100, att.granted[0], [1]), KVBlock(101, att.granted[1], [2])])
    grant = _call(svc, A, put)
    assert isinstance(grant, KVGrant) and len(grant.slots) == 2
    found = _call(svc, A, KVLookup("inst", 9, [100, 101, 102, 100]))
    assert isinstance(found, KVFound) and found.lookup_id == 9
    assert [(b.hash, b.tokens) for b in found.blocks] == [(100, [1]), (101, [2])]
    assert seg.pins(att.granted[0]) == 1
    assert _call(svc, A, KVRelease("inst", [att.granted[0], att.granted[1]])) is None
    assert seg.pins(att.granted[0]) == 0
    assert _call(svc, A, KVLookup("old", 1, [100])) == KVStale("inst")
    assert _call(svc, B, KVLookup("inst", 1, [100])) == KVStale("inst")  # never attached
    assert svc.handle([A, b"\xc1garbage"]) == [] and svc.handle([A]) == []
    assert svc.stats.malformed == 2 and svc.stats.stale == 2
    assert svc.stats.ram_hits == 2 and svc.stats.ram_misses == 1 and svc.stats.disk_misses == 1
    seg.check_integrity()
    svc.ram.close()
    svc.disk.close()


def test_grants_echo_the_put_count_and_silent_workers_are_reaped(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    att = _call(svc, A, KVHello("a", KEY, BB, 2), now=1.0)
    _call(svc, B, KVHello("b", KEY, BB, 2), now=1.0)
    grant = _call(svc, A, KVPut("inst", [KVBlock(7, att.granted[0], [1])], upto=5), now=2.0)
    assert grant.upto == 5  # a prefill worker's hand-off waits for this
    found = _call(svc, A, KVLookup("inst", 1, [7]), now=3.0)
    seg = svc.ram.segments[KEY]
    assert seg.pins(found.blocks[0].slot) == 1 and seg.num_granted == 4
    # A goes silent (killed mid-restore); B keeps sending KVAlive
    assert _call(svc, B, KVAlive("inst"), now=12.0) is None
    assert svc.reap(now=13.5, timeout_s=10.0) == 1
    assert seg.pins(found.blocks[0].slot) == 0 and seg.num_granted == 2  # B's two stay
    seg.check_integrity()
    # A was only slow: told it is stale, it attaches again
    assert isinstance(_call(svc, A, KVLookup("inst", 2, [7]), now=14.0), KVStale)
    assert svc.reap(now=14.0, timeout_s=10.0) == 0


def test_handler_restores_a_block_evicted_from_ram(tmp_path: Path) -> None:
    svc = _service(tmp_path, slots=4)
    seg_slots = _call(svc, A, KVHello("a", KEY, BB, 4))
    assert isinstance(seg_slots, KVAttach) and len(seg_slots.granted) == 2
    seg = svc.ram.segments[KEY]
    slots, hashes = list(seg_slots.granted), [1, 2, 3, 4]
    for h in hashes:  # each put's grant replaces the slot: once all 4 are held, it evicts
        slot = slots.pop(0)
        seg.view(slot)[:] = np.frombuffer(_payload(h), dtype=np.uint8)
        grant = _call(svc, A, KVPut("inst", [KVBlock(h, slot, [h])]))
        assert isinstance(grant, KVGrant) and len(grant.slots) == 1
        slots += grant.slots
    assert svc.disk.flush() and svc.disk.blocks == 4
    assert seg.find(1) is None and seg.find(2) is None  # evicted for the last two grants
    found = _call(svc, A, KVLookup("inst", 7, [1, 2, 3]))
    assert isinstance(found, KVFound) and [b.hash for b in found.blocks] == [1, 2]
    for b in found.blocks:  # restoring 1 and 2 evicted 3 and 4: 3 then found no slot
        assert bytes(seg.view(b.slot)) == _payload(b.hash) and seg.pins(b.slot) == 1
    st = svc.stats
    assert (st.ram_hits, st.ram_misses, st.disk_hits, st.bytes_restored) == (0, 3, 2, 2 * BB)
    assert "hits RAM 0 disk 2" in summary(st, svc.ram, svc.disk)
    seg.check_integrity()
    svc.ram.close()
    svc.disk.close()


def test_handler_ram_tier_off_grants_nothing(tmp_path: Path) -> None:
    svc = KVCacheService("inst", RamTier(str(tmp_path), "inst", 0), _disk(tmp_path), KVStats())
    att = _call(svc, A, KVHello("a", KEY, BB, 4))
    assert att == KVAttach("inst", "", 0, BB, [])
    assert _call(svc, A, KVLookup("inst", 1, [5])) == KVFound("inst", 1, [])  # not KVStale
    assert _call(svc, A, KVPut("inst", [KVBlock(5, 0, [5])])) == KVGrant("inst", [])
    assert list(tmp_path.glob("skiff-kv-*")) == []
    svc.disk.close()


def test_handler_new_hello_reclaims_old_grants(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    first = _call(svc, A, KVHello("w", KEY, BB, 4))
    assert isinstance(first, KVAttach)
    again = _call(svc, b"new-identity", KVHello("w", KEY, BB, 4))  # same worker_id, reconnected
    assert isinstance(again, KVAttach) and len(again.granted) == 4
    seg = svc.ram.segments[KEY]
    assert seg.granted_to(A) == [] and seg.free == 4
    svc.ram.close()
    svc.disk.close()


# -- the process -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Worker:
    """A DEALER that sends one message and waits (bounded) for the reply."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.enc, self.dec = encoder(), decoder(KVToWorker)

    def ask(self, msg: object, timeout_ms: int = 5000) -> KVToWorker:
        self.sock.send(self.enc.encode(msg))
        assert self.sock.poll(timeout_ms), f"no reply to {msg!r}"
        return self.dec.decode(self.sock.recv())


def _start(
    endpoint: str, tmp_path: Path, n: int, metrics_port: int = 0
) -> tuple[subprocess.Popen, Path]:
    cmd = [sys.executable, "-m", "services.kvcache", "--endpoint", endpoint, "--ram-gb", "0.01"]
    cmd += ["--disk-dir", str(tmp_path / "disk"), "--disk-gb", "0.05"]
    cmd += ["--shm-dir", str(tmp_path / "shm"), "--metrics-port", str(metrics_port)]
    log = tmp_path / f"kvcache-{n}.log"
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stderr=f), log


def _ready_line(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = log.read_text()
        if "ready at" in text:
            return text
        assert proc.poll() is None, f"kvcache exited: {text}"
        time.sleep(0.02)
    raise AssertionError(f"kvcache not ready in 15 s: {log.read_text()}")


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _wait_metric(port: int, name: str, value: float) -> None:
    deadline = time.monotonic() + 10
    while _metric(port, name) != value:
        assert time.monotonic() < deadline, f"{name} != {value}: {_metric(port, name)}"
        time.sleep(0.02)


def test_process_round_trip_and_restart_from_disk(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []
    try:
        metrics_port = _free_port()
        proc, log = _start(endpoint, tmp_path, 0, metrics_port)
        procs.append(proc)
        assert "disk tier 0.05 GiB" in _ready_line(proc, log)
        w = _Worker(ctx, endpoint)
        att = w.ask(KVHello("w0", KEY, BB, 4))
        assert isinstance(att, KVAttach) and att.block_bytes == BB and len(att.granted) == 4
        assert att.slots == int(0.01 * (1 << 30)) // BB
        seg = np.memmap(att.segment, dtype=np.uint8, mode="r+", shape=(att.slots, BB))
        written = {}
        for i, slot in enumerate(att.granted):
            seg[slot] = np.frombuffer(_payload(100 + i), dtype=np.uint8)
            written[1000 + i] = seg[slot].copy()
        hashes = list(written)
        blocks = [KVBlock(h, s, [h, h + 1]) for h, s in zip(hashes, att.granted, strict=True)]
        grant = w.ask(KVPut(att.instance, blocks))
        assert isinstance(grant, KVGrant) and len(grant.slots) == 4
        found = w.ask(KVLookup(att.instance, 1, hashes))
        assert isinstance(found, KVFound) and [b.hash for b in found.blocks] == hashes
        for b in found.blocks:
            assert b.tokens == [b.hash, b.hash + 1]
            np.testing.assert_array_equal(seg[b.slot], written[b.hash])
        w.sock.send(w.enc.encode(KVRelease(att.instance, [b.slot for b in found.blocks])))
        empty = w.ask(KVLookup(att.instance, 2, [999, *hashes]))
        assert isinstance(empty, KVFound) and empty.blocks == [] and empty.lookup_id == 2
        assert w.ask(KVLookup("not-this-one", 3, hashes)) == KVStale(att.instance)
        del seg
        # the write-through is asynchronous: the kill comes once the writer has committed
        _wait_metric(metrics_port, "skiff_kvcache_disk_writes_total", 4)
        assert _metric(metrics_port, 'skiff_kvcache_hits_total{tier="ram"}') == 4
        assert _metric(metrics_port, 'skiff_kvcache_blocks{tier="ram"}') == 4
        assert _metric(metrics_port, "skiff_kvcache_stale_total") == 1

        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait(10)
        old_segment = att.segment
        proc, log = _start(endpoint, tmp_path, 1)
        procs.append(proc)
        assert "(4 blocks found)" in _ready_line(proc, log)
        assert not os.path.exists(old_segment)  # the killed process's segment was removed
        stale = w.ask(KVLookup(att.instance, 4, hashes))
        assert isinstance(stale, KVStale) and stale.instance != att.instance
        att2 = w.ask(KVHello("w0", KEY, BB, 4))
        assert isinstance(att2, KVAttach) and att2.instance == stale.instance
        assert att2.segment != old_segment
        seg = np.memmap(att2.segment, dtype=np.uint8, mode="r", shape=(att2.slots, BB))
        found = w.ask(KVLookup(att2.instance, 5, hashes))
        assert isinstance(found, KVFound) and [b.hash for b in found.blocks] == hashes
        for b in found.blocks:  # restored from disk into fresh slots, bit-identical
            assert b.tokens == [b.hash, b.hash + 1] and b.slot not in att2.granted
            np.testing.assert_array_equal(seg[b.slot], written[b.hash])
        del seg

        procs[-1].send_signal(signal.SIGTERM)  # a clean exit removes its segment
        assert procs[-1].wait(10) == 0
        assert not os.path.exists(att2.segment)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        ctx.destroy(0)
