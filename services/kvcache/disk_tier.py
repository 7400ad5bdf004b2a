"""The disk tier: KV blocks in an LMDB env at `<disk-dir>/blocks.lmdb`, within a size cap.

Key: the model key's first 8 bytes, then the block hash (8 bytes, big-endian). Value: a
4-byte little-endian length, a msgpack `DiskHeader` (model key, tokens, block_bytes, a
blake2b-16 checksum of the payload, last_use), then the payload (the block's bytes).

- `put` hands the block to a background writer thread through a queue bounded in bytes; when it
  is full the write is dropped and counted (`writes_dropped`): the ROUTER loop never waits.
- `get` verifies length, model key, block_bytes and checksum; a bad value is deleted, counted
  (`corrupt`) and answered as a miss.
- Over the cap, the least recently used entries go. The LRU order lives in memory (key -> value
  size), rebuilt at start from the headers' `last_use`, so a restart finds the blocks written
  before. `last_use` is stored when a block is written; later hits only reorder the in-memory
  LRU (rewriting a block to move a timestamp is not worth its bandwidth).
- A dir that cannot be made, opened or locked (another kvcache uses it) turns the tier off
  with a warning (`enabled` False), never an exception.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import queue
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import lmdb
import msgspec

_LEN = struct.Struct("<I")
_SLACK = 64 << 20  # LMDB's own pages and the freed pages live readers still see
_BATCH = 32  # blocks per write transaction: one commit's sync covers them


class DiskHeader(msgspec.Struct, array_like=True, gc=False):
    model_key: str
    tokens: list[int]
    block_bytes: int
    checksum: bytes  # blake2b, 16 bytes, of the payload
    last_use: float  # time.time() of the write


def block_key(model_key: str, h: int) -> bytes:
    return bytes.fromhex(model_key)[:8].ljust(8, b"\0") + h.to_bytes(8, "big")


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _warn(msg: str) -> None:
    print(f"kvcache: warning: {msg}", file=sys.stderr, flush=True)


class DiskTier:
    def __init__(
        self,
        directory: str,
        cap_bytes: int,
        max_pending_bytes: int = 256 << 20,
        warn: Callable[[str], None] = _warn,
    ) -> None:
        self.directory = directory
        self.cap_bytes = cap_bytes
        self.max_pending_bytes = max_pending_bytes
        self._warn = warn
        self.writes = 0
        self.writes_dropped = 0
        self.write_errors = 0
        self.corrupt = 0
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> value size, least recent first
        self._total = 0
        self._lock = threading.Lock()  # _lru, _total, _pending
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # bytes queued or being written
        self._queue: queue.SimpleQueue[tuple[bytes, DiskHeader, bytes] | None] = queue.SimpleQueue()
        self._env: lmdb.Environment | None = None
        self._lock_fd = -1
        self._thread: threading.Thread | None = None
        if cap_bytes > 0:
            self._open()

    @property
    def enabled(self) -> bool:
        return self._env is not None

    @property
    def blocks(self) -> int:
        return len(self._lru)

    @property
    def bytes(self) -> int:
        return self._total

    def _open(self) -> None:
        path = os.path.join(self.directory, "blocks.lmdb")
        try:
            os.makedirs(path, exist_ok=True)
            self._lock_fd = os.open(os.path.join(path, "owner.lock"), os.O_RDWR | os.O_CREAT)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            map_size = self.cap_bytes + self.cap_bytes // 4 + _SLACK
            # metasync off: a system crash may undo the last commits but keeps the env whole
            self._env = lmdb.open(path, map_size=map_size, metasync=False, readahead=False)
            self._scan()
        except (OSError, lmdb.Error) as e:
            self._warn(f"disk tier off: {path} is unusable ({e})")
            self.close()
            return
        self._thread = threading.Thread(target=self._writer, name="kvcache-disk", daemon=True)
        self._thread.start()

    def _scan(self) -> None:
        """Rebuild the LRU from the stored headers; drop the unreadable, then trim to the cap."""
        assert self._env is not None
        found, bad = [], []
        with self._env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                try:
                    (n,) = _LEN.unpack_from(value)
                    header = msgspec.msgpack.decode(value[4 : 4 + n], type=DiskHeader)
                    found.append((header.last_use, bytes(key), len(value)))
                except (struct.error, msgspec.DecodeError):
                    bad.append(bytes(key))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._total += size
        self.corrupt += len(bad)
        self._delete(bad + self._victims(0, set()))

    # -- writing ---------------------------------------------------------------------------------
    def put(self, model_key: str, h: int, tokens: list[int], payload: bytes) -> bool:
        """Queue a block for writing; False (and counted) when the tier is off or the queue full."""
        if self._env is None:
            return False
        with self._lock:
            if self._pending + len(payload) > self.max_pending_bytes:
                self.writes_dropped += 1
                return False
            self._pending += len(payload)
        header = DiskHeader(model_key, list(tokens), len(payload), b"", 0.0)
        self._queue.put((block_key(model_key, h), header, payload))
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _writer(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None  # the sentinel from close() comes after every put
            rows = [b for b in batch if b is not None]
            if rows:
                self._write(rows)
            if stop:
                return

    def _write(self, batch: list[tuple[bytes, DiskHeader, bytes]]) -> None:
        rows = []
        for key, header, payload in batch:
            header.checksum = checksum(payload)
            header.last_use = time.time()
            head = msgspec.msgpack.encode(header)
            rows.append((key, _LEN.pack(len(head)) + head + payload))
        try:
            try:
                self._commit(rows)
            except lmdb.MapFullError:
                self._evict_fraction(0.25)
                self._commit(rows)
            self.writes += len(rows)
        except lmdb.Error as e:
            self.write_errors += len(rows)
            self._warn(f"disk write failed ({e})")
        finally:
            with self._idle:
                self._pending -= sum(len(p) for _, _, p in batch)
                self._idle.notify_all()

    def _commit(self, rows: list[tuple[bytes, bytes]]) -> None:
        assert self._env is not None
        keys = {k for k, _ in rows}
        with self._lock:
            grow = sum(len(v) - self._lru.get(k, 0) for k, v in rows)
            victims = self._victims(grow, keys)
        with self._env.begin(write=True) as txn:
            for key, value in rows:
                txn.put(key, value)
            for key in victims:
                txn.delete(key)
        with self._lock:
            for key, value in rows:
                self._total += len(value) - self._lru.pop(key, 0)
                self._lru[key] = len(value)
        self._forget(victims)

    def _victims(self, grow: int, keep: set[bytes]) -> list[bytes]:
        """The least recently used keys (none of keep) to delete so that grow more bytes fit."""
        over = self._total + grow - self.cap_bytes
        out = []
        for key, size in self._lru.items():
            if over <= 0:
                break
            if key not in keep:
                out.append(key)
                over -= size
        return out

    def _evict_fraction(self, fraction: float) -> None:
        with self._lock:
            victims = list(self._lru)[: max(1, int(len(self._lru) * fraction))]
        self._delete(victims)

    def _delete(self, keys: list[bytes]) -> None:
        assert self._env is not None
        if keys:
            with self._env.begin(write=True) as txn:
                for key in keys:
                    txn.delete(key)
            self._forget(keys)

    def _forget(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._total -= self._lru.pop(key, 0)

    # -- reading ---------------------------------------------------------------------------------
    def contains(self, model_key: str, h: int) -> bool:
        return block_key(model_key, h) in self._lru

    def touch(self, model_key: str, h: int) -> None:
        key = block_key(model_key, h)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)

    def get(self, model_key: str, h: int, block_bytes: int) -> tuple[list[int], bytes] | None:
        """The block's tokens and verified payload, or None (a miss, or a bad value: dropped)."""
        if self._env is None:
            return None
        key = block_key(model_key, h)
        with self._env.begin(buffers=True) as txn:
            value = txn.get(key)
            if value is None:
                return None
            try:
                (n,) = _LEN.unpack_from(value)
                header = msgspec.msgpack.decode(value[4 : 4 + n], type=DiskHeader)
            except (struct.error, msgspec.DecodeError):
                header = None
            if header is not None and header.model_key != model_key:
                return None  # another model whose key shares the first 8 bytes
            payload = value[4 + n :] if header is not None else b""
            good = (
                header is not None
                and header.block_bytes == block_bytes == len(payload)
                and checksum(payload) == header.checksum
            )
            if good:
                payload = bytes(payload)
        if not good:
            self._drop_corrupt(key)
            return None
        self.touch(model_key, h)
        return header.tokens, payload

    def _drop_corrupt(self, key: bytes) -> None:
        self.corrupt += 1
        try:
            self._delete([key])
        except lmdb.Error as e:
            self._warn(f"cannot delete a corrupt disk block ({e})")
            self._forget([key])

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (up to timeout), then close the env."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
