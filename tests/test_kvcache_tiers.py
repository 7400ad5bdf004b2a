"""The kvcache's tiers alone: RamTier slot states (grants, LRU, pins, reclaim, orphan segments)
and DiskTier (restart, corruption, cap, full queue, unusable or shared dir). CPU only."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import numpy as np
import pytest

from services.kvcache.disk_tier import DiskTier, block_key
from services.kvcache.ram_tier import RamTier, Segment, remove_orphan_segments

ROOT = Path(__file__).resolve().parents[1]
KEY = "ab" * 16
OTHER_KEY = "cd" * 16
BB = 4096
A, B = b"worker-a", b"worker-b"


def _segment(tmp_path: Path, slots: int = 4) -> Segment:
    ram = RamTier(str(tmp_path), "test", slots * BB)
    return ram.segment(KEY, BB)


def _fill(seg: Segment, owner: bytes, hashes: list[int]) -> list[int]:
    slots = seg.grant(owner, len(hashes))
    for h, s in zip(hashes, slots, strict=True):
        seg.view(s)[:] = h % 251
        assert seg.put(owner, h, s, [h]) == "indexed"
    return slots


# -- RamTier ---------------------------------------------------------------------------------------
def test_segment_file_and_budget(tmp_path: Path) -> None:
    ram = RamTier(str(tmp_path), "inst", 6 * BB)
    seg = ram.segment(KEY, BB)
    assert seg.slots == 6 and os.path.getsize(seg.path) == 6 * BB
    assert Path(seg.path).name == f"skiff-kv-inst-{KEY[:16]}"
    assert ram.segment(KEY, BB) is seg
    assert ram.segment(OTHER_KEY, BB).slots == 0  # the budget went to the first model key
    ram.close()
    assert not Path(seg.path).exists()


def test_grant_takes_free_then_evicts_lru(tmp_path: Path) -> None:
    seg = _segment(tmp_path)
    slots = _fill(seg, A, [10, 11, 12, 13])
    assert seg.free == 0 and seg.held == 4
    assert seg.find(10) is not None  # 10 is now the most recently used: 11 is the LRU one
    got = seg.grant(B, 2)
    assert sorted(got) == sorted([slots[1], slots[2]])
    assert seg.find(11) is None and seg.find(12) is None
    assert seg.find(10) is not None and seg.find(13) is not None
    seg.check_integrity()


def test_pin_prevents_eviction_and_release_unpins(tmp_path: Path) -> None:
    seg = _segment(tmp_path, slots=2)
    s10, s11 = _fill(seg, A, [10, 11])
    seg.pin(B, s10)
    assert seg.grant(A, 2) == [s11]  # 10 is pinned: only 11 could be evicted
    assert seg.find(10) == (s10, [10])
    assert seg.grant(A, 1) == []
    assert not seg.unpin(A, s10)  # A holds no pin there
    assert seg.unpin(B, s10) and seg.pins(s10) == 0
    assert seg.grant(A, 1) == [s10]
    seg.check_integrity()


def test_put_of_a_held_hash_frees_the_slot(tmp_path: Path) -> None:
    seg = _segment(tmp_path)
    (s0,) = _fill(seg, A, [7])
    (s1,) = seg.grant(B, 1)
    assert seg.put(B, 7, s1, [7]) == "dedupe"
    assert seg.held == 1 and seg.find(7) == (s0, [7]) and seg.free == 3
    assert seg.put(B, 8, s1, [8]) == "rejected"  # no longer granted to B
    assert seg.put(A, 9, seg.grant(B, 1)[0], [9]) == "rejected"  # granted to B, not A
    seg.check_integrity()


def test_reclaim_frees_grants_and_pins_of_a_gone_worker(tmp_path: Path) -> None:
    seg = _segment(tmp_path)
    (s0,) = _fill(seg, A, [5])
    seg.grant(B, 3)
    seg.pin(B, s0)
    assert seg.free == 0 and seg.grant(A, 1) == []
    assert seg.reclaim(B) == 4
    assert seg.free == 3 and seg.pins(s0) == 0 and seg.granted_to(B) == []
    assert len(seg.grant(A, 4)) == 4  # 3 free, then the unpinned held one
    seg.check_integrity()


def test_orphan_segments_removed_live_ones_kept(tmp_path: Path) -> None:
    live = RamTier(str(tmp_path), "live", 2 * BB).segment(KEY, BB)
    orphan = tmp_path / f"skiff-kv-dead-{KEY[:16]}"
    orphan.write_bytes(b"\0" * BB)
    assert remove_orphan_segments(str(tmp_path)) == [str(orphan)]
    assert Path(live.path).exists() and not orphan.exists()
    live.close()


# -- DiskTier --------------------------------------------------------------------------------------
def _payload(seed: int, n: int = BB) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _disk(path: Path, cap: int = 1 << 20) -> DiskTier:
    disk = DiskTier(str(path), cap, warn=pytest.fail)
    assert disk.enabled
    return disk


def test_disk_put_get_and_restart(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    data = _payload(1)
    assert disk.put(KEY, 42, [1, 2, 3], data)
    assert disk.flush()
    assert disk.get(KEY, 42, BB) == ([1, 2, 3], data)
    assert disk.get(KEY, 43, BB) is None
    assert disk.get(OTHER_KEY, 42, BB) is None  # another model key: a miss
    assert disk.blocks == 1 and disk.writes == 1 and disk.corrupt == 0
    disk.close()
    again = _disk(tmp_path)  # the restart: the scan finds the block
    assert again.blocks == 1 and again.bytes > BB
    assert again.get(KEY, 42, BB) == ([1, 2, 3], data)
    again.close()


def test_disk_flipped_byte_is_corrupt_and_dropped(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    disk.put(KEY, 42, [1], _payload(2))
    assert disk.flush()
    disk.close()
    env = lmdb.open(str(tmp_path / "blocks.lmdb"))
    key = block_key(KEY, 42)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[-100] ^= 0x01
        txn.put(key, bytes(value))
    env.close()
    disk = _disk(tmp_path)
    assert disk.blocks == 1
    assert disk.get(KEY, 42, BB) is None
    assert disk.corrupt == 1 and disk.blocks == 0
    assert disk.get(KEY, 42, BB) is None and disk.corrupt == 1  # gone, not corrupt twice
    disk.close()
    env = lmdb.open(str(tmp_path / "blocks.lmdb"))
    with env.begin() as txn:
        assert txn.get(key) is None
    env.close()


def test_disk_wrong_block_bytes_is_corrupt(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    disk.put(KEY, 1, [1], _payload(3))
    assert disk.flush()
    assert disk.get(KEY, 1, BB * 2) is None and disk.corrupt == 1
    disk.close()


def test_disk_over_cap_evicts_lru(tmp_path: Path) -> None:
    disk = _disk(tmp_path, cap=int(3.5 * BB))  # room for 3 blocks and their headers
    for h in range(3):
        disk.put(KEY, h, [h], _payload(h))
        assert disk.flush()
    assert disk.get(KEY, 0, BB) is not None  # 0 is now the most recent: 1 goes first
    disk.put(KEY, 3, [3], _payload(3))
    assert disk.flush()
    assert disk.blocks == 3 and disk.bytes <= disk.cap_bytes
    assert disk.get(KEY, 1, BB) is None
    assert all(disk.get(KEY, h, BB) is not None for h in (0, 2, 3))
    disk.close()
    assert _disk(tmp_path, cap=int(1.5 * BB)).blocks == 1  # a smaller cap trims at start


def test_disk_full_queue_drops_and_counts(tmp_path: Path) -> None:
    disk = DiskTier(str(tmp_path), 1 << 20, max_pending_bytes=BB)
    assert disk.put(KEY, 1, [1], _payload(1))
    results = [disk.put(KEY, h, [h], _payload(h)) for h in range(2, 50)]
    assert disk.flush()
    assert disk.writes_dropped == results.count(False) > 0
    assert disk.writes + disk.writes_dropped == 49
    disk.close()


def test_disk_unusable_dir_turns_the_tier_off(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    warnings: list[str] = []
    disk = DiskTier(str(blocker / "kv"), 1 << 20, warn=warnings.append)
    assert not disk.enabled and len(warnings) == 1 and "disk tier off" in warnings[0]
    assert not disk.put(KEY, 1, [1], b"x") and disk.get(KEY, 1, 1) is None
    disk.close()


def test_disk_dir_in_use_by_another_kvcache(tmp_path: Path) -> None:
    first = _disk(tmp_path)
    warnings: list[str] = []
    second = DiskTier(str(tmp_path), 1 << 20, warn=warnings.append)
    assert not second.enabled and warnings
    first.close()


# -- the handler, without sockets ------------------------------------------------------------------
