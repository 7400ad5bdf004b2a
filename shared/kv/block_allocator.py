"""Hands out KV block ids from a free list. Prefix caching and reference counts build on this."""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for the request; the scheduler waits or preempts."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"KV block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & self._used, "a block is both free and used"
        assert free | self._used == set(range(self.num_blocks)), "a block was lost"
