"""A worker's side of the kvcache service (RAM and disk tiers of KV blocks).

The worker's loop thread owns it and calls it between steps; it never blocks:
- `stage(block, hash, tokens)` (the block manager's `on_commit`): a newly named block is given
  a RAM slot granted ahead (none left, or a hash already stored: nothing happens) and copied
  into it with the others staged since, in one batch (`save_blocks`), at the next `poll()` or
  `store()`; a full block is never written again, so its copy may wait until then.
  `store(block, hash, tokens)` (`on_evict`, and a hand-off's partial block) copies at once,
  with every block staged before it: the block is about to be overwritten (or freed).
  The `KVPut` leaves once the copies have finished (on a GPU, an event after them).
- `lookup(hashes)` asks for a prompt's blocks beyond the KV pool's; the `KVFound` comes back
  through `poll()`, and `read(reads)` copies found slots into pool blocks (`load_blocks`);
  `release` hands the slots back once those copies are done.
- `fence()` / `indexed(mark)`: whether every block stored so far is indexed by the kvcache (its
  grant has echoed the put's `upto`), for a prefill worker handing a prompt on.
- a kvcache that is gone costs nothing but its misses: messages to it are dropped, lookups are
  the caller's to time out, and a new kvcache process (a new `instance`) is attached to again.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np
import torch
import zmq

from shared.kv.block_io import Staging, block_bytes, load_blocks, save_blocks
from shared.kv.kv_pool import KVPool
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

WANT_SLOTS = 64  # RAM slots held ahead for writing
KNOWN_HASHES = 1 << 16  # hashes recently stored or restored: not copied out again
REATTACH_S = 2.0  # a detached client says hello again this often
ALIVE_S = 2.0  # an attached client silent this long sends a KVAlive (the kvcache's timeout: 10 s)


class TierClient:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        worker_id: str,
        kv: KVPool,
        model_key: str,
        log: Callable[[str], None] = lambda msg: None,
    ) -> None:
        self.log = log
        self.kv = kv
        self.worker_id = worker_id
        self.model_key = model_key
        self.block_bytes = block_bytes(kv)
        self.cuda = kv.k[0].is_cuda
        # a GPU's batched copies go through this device buffer (allocated once, here); the
        # CPU's copy straight
        self.staging = Staging(kv) if self.cuda else None
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.connect(endpoint)
        self._enc, self._dec = encoder(), decoder(KVToWorker)
        self.instance: str | None = None
        self.slots: torch.Tensor | None = None  # the mapped segment: [slots, block_bytes] uint8
        self.granted: deque[int] = deque()
        self.known: OrderedDict[int, None] = OrderedDict()
        self._staged: list[tuple[int, KVBlock]] = []  # (pool block, its slot and name): to copy
        self._puts: list[tuple[torch.cuda.Event | None, tuple[int, KVBlock]]] = []
        self._serial = 0  # blocks stored (copied into slots), ever
        self._acked = 0  # the highest `upto` a grant has echoed
        self._releases: list[tuple[torch.cuda.Event | None, list[int]]] = []
        self._ids = itertools.count(1)
        self._hello_at = 0.0
        self._sent_at = 0.0  # the last message sent
        self._hailed: str | None = None  # the instance a KVStale named, once said hello to
        self.stats = {"stored": 0, "skipped_no_slot": 0, "dropped_sends": 0}
        self._hello()

    @property
    def attached(self) -> bool:
        return self.instance is not None

    def wait_attached(self, timeout_s: float) -> bool:
        """At start: waits up to timeout_s for the kvcache's answer (so that the first prompts
        can use the tiers); False if none came (the client attaches later, when one does)."""
        deadline = time.monotonic() + timeout_s
        while not self.attached and time.monotonic() < deadline:
            if self.sock.poll(50):
                self.poll()
        return self.attached

    def close(self) -> None:
        self.sock.close(linger=0)

    # -- messages -----------------------------------------------------------------------------

    def _send(self, msg: object) -> None:
        self._sent_at = time.monotonic()
        try:
            self.sock.send(self._enc.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the kvcache is gone or far behind: what it misses is only a miss
            self.stats["dropped_sends"] += 1

    def _hello(self) -> None:
        self._hello_at = time.monotonic()
        self._send(KVHello(self.worker_id, self.model_key, self.block_bytes, WANT_SLOTS))

    def poll(self) -> list[KVFound]:
        """Handles what arrived; returns the lookups' answers. Sends the finished puts and
        releases, and says hello again when detached."""
        found: list[KVFound] = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = self._dec.decode(frame)
            except Exception:  # noqa: BLE001 - a bad frame is dropped, never fatal
                continue
            if isinstance(msg, KVAttach):
                self._attach(msg)
            elif isinstance(msg, KVStale):
                # a message of ours named an earlier kvcache process; this names the current
                # one: attach to it, unless that is done already (answers to older messages)
                if msg.instance not in (self.instance, self._hailed):
                    self.log(f"kvcache {self.instance} is gone; attaching to {msg.instance}")
                    self._detach()
                    self._hello()
                    self._hailed = msg.instance
            elif msg.instance != self.instance:
                continue  # an answer of an earlier kvcache process
            elif isinstance(msg, KVGrant):
                self.granted.extend(msg.slots)
                self._acked = max(self._acked, msg.upto)
            elif isinstance(msg, KVFound):
                found.append(msg)
        now = time.monotonic()
        if not self.attached and now - self._hello_at > REATTACH_S:
            self._hello()
        elif self.attached and now - self._sent_at > ALIVE_S:
            self._send(KVAlive(self.instance))
        self.copy_out()
        self._flush()
        return found

    def _attach(self, msg: KVAttach) -> None:
        self._detach()
        if msg.block_bytes != self.block_bytes:
            return  # not this pool's blocks: stay detached
        if msg.slots and msg.segment:  # none: the RAM tier is off (lookups find nothing)
            try:
                shape = (msg.slots, msg.block_bytes)
                seg = np.memmap(msg.segment, dtype=np.uint8, mode="r+", shape=shape)
            except (OSError, ValueError) as exc:  # e.g. another host, or no shared /dev/shm
                self.log(f"kvcache {msg.instance}: cannot map {msg.segment} ({exc}); no tiers")
                return
            self.slots = torch.from_numpy(seg)  # keeps the mapping alive
            if self.cuda:  # page-locked: the copies are DMA, asynchronous to the host
                torch.cuda.cudart().cudaHostRegister(self.slots.data_ptr(), self.slots.numel(), 0)
        self.instance = msg.instance
        self.granted = deque(msg.granted)
        self.log(f"kvcache {msg.instance}: {msg.slots} RAM slots, {len(msg.granted)} granted")

    def _detach(self) -> None:
        if self.slots is not None and self.cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.slots.data_ptr())
        self.instance, self.slots = None, None
        self.granted.clear()
        self.known.clear()
        self._staged.clear()
        self._puts.clear()
        self._acked = self._serial  # what was in flight is lost, not pending
        self._releases.clear()

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _flush(self) -> None:
        if not self.attached:
            return
        # the copies queued before an event that has completed are done; those after wait
        puts, self._puts = _split(self._puts)
        if puts:
            self._send(KVPut(self.instance, [b for _, b in puts], puts[-1][0]))
        releases, self._releases = _split(self._releases)
        if releases:
            self._send(KVRelease(self.instance, [s for slots in releases for s in slots]))

    # -- blocks -------------------------------------------------------------------------------

    def _remember(self, h: int) -> None:
        self.known[h] = None
        self.known.move_to_end(h)
        if len(self.known) > KNOWN_HASHES:
            self.known.popitem(last=False)

    def stage(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        """Block `block`, named h, to be copied into a granted slot by the next `copy_out`."""
        if not self.attached or h in self.known:
            return
        if not self.granted:
            self.stats["skipped_no_slot"] += 1
            return
        self._staged.append((block, KVBlock(h, self.granted.popleft(), list(tokens))))
        self._remember(h)

    def store(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        """`stage` and `copy_out` now: the block is about to be reused or freed."""
        self.stage(block, h, tokens)
        self.copy_out()

    def copy_out(self) -> None:
        """The staged blocks into their slots, in one batch; their puts leave once done."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        bufs = [self.slots[b.slot] for _, b in staged]
        save_blocks(self.kv, [block for block, _ in staged], bufs, self.staging)
        ev = self._event()
        for _, b in staged:
            self._serial += 1
            self._puts.append((ev, (self._serial, b)))
        self.stats["stored"] += len(staged)

    def fence(self) -> int:
        """A mark for `indexed`: the blocks stored so far (those staged copied now)."""
        self.copy_out()
        return self._serial

    def indexed(self, mark: int) -> bool:
        """Whether the kvcache has indexed every block stored up to `mark` (a detached client's
        blocks are lost, not pending: True)."""
        return not self.attached or self._acked >= mark

    def stored(self, h: int) -> bool:
        """Whether the block of hash h was stored or restored here lately."""
        return h in self.known

    def lookup(self, hashes: list[int]) -> int | None:
        """Asks for these blocks (a prompt's, in order); the id its KVFound will carry, or None
        when detached."""
        if not self.attached or not hashes:
            return None
        lookup_id = next(self._ids)
        self._send(KVLookup(self.instance, lookup_id, hashes))
        return lookup_id

    def read(self, reads: list[tuple[KVBlock, int]]) -> None:
        """Found slots' bytes into pool blocks: (the found block, the pool block) pairs, in
        one batch (queued on a GPU: `release` waits for them)."""
        if not reads:
            return
        bufs = [self.slots[b.slot] for b, _ in reads]
        load_blocks(self.kv, [block for _, block in reads], bufs, self.staging)
        for b, _ in reads:
            self._remember(b.hash)

    def release(self, found: KVFound) -> None:
        if found.instance == self.instance and found.blocks:
            self._releases.append((self._event(), [b.slot for b in found.blocks]))
            self._flush()


def _split(items: list[tuple[torch.cuda.Event | None, object]]) -> tuple[list, list]:
    """(the payloads whose copies are done, the (event, payload) pairs still in flight)."""
    done, waiting = [], []
    for ev, payload in items:
        if ev is None or ev.query():
            done.append(payload)
        else:
            waiting.append((ev, payload))
    return done, waiting
