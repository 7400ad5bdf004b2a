"""KV block manager: reference-counted blocks with prefix caching over full blocks.

Contract:
- `allocate(n)` hands out n blocks with refcount 1, taking them from the front of the free list
  (least recently freed first); a cached block taken this way loses its hash (evicted).
- `free(blocks)` drops one reference each; a block reaching 0 goes to the back of the free list
  and keeps its hash and tokens, so a later request with the same prefix can reuse it.
- `commit(block, parent_hash, tokens)` names a full block by a chained hash of its parent's hash,
  its token ids and the manager's extra key; the hash is what the prefix index, and later the RAM
  and disk tiers, call the block.
- `match_prefix(token_ids, max_blocks)` returns the longest run of cached full blocks for a
  prompt, taking a reference on each; every hit is checked against the block's token ids.
- `on_commit(block, hash, tokens)`, when set, hears of every block newly named, and
  `on_evict(block, hash, tokens)` of every named block about to lose its name to an allocation
  (the kvcache tiers copy it out, if they have not); `commit(..., notify=False)` names a block
  restored from a tier silently.
- `hashes(token_ids, n)` and `cached_run(hashes)`: a prompt's block hashes, and how many of them
  lead in the index (no references taken).
- `partial_hash(parent, tokens)`: the name of a prompt's last, partial block in the tiers (a
  hand-off between workers); the prefix index never holds one.
- `check_integrity()` verifies refcounts, the free list and the hash index against each other.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np

ROOT_HASH = 0


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks; the scheduler waits or preempts."""


def chain_hash(parent: int, tokens: list[int], extra: bytes = b"") -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def partial_hash(parent: int, tokens: list[int], extra: bytes = b"") -> int:
    """A name for a block's first tokens (fewer than a block's): the last block of a prompt
    that a prefill worker hands on through the kvcache. Never a full block's name."""
    return chain_hash(parent, tokens, extra + b"partial")


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, extra_key: bytes = b""
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.extra_key = extra_key  # e.g. the model's identity: hashes never cross models
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._index: dict[int, int] = {}  # hash -> block
        self.on_commit: Callable[[int, int, tuple[int, ...]], None] | None = None
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if self.hash[b] is not None)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            if self.on_evict is not None and self.hash[block] is not None:
                self.on_evict(block, self.hash[block], self.tokens[block])
            self._forget(block)
            self.ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        # the tail of a sequence is the least shareable part: evict it first
        for block in reversed(blocks):
            if self.ref[block] <= 0:
                raise ValueError(f"KV block {block} freed more often than referenced")
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self._free[block] = None

    def commit(self, block: int, parent: int, tokens: list[int], notify: bool = True) -> int:
        h = chain_hash(parent, tokens, self.extra_key)
        if not self.prefix_caching:
            return h
        if self.hash[block] is not None and self.hash[block] != h:
            self._forget(block)
        self.hash[block] = h
        self.tokens[block] = tuple(tokens)
        # an identical block already indexed stays the canonical one
        self._index.setdefault(h, block)
        if notify and self.on_commit is not None:
            self.on_commit(block, h, self.tokens[block])
        return h

    def _chain(self, token_ids: list[int], n_blocks: int) -> Iterator[tuple[list[int], int]]:
        """(tokens, chained hash) of the first n_blocks full blocks of token_ids, lazily."""
        parent, bs = ROOT_HASH, self.block_size
        for i in range(min(n_blocks, len(token_ids) // bs)):
            tokens = token_ids[i * bs : (i + 1) * bs]
            parent = chain_hash(parent, tokens, self.extra_key)
            yield tokens, parent

    def hashes(self, token_ids: list[int], n_blocks: int) -> list[int]:
        """The chained hashes of the first n_blocks full blocks of token_ids."""
        return [h for _, h in self._chain(token_ids, n_blocks)]

    def cached_run(self, hashes: list[int]) -> int:
        """How many of hashes, from the first, name indexed blocks (no reference taken)."""
        if not self.prefix_caching:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in self._index:
            n += 1
        return n

    def match_prefix(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Cached blocks for the leading full blocks of `token_ids` (at most `max_blocks`) and
        their hashes. The caller owns one reference on each returned block."""
        if not self.prefix_caching:
            return [], []
        blocks, hashes = [], []
        for tokens, h in self._chain(token_ids, max_blocks):
            block = self._index.get(h)
            if block is None or self.tokens[block] != tuple(tokens):
                break  # a miss, or a hash collision caught by the token check
            if self.ref[block] == 0:
                del self._free[block]
            self.ref[block] += 1
            blocks.append(block)
            hashes.append(h)
        return blocks, hashes

    def _forget(self, block: int) -> None:
        h = self.hash[block]
        if h is not None and self._index.get(h) == block:
            del self._index[h]
        self.hash[block] = None
        self.tokens[block] = None

    def check_integrity(self, held: dict[int, int] | None = None) -> None:
        """`held`: block -> references the caller's sequences hold, checked when given."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        for b in range(self.num_blocks):
            assert self.ref[b] >= 0, f"block {b} has refcount {self.ref[b]}"
            assert (self.ref[b] == 0) == (b in self._free), f"block {b}: refcount vs free list"
            if held is not None:
                assert self.ref[b] == held.get(b, 0), (
                    f"block {b}: {self.ref[b]} refs, {held.get(b, 0)} held"
                )
        for h, b in self._index.items():
            assert self.hash[b] == h, f"index names block {b} for a hash it no longer has"
            assert self.tokens[b] is not None and len(self.tokens[b]) == self.block_size
