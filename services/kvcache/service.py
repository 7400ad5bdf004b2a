"""The kvcache's ROUTER loop and its message handling (`KVCacheService.handle`, socket-free, so
tests drive it directly).

- `KVHello` -> `KVAttach`: the model key's segment (made on its first hello), its slots and up to
  `want_slots` granted slots (at most half the segment, so grants never crowd out the index). A
  new hello from a worker (same identity or same worker_id) reclaims its earlier grants and pins.
- `KVPut` -> `KVGrant`: each block is indexed (or, already held, its slot freed) and written
  through to disk (its bytes copied out of the slot), so a restart finds every block; the grant
  replaces as many slots as the put consumed and echoes the put's `upto` (a worker that hands a
  prompt on waits for it: the blocks are then found by any worker's lookup).
- `KVLookup` -> `KVFound`: the hashes in order; a RAM hit pins its slot; else a disk hit is copied
  into a slot taken for it (evicting as a grant does), indexed and pinned; the run stops at the
  first miss (or when no slot can be taken).
- `KVRelease`: unpins. `KVAlive`: nothing but that the worker lives: a worker silent for the
  worker timeout (attached workers send something every 2 s) is gone, and its grants and pins
  are freed (`reap`), so a worker killed mid-restore or mid-put leaks no slot. One that was only
  slow is answered `KVStale` and attaches again.
- A message of another `instance` -> `KVStale`; a malformed one is counted and ignored.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import sys
import time

import zmq

from services.kvcache.config import GiB, KVCacheConfig
from services.kvcache.disk_tier import DiskTier
from services.kvcache.metrics import KVStats, serve_metrics, snapshot, summary
from services.kvcache.ram_tier import RamTier, Segment, remove_orphan_segments
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
    WorkerToKV,
    decoder,
    encoder,
)

_U64 = 1 << 64
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_LOGGED_ERRORS = 10  # malformed messages described on stderr before going quiet


def _log(msg: str) -> None:
    print(f"kvcache: {msg}", file=sys.stderr, flush=True)


def _valid_key(model_key: str) -> bool:
    try:
        return len(bytes.fromhex(model_key)) > 0
    except ValueError:
        return False


class KVCacheService:
    def __init__(self, instance: str, ram: RamTier, disk: DiskTier, stats: KVStats) -> None:
        self.instance = instance
        self.ram, self.disk, self.stats = ram, disk, stats
        self._decode = decoder(WorkerToKV).decode
        self._workers: dict[bytes, Segment] = {}  # identity -> its model's segment
        self._by_id: dict[str, bytes] = {}  # worker_id -> identity
        self._seen: dict[bytes, float] = {}  # identity -> when it last sent anything
        self._no_slots = Segment("", "", 0, 1)

    def handle(self, frames: list[bytes], now: float = 0.0) -> list[bytes | KVToWorker]:
        """One ROUTER message ([identity, payload]) -> [identity, reply] or [] (none)."""
        try:
            identity, payload = frames
            self._seen[identity] = now or time.monotonic()
            msg = self._decode(payload)
            reply = self._dispatch(identity, msg)
        except Exception as e:  # a bad frame must never stop the service
            self.stats.malformed += 1
            if self.stats.malformed <= _LOGGED_ERRORS:
                _log(f"malformed message ignored ({type(e).__name__}: {e})")
            return []
        return [identity, reply] if reply is not None else []

    def _dispatch(self, who: bytes, msg: object) -> KVToWorker | None:
        if isinstance(msg, KVHello):
            return self._hello(who, msg)
        assert isinstance(msg, KVPut | KVLookup | KVRelease | KVAlive)
        seg = self._workers.get(who)
        if msg.instance != self.instance or seg is None:
            self.stats.stale += 1
            return KVStale(self.instance)
        if isinstance(msg, KVPut):
            return self._put(who, seg, msg)
        if isinstance(msg, KVLookup):
            return self._lookup(who, seg, msg)
        if isinstance(msg, KVAlive):
            return None
        for slot in msg.slots:
            if not seg.unpin(who, slot):
                self.stats.malformed += 1
        return None

    def _hello(self, who: bytes, msg: KVHello) -> KVAttach:
        self.reclaim(who)
        old = self._by_id.get(msg.worker_id)
        if old is not None:
            self.reclaim(old)
        self._by_id[msg.worker_id] = who
        # a worker without slots stays attached: its lookups answer empty, not KVStale
        self._workers[who] = self._no_slots
        empty = KVAttach(self.instance, "", 0, msg.block_bytes, [])
        if not _valid_key(msg.model_key) or msg.block_bytes <= 0:
            self.stats.malformed += 1
            _log(f"hello of {msg.worker_id}: bad model key or block_bytes: no slots for it")
            return empty
        try:
            seg = self.ram.segment(msg.model_key, msg.block_bytes)
        except OSError as e:
            _log(f"warning: cannot make the RAM segment for {msg.model_key[:16]} ({e})")
            seg = self.ram.segments.setdefault(msg.model_key, self._no_slots)
        if seg.block_bytes != msg.block_bytes or seg.slots == 0:
            if seg.slots:
                _log(f"hello of {msg.worker_id}: block_bytes {msg.block_bytes} != the segment's")
            return empty
        self._workers[who] = seg
        granted = seg.grant(who, max(0, min(msg.want_slots, seg.slots // 2)))
        return KVAttach(self.instance, seg.path, seg.slots, seg.block_bytes, granted)

    def reclaim(self, who: bytes) -> None:
        """Free what worker `who` was granted and drop its pins (it is gone, or attaches again)."""
        self.ram.reclaim(who)
        self._workers.pop(who, None)

    def reap(self, now: float, timeout_s: float) -> int:
        """Reclaims the workers silent for longer than timeout_s; how many."""
        gone = [who for who, t in self._seen.items() if now - t > timeout_s]
        for who in gone:
            del self._seen[who]
            for wid in [w for w, i in self._by_id.items() if i == who]:
                del self._by_id[wid]
            if who in self._workers:
                self.reclaim(who)
                _log(f"a worker silent for {timeout_s:.0f} s is gone: its slots are freed")
        return len(gone)

    def _put(self, who: bytes, seg: Segment, msg: KVPut) -> KVGrant:
        consumed = 0
        for b in msg.blocks:
            if not (0 <= b.hash < _U64 and 0 <= b.slot < seg.slots):
                self.stats.malformed += 1
                continue
            outcome = seg.put(who, b.hash, b.slot, b.tokens)
            if outcome == "rejected":
                self.stats.malformed += 1
                continue
            consumed += 1
            if outcome == "dedupe":
                self.stats.dedupes += 1
                continue
            self.stats.puts += 1
            if self.disk.contains(seg.model_key, b.hash):
                self.disk.touch(seg.model_key, b.hash)  # on disk already: no second write
            elif self.disk.enabled:
                self.disk.put(seg.model_key, b.hash, b.tokens, seg.view(b.slot).tobytes())
        return KVGrant(self.instance, seg.grant(who, consumed), msg.upto)

    def _lookup(self, who: bytes, seg: Segment, msg: KVLookup) -> KVFound:
        found: list[KVBlock] = []
        for h in msg.hashes:
            if seg.slots == 0 or not 0 <= h < _U64:
                break
            hit = seg.find(h)
            if hit is not None:
                self.stats.ram_hits += 1
                self.stats.ram_bytes_found += seg.block_bytes
                seg.pin(who, hit[0])
                self.disk.touch(seg.model_key, h)
                found.append(KVBlock(h, hit[0], hit[1]))
                continue
            self.stats.ram_misses += 1
            block = self.disk.get(seg.model_key, h, seg.block_bytes)
            if block is None:
                self.stats.disk_misses += self.disk.enabled
                break
            slot = seg.restore(who, h, block[0], block[1])
            if slot is None:
                break  # every slot granted or pinned: the run ends here
            self.stats.disk_hits += 1
            self.stats.bytes_restored += seg.block_bytes
            found.append(KVBlock(h, slot, block[0]))
        return KVFound(self.instance, msg.lookup_id, found)


def serve(config: KVCacheConfig) -> int:
    """Run the kvcache until SIGTERM or SIGINT; its exit status."""
    instance = secrets.token_hex(4)
    for path in remove_orphan_segments(config.shm_dir):
        _log(f"removed the segment of a kvcache that is gone: {path}")
    disk = DiskTier(config.disk_dir, config.disk_bytes)
    ram = RamTier(config.shm_dir, instance, config.ram_bytes)
    stats = KVStats()
    service = KVCacheService(instance, ram, disk, stats)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    stopping: list[int] = []
    previous = {s: signal.signal(s, lambda n, _f: stopping.append(n)) for s in _SIGNALS}
    try:
        try:
            sock.bind(config.endpoint)
        except zmq.ZMQError as e:
            _log(f"cannot bind {config.endpoint} ({e})")
            return 2
        if config.metrics_port:
            serve_metrics(config.metrics_port, stats, ram, disk)
        disk_gb = disk.cap_bytes / GiB if disk.enabled else 0.0
        _log(
            f"ready at {config.endpoint}, RAM tier {config.ram_bytes / GiB:.3g} GiB, disk tier "
            f"{disk_gb:.3g} GiB at {config.disk_dir} ({disk.blocks} blocks found)"
        )
        _loop(sock, service, config, stopping)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close(0)
        ctx.term()
        ram.close()
        disk.close()


def _loop(sock: zmq.Socket, service: KVCacheService, config: KVCacheConfig, stopping: list) -> None:
    every_s = config.summary_interval_s
    encode = encoder().encode
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    last_log, last_seen = time.monotonic(), snapshot(service.stats, service.ram, service.disk)
    ram, disk, stats = service.ram, service.disk, service.stats
    while not stopping:
        if poller.poll(500):
            for _ in range(256):  # a bounded drain, so the summary and signals get their turn
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out = service.handle(frames)
                if out:
                    with contextlib.suppress(zmq.Again):  # a peer past its HWM: drop
                        sock.send_multipart([out[0], encode(out[1])], zmq.NOBLOCK)
        now = time.monotonic()
        service.reap(now, config.worker_timeout_s)
        if now - last_log >= every_s:
            last_log = now
            seen = snapshot(stats, ram, disk)
            if seen != last_seen:
                last_seen = seen
                print(summary(stats, ram, disk), file=sys.stderr, flush=True)
