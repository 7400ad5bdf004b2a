"""Between a worker's engine and the kvcache service: prompts whose blocks a tier holds wait
here (never the loop) for their lookup, then enter the engine with those blocks restored into
the KV pool, named as the prefix cache names them, so that only the rest is computed.

A request a prefill worker handed on (a prompt and its first token) also looks up the prompt's
last, partial block (`partial_hash`): found, it joins the sequence's block table with the
full blocks before it, so that only the first token is computed.

A preempted sequence takes the same path when the scheduler is about to run it again
(`Scheduler.on_resume`): its blocks evicted from the pool meanwhile were copied to the RAM tier
(when named, or when about to be reused), and come back from there instead of being computed
again.

A lookup unanswered within RESTORE_TIMEOUT_S (a kvcache busy or gone) lets its prompt in
without it. A found block is used only when its hash is the prompt's block hash at that place
and its token ids are the prompt's; the run stops at the first that is not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.engine import Sequence
from shared.engine.engine import LLMEngine
from shared.kv import OutOfBlocks
from shared.kv.block_manager import ROOT_HASH, partial_hash
from shared.kv.tier_client import TierClient
from shared.protocol import Histogram, KVBlock, KVFound
from shared.worker.restore_timing import RestoreTimer

RESTORE_TIMEOUT_S = 1.0


@dataclass
class _Parked:
    seq: Sequence
    hashes: list[int]  # the prompt's full blocks' hashes (those the pool holds first)
    in_pool: int  # how many lead in the pool
    deadline: float
    tail: list[int]  # a handed-on prompt's tokens after its full blocks (its partial block)
    asked: float  # perf_counter when the lookup was sent


class KVTiers:
    def __init__(self, engine: LLMEngine, client: TierClient) -> None:
        self.engine = engine
        self.client = client
        self._parked: dict[int, _Parked] = {}  # lookup id ->
        self.stats = {"lookups": 0, "timeouts": 0, "blocks_restored": 0, "mismatches": 0,
                      "resumed": 0}  # fmt: skip
        self.timer = RestoreTimer(client.cuda)
        # every named block is copied out once: when named (so that a restart finds it; the
        # copies of a step's blocks go together, at the next poll), or when about to be reused
        # if that found no slot or no kvcache (at once: the step after overwrites it)
        engine.blocks.on_commit = client.stage
        engine.blocks.on_evict = client.store
        engine.scheduler.on_resume = self.resume

    def counts(self) -> dict[str, int]:
        """What the heartbeats report (Heartbeat.kv_tiers)."""
        c = self.client.stats
        return {
            "stored": c["stored"], "restored": self.stats["blocks_restored"],
            "lookups": self.stats["lookups"], "timeouts": self.stats["timeouts"],
            "mismatches": self.stats["mismatches"], "no_slot": c["skipped_no_slot"],
            "restore_us": self.timer.copy_us, "resumed": self.stats["resumed"],
            "restored_bytes": self.stats["blocks_restored"] * self.client.block_bytes,
        }  # fmt: skip

    def histograms(self) -> dict[str, Histogram]:
        """What the heartbeats report (Heartbeat.kv_restore)."""
        return self.timer.histograms()

    @property
    def waiting(self) -> bool:
        return bool(self._parked)

    def resume(self, seq: Sequence) -> bool:
        """A preempted sequence the scheduler is about to run again: True when it waits for a
        lookup of its blocks that the pool no longer holds (it re-enters from `poll`)."""
        if not self.admit(seq, handed_on=False):
            return False
        self.stats["resumed"] += 1
        return True

    def admit(self, seq: Sequence, handed_on: bool = True) -> bool:
        """True when seq waits for a lookup (it enters the engine from `poll`). handed_on:
        a sequence with output tokens is a request another worker prefilled (its partial
        block is looked up too), not a preempted one."""
        blocks = self.engine.blocks
        ids = seq.all_ids  # a resumed request's tokens so far (a prompt and its first token)
        # the last token is always computed (the scheduler's rule), so its block is not
        full = (len(ids) - 1) // blocks.block_size
        hashes = blocks.hashes(ids, full)
        in_pool = blocks.cached_run(hashes)
        ask = hashes[in_pool:]
        tail = ids[full * blocks.block_size : -1] if handed_on and seq.output_ids else []
        if tail:
            parent = hashes[-1] if hashes else ROOT_HASH
            ask.append(partial_hash(parent, tail, blocks.extra_key))
        lookup_id = self.client.lookup(ask)
        if lookup_id is None:
            return False
        self.stats["lookups"] += 1
        deadline = time.monotonic() + RESTORE_TIMEOUT_S
        asked = time.perf_counter()
        self._parked[lookup_id] = _Parked(seq, hashes, in_pool, deadline, tail, asked)
        return True

    def abort(self, seq_id: int) -> bool:
        for lookup_id, p in list(self._parked.items()):
            if p.seq.seq_id == seq_id:
                del self._parked[lookup_id]
                return True
        return False

    def poll(self) -> list[Sequence]:
        """The parked prompts ready for the engine: answered (restored) or timed out."""
        ready = []
        for found in self.client.poll():
            parked = self._parked.pop(found.lookup_id, None)
            if parked is not None:
                began = self.timer.begin()
                if self._restore(parked, found):
                    self.timer.end(parked.asked, began)
                ready.append(parked.seq)
            self.client.release(found)
        self.timer.poll()
        now = time.monotonic()
        for lookup_id, p in list(self._parked.items()):
            if now > p.deadline:
                del self._parked[lookup_id]
                self.stats["timeouts"] += 1
                ready.append(p.seq)
        return ready

    def _restore(self, p: _Parked, found: KVFound) -> int:
        """Copies the found blocks that continue the pool's run into pool blocks, as cached
        free blocks (and a handed-on prompt's partial block into its table); how many."""
        blocks, bs, ids = self.engine.blocks, self.engine.blocks.block_size, p.seq.all_ids
        # a reference on the pool's leading blocks while the restored ones are allocated, so
        # that the allocation cannot evict them
        held, _ = blocks.match_prefix(ids, p.in_pool)
        if len(held) != p.in_pool:  # the pool changed meanwhile: compute the prompt
            blocks.free(held)
            return 0
        restored: list[int] = []
        reads: list[tuple[KVBlock, int]] = []
        partial = None
        try:
            for i, b in enumerate(found.blocks):
                at = p.in_pool + i
                if at == len(p.hashes) and p.tail and b.tokens == p.tail:
                    partial = b  # checked against its hash below
                    break
                tokens = ids[at * bs : (at + 1) * bs]
                if at >= len(p.hashes) or b.hash != p.hashes[at] or b.tokens != tokens:
                    self.stats["mismatches"] += 1
                    break
                try:
                    (block,) = blocks.allocate(1)
                except OutOfBlocks:
                    break
                restored.append(block)
                reads.append((b, block))
                parent = p.hashes[at - 1] if at else ROOT_HASH
                blocks.commit(block, parent, tokens, notify=False)
        finally:
            # the copies, in one batch, queued before any later use of the blocks; then back
            # to the free list's far end as cached blocks: the scheduler's prefix match takes
            # them when this prompt is scheduled
            self.client.read(reads)
            blocks.free(held + restored)
        self.stats["blocks_restored"] += len(restored)
        if partial is not None and p.in_pool + len(restored) == len(p.hashes):
            return len(restored) + self._attach_partial(p, partial)
        return len(restored)

    def _attach_partial(self, p: _Parked, b: KVBlock) -> int:
        """The handed-on prompt's partial block, after all its full ones: the sequence enters
        the engine holding them, its prompt computed."""
        blocks, seq = self.engine.blocks, p.seq
        parent = p.hashes[-1] if p.hashes else ROOT_HASH
        if b.hash != partial_hash(parent, p.tail, blocks.extra_key):
            self.stats["mismatches"] += 1
            return 0
        held, hashes = blocks.match_prefix(seq.all_ids, len(p.hashes))
        if len(held) != len(p.hashes):
            blocks.free(held)
            return 0
        try:
            (block,) = blocks.allocate(1)
        except OutOfBlocks:
            blocks.free(held)
            return 0
        self.client.read([(b, block)])
        seq.block_table, seq.block_hashes = [*held, block], hashes
        seq.num_computed = seq.num_cached_tokens = len(seq.all_ids) - 1
        self.stats["blocks_restored"] += 1
        return 1
