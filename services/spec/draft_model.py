"""The draft-model proposer: a small GGUF model with the target's vocabulary, loaded with the
project's own loader and model code on a device of the spec service's choosing, which guesses
a sequence's next k tokens greedily (argmax).

Per live sequence it keeps the K/V of the tokens it has seen in its own paged pool (a block
table from a `BlockManager`, prefix caching off: sequences never share blocks here):
`DraftState.tokens` are the tokens whose K/V sit at positions 0.. of its blocks, the sequence's
own first (`own` of them, known to equal the service's copy) and then the guesses of its last
draft that were fed back (drafts 1..k-1; the k-th is never fed). An ask:
- keeps the guesses the sequence went on to produce (their K/V is reused, not recomputed) and
  drops the rest by shortening `tokens`: the positions after it are simply written over, as a
  copy cut back by the worker (`cut`) is;
- feeds the tokens not yet seen, every asked sequence's in one forward (in pieces of at most
  `chunk` tokens a sequence, so a long prompt's attention stays bounded), the last position's
  logits giving the first guess;
- then up to k - 1 decode forwards, batched over the sequences still guessing.

When the pool runs out, the least recently asked sequences' states go (not those of the ask in
hand); they are recomputed from their copy when asked again. A sequence too long for the pool
or the draft's context gets no draft. `forget` frees a state (the sequence ended, or the
service's LRU evicted its copy).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from shared.kv import BlockManager, KVPool, OutOfBlocks
from shared.kv.kv_dtype import resolve_kv_dtype
from shared.loader import GGUFFile
from shared.model import ForwardBatch, SeqChunk, load_model

BLOCK_SIZE = 16
KV_BYTES = 256 << 20  # the pool's default size: a few-layer draft holds ~100k tokens in it
CHUNK = 256  # a sequence's most tokens in one forward


@dataclass
class DraftState:
    tokens: list[int] = field(default_factory=list)  # whose K/V is at positions 0.. of blocks
    own: int = 0  # how many of them are the sequence's own (the rest: its last draft's guesses)
    blocks: list[int] = field(default_factory=list)


@dataclass
class DraftStats:
    forwards: int = 0  # model steps (a prompt piece or a decode, all asked sequences in one)
    seconds: float = 0.0  # their time, logits and argmax included
    fed: int = 0  # tokens computed: unseen ones (or recomputed after an eviction), guesses fed
    reused: int = 0  # guesses that came true: their K/V kept
    evicted: int = 0  # states dropped to make room
    too_long: int = 0  # asks answered with no draft: the sequence does not fit


class DraftModel:
    def __init__(
        self,
        path: str,
        device: str = "cpu",
        kv_blocks: int = 0,
        chunk: int = CHUNK,
        cpu_weights: str = "native",
    ) -> None:
        self.path, self.device, self.chunk = path, torch.device(device), chunk
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        cpu_weights = cpu_weights if self.device.type == "cpu" else "float"
        self.model = load_model(GGUFFile(path), self.device, dtype, cpu_weights=cpu_weights)
        mc = self.model.cfg
        kv_dtype = resolve_kv_dtype("auto", dtype, str(self.device))
        n_layers = len(self.model.layers)
        if not kv_blocks:
            per = KVPool.bytes_per_block(n_layers, BLOCK_SIZE, mc.n_kv_heads, mc.head_dim, kv_dtype)
            kv_blocks = max(1, KV_BYTES // per)
        self.kv = KVPool(
            n_layers, kv_blocks, BLOCK_SIZE, mc.n_kv_heads, mc.head_dim, kv_dtype, self.device
        )
        self.blocks = BlockManager(kv_blocks, BLOCK_SIZE, prefix_caching=False)
        self.max_len = mc.context_length
        self.n_layers = n_layers
        self._states: OrderedDict[Hashable, DraftState] = OrderedDict()  # least recent first
        self.stats = DraftStats()
        self._warm_up()

    def _warm_up(self) -> None:
        """One short proposal before serving: the first forwards pay for first allocations
        (over a second on the CPU, past a worker's patience for an answer)."""
        key = object()
        self.propose([(key, [1] * 20, 2)])
        self.forget(key)
        self.stats = DraftStats()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._states

    def cached(self, key: Hashable) -> int:
        """Tokens whose K/V the sequence's state holds (0: none)."""
        st = self._states.get(key)
        return len(st.tokens) if st is not None else 0

    def cut(self, key: Hashable, start: int) -> None:
        """The sequence's copy changed from `start` on: its K/V past there no longer holds (a
        copy extended at its end keeps it all: guesses past the copy's end are checked when
        asked)."""
        st = self._states.get(key)
        if st is not None and start < st.own:
            del st.tokens[start:]
            st.own = start

    def forget(self, key: Hashable) -> None:
        st = self._states.pop(key, None)
        if st is not None and st.blocks:
            self.blocks.free(st.blocks)

    def propose(self, asks: list[tuple[Hashable, list[int], int]]) -> list[list[int]]:
        """Per (key, the sequence's tokens, k): up to k greedy guesses of what follows them
        ([] where it cannot: k = 0, an empty sequence, or no room)."""
        out: list[list[int]] = [[] for _ in asks]
        live: list[tuple[int, DraftState, list[int], int]] = []  # (ask, state, tokens, k)
        held: set[Hashable] = set()
        for i, (key, tokens, k) in enumerate(asks):
            k = min(k, self.max_len - len(tokens))
            st = self._prepare(key, tokens, k, held) if k > 0 and tokens else None
            if st is not None:
                held.add(key)
                live.append((i, st, tokens, k))
        if not live:
            return out
        try:
            self._feed(live, out)
            self._decode(live, out)
        except BaseException:  # half-fed states: drop them (recomputed when asked again)
            for key in held:
                self.forget(key)
            raise
        for _, st, tokens, _ in live:
            st.own = len(tokens)
        return out

    def _prepare(
        self, key: Hashable, tokens: list[int], k: int, held: set[Hashable]
    ) -> DraftState | None:
        """The sequence's state, most recent, its guesses checked against `tokens` and blocks
        for len(tokens) + k - 1 positions; None when the pool cannot hold it."""
        st = self._states.pop(key, None) or DraftState()
        self._states[key] = st
        n = own = min(st.own, len(tokens))
        while n < len(st.tokens) and n < len(tokens) and st.tokens[n] == tokens[n]:
            n += 1  # a guess the sequence went on to produce: its K/V holds
        kept = min(n, len(tokens) - 1)  # at least the last token is fed: its logits
        self.stats.reused += max(0, kept - own)
        del st.tokens[kept:]
        st.own = min(st.own, kept)
        need = -(-(len(tokens) + k - 1) // BLOCK_SIZE)
        if need > self.blocks.num_blocks:  # more than the whole pool: evict nobody for it
            self.forget(key)
            self.stats.too_long += 1
            return None
        while len(st.blocks) < need:
            try:
                st.blocks += self.blocks.allocate(need - len(st.blocks))
            except OutOfBlocks:
                if not self._evict_one({*held, key}):
                    self.forget(key)
                    self.stats.too_long += 1
                    return None
        return st

    def _evict_one(self, keep: set[Hashable]) -> bool:
        for other in self._states:
            if other not in keep:
                self.forget(other)
                self.stats.evicted += 1
                return True
        return False

    def _feed(self, live: list, out: list[list[int]]) -> None:
        """Every sequence's unseen tokens, in pieces, the last piece's last logits the first
        guess."""
        while True:
            chunks, firsts = [], []
            for i, st, tokens, _ in live:
                at = len(st.tokens)
                if at == len(tokens):
                    continue
                piece = tokens[at : at + self.chunk]
                last = at + len(piece) == len(tokens)
                chunks.append(SeqChunk(piece, at, st.blocks, "last" if last else "none"))
                st.tokens += piece
                self.stats.fed += len(piece)
                if last:
                    firsts.append(i)
            if not chunks:
                return
            for i, tok in zip(firsts, self._step(chunks), strict=True):
                out[i].append(tok)

    def _decode(self, live: list, out: list[list[int]]) -> None:
        """Each guess fed back for the next, until every sequence has its k."""
        while True:
            going = [(i, st) for i, st, _, k in live if len(out[i]) < k]
            if not going:
                return
            chunks = []
            for i, st in going:
                chunks.append(SeqChunk([out[i][-1]], len(st.tokens), st.blocks, "last"))
                st.tokens.append(out[i][-1])
            self.stats.fed += len(chunks)
            for (i, _), tok in zip(going, self._step(chunks), strict=True):
                out[i].append(tok)

    def _step(self, chunks: list[SeqChunk]) -> list[int]:
        """One forward; the argmax of each logits row."""
        start = time.perf_counter()
        batch = ForwardBatch.build(chunks, BLOCK_SIZE, self.device)
        ids = self.model(batch, self.kv).argmax(dim=-1).tolist()
        self.stats.forwards += 1
        self.stats.seconds += time.perf_counter() - start
        return ids

    def check_integrity(self) -> None:
        """Every state's blocks referenced once, nothing else held."""
        held: dict[int, int] = {}
        for st in self._states.values():
            assert st.own <= len(st.tokens), f"{st.own} own tokens of {len(st.tokens)} held"
            for b in st.blocks:
                held[b] = held.get(b, 0) + 1
        self.blocks.check_integrity(held)
