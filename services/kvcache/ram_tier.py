"""The RAM tier: one shared-memory segment of fixed-size slots per model key, and each slot's state.

A segment is the file `<shm-dir>/skiff-kv-<instance>-<modelkey[:16]>` of `slots * block_bytes`
bytes, created on the first `KVHello` of its model key and mapped by the kvcache and by every
worker of that model. The RAM budget is shared by the model keys, first come first served.

Every slot is in exactly one state:
- free: nobody's;
- granted to one worker (an `owner`, the worker's ROUTER identity), which may write it, and
  whose `KVPut` then indexes it;
- held: indexed by its block hash, in LRU order; held slots may also be pinned (lent to
  workers by `KVFound`, counted per owner) and are never evicted while pinned.

Taking slots (a grant, or a disk block restored into RAM) uses free slots first, then evicts the
least recently used unpinned held slots: with the disk tier on they are already on disk, since
every put is written through. `reclaim(owner)` frees what a gone worker was granted and drops
its pins. `check_integrity()` verifies the states against each other (tests, idle checks).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
from collections import Counter, OrderedDict

import numpy as np

SEGMENT_PREFIX = "skiff-kv-"


class Segment:
    """The slots of one model key. `slots == 0` (the RAM budget is spent or the tier is off):
    no file (`path == ""`), every grant and lookup is empty."""

    def __init__(self, path: str, model_key: str, slots: int, block_bytes: int) -> None:
        self.path = path
        self.model_key = model_key
        self.slots = slots
        self.block_bytes = block_bytes
        self._fd = -1
        self._map: np.ndarray | None = None  # [slots, block_bytes] uint8
        if slots > 0:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                # the lock says "in use": a kvcache starting later removes only unlocked files
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # reserve the pages now, so a full tmpfs fails here, not as SIGBUS in a worker
                os.posix_fallocate(self._fd, 0, slots * block_bytes)
                shape = (slots, block_bytes)
                self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=shape)
            except OSError:
                self.close()
                raise
        self._free: list[int] = list(range(slots - 1, -1, -1))  # a stack: low slots first
        self._granted: dict[int, bytes] = {}  # slot -> owner
        self._held: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recent first
        self._block: dict[int, tuple[int, list[int]]] = {}  # held slot -> (hash, tokens)
        self._pins: Counter[int] = Counter()  # held slot -> pin count
        self._owner_pins: dict[bytes, Counter[int]] = {}

    # -- reading ---------------------------------------------------------------------------------
    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes, [block_bytes] uint8, a view into the shared segment."""
        assert self._map is not None
        return self._map[slot]

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def num_granted(self) -> int:
        return len(self._granted)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def granted_to(self, owner: bytes) -> list[int]:
        return sorted(s for s, o in self._granted.items() if o == owner)

    def pins(self, slot: int) -> int:
        return self._pins[slot]

    def find(self, h: int) -> tuple[int, list[int]] | None:
        """The held slot and tokens of hash h (made most recently used), or None."""
        slot = self._held.get(h)
        if slot is None:
            return None
        self._held.move_to_end(h)
        return slot, self._block[slot][1]

    # -- state changes ---------------------------------------------------------------------------
    def grant(self, owner: bytes, n: int) -> list[int]:
        """Up to n slots for owner to write (fewer when the rest are granted or pinned)."""
        out = []
        while len(out) < n:
            slot = self._take()
            if slot is None:
                break
            self._granted[slot] = owner
            out.append(slot)
        return out

    def put(self, owner: bytes, h: int, slot: int, tokens: list[int]) -> str:
        """Index owner's granted slot as block h: "indexed"; "dedupe" when h is held already (the
        slot is free again); "rejected" when the slot is not granted to owner (nothing changes)."""
        if self._granted.get(slot) != owner:
            return "rejected"
        del self._granted[slot]
        if h in self._held:
            self._free.append(slot)
            self._held.move_to_end(h)
            return "dedupe"
        self._index(h, slot, tokens)
        return "indexed"

    def restore(self, owner: bytes, h: int, tokens: list[int], payload: bytes) -> int | None:
        """Copy a block read from disk into a slot taken for it, index it and pin it for owner:
        its slot, or None when every slot is granted or pinned."""
        slot = self._take()
        if slot is None:
            return None
        self.view(slot)[:] = np.frombuffer(payload, dtype=np.uint8)
        self._index(h, slot, tokens)
        self.pin(owner, slot)
        return slot

    def pin(self, owner: bytes, slot: int) -> None:
        assert slot in self._block, f"slot {slot} is not held"
        self._pins[slot] += 1
        self._owner_pins.setdefault(owner, Counter())[slot] += 1

    def unpin(self, owner: bytes, slot: int) -> bool:
        """Drop one of owner's pins on slot; False when owner holds none there."""
        mine = self._owner_pins.get(owner)
        if not mine or mine[slot] <= 0:
            return False
        mine[slot] -= 1
        if mine[slot] == 0:
            del mine[slot]
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            del self._pins[slot]
        return True

    def reclaim(self, owner: bytes) -> int:
        """Free every slot granted to owner and drop its pins; how many slots that touched."""
        mine = [s for s, o in self._granted.items() if o == owner]
        for slot in mine:
            del self._granted[slot]
            self._free.append(slot)
        pins = self._owner_pins.pop(owner, Counter())
        for slot, n in pins.items():
            self._pins[slot] -= n
            if self._pins[slot] <= 0:
                del self._pins[slot]
        return len(mine) + len(pins)

    def _index(self, h: int, slot: int, tokens: list[int]) -> None:
        self._held[h] = slot
        self._block[slot] = (h, list(tokens))

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, slot in self._held.items():  # least recently used first
            if not self._pins[slot]:
                del self._held[h]
                del self._block[slot]
                return slot
        return None

    def check_integrity(self) -> None:
        free, granted, held = set(self._free), set(self._granted), set(self._held.values())
        assert len(free) == len(self._free), "a slot is free twice"
        assert not (free & granted or free & held or granted & held), "a slot in two states"
        assert free | granted | held == set(range(self.slots)), "a slot in no state"
        assert set(self._block) == held, "held slots and block records differ"
        assert all(self._held[h] == s for s, (h, _) in self._block.items()), "index mismatch"
        assert set(self._pins) <= held, "a pin on a slot that is not held"
        total: Counter[int] = Counter()
        for pins in self._owner_pins.values():
            total.update(pins)
        assert +total == +self._pins, "owner pins do not add up to the pin counts"

    def close(self) -> None:
        self._map = None  # the memmap unmaps when its last view goes
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = -1


class RamTier:
    """The segments of one kvcache process, within `budget_bytes` of shared memory in all."""

    def __init__(self, shm_dir: str, instance: str, budget_bytes: int) -> None:
        self.shm_dir = shm_dir
        self.instance = instance
        self.budget_bytes = budget_bytes
        self.budget_left = budget_bytes
        self.segments: dict[str, Segment] = {}  # model key -> segment

    def segment(self, model_key: str, block_bytes: int) -> Segment:
        """The model key's segment, created on its first call with the budget left (and what the
        shm dir has room for). Raises OSError when the file cannot be made."""
        seg = self.segments.get(model_key)
        if seg is not None:
            return seg
        room = self.budget_left
        if room > 0:
            st = os.statvfs(self.shm_dir)
            room = min(room, int(st.f_bavail * st.f_frsize * 0.9))
        slots = max(0, room // block_bytes) if block_bytes > 0 else 0
        name = f"{SEGMENT_PREFIX}{self.instance}-{model_key[:16]}"
        path = os.path.join(self.shm_dir, name) if slots else ""
        seg = Segment(path, model_key, slots, block_bytes)
        self.budget_left -= slots * block_bytes
        self.segments[model_key] = seg
        return seg

    @property
    def held_blocks(self) -> int:
        return sum(s.held for s in self.segments.values())

    @property
    def held_bytes(self) -> int:
        return sum(s.held * s.block_bytes for s in self.segments.values())

    @property
    def granted_slots(self) -> int:
        return sum(s.num_granted for s in self.segments.values())

    @property
    def pinned_slots(self) -> int:
        return sum(s.num_pinned for s in self.segments.values())

    def reclaim(self, owner: bytes) -> int:
        return sum(seg.reclaim(owner) for seg in self.segments.values())

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()


def remove_orphan_segments(shm_dir: str) -> list[str]:
    """Delete the segments of kvcache processes that are gone (killed before their cleanup): a
    live one holds a lock on each of its files. The paths removed."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(shm_dir), SEGMENT_PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # locked: its kvcache is alive
        finally:
            os.close(fd)
    return removed
