"""Scheduler: which sequences run in the next step, and how many of their tokens.

Per step a token budget: sequences that are decoding go first, then prompt chunks (chunked
prefill) of running and newly admitted requests fill the rest. A newly admitted prompt first
takes whatever full blocks of it the prefix cache holds and skips their computation. When a
running sequence cannot grow, the newest running sequence is preempted (its blocks are freed
but stay cached, so recomputing it mostly hits the prefix cache) rather than failing anyone.

A chunk over a long cached prefix costs more per token (its attention reads the whole prefix),
so while others decode, a step carrying one is kept to ``long_prefix_step`` tokens: on the H200
a 512-token step over a 16k prefix took 40-48 ms, a 256-token one about 19 ms, and W3's
decoding streams wait that long for each token (BENCHMARKS.md 2026-11-30 (n)).
"""

from __future__ import annotations

from collections import deque

from shared.engine.sequence import SeqStatus, Sequence
from shared.kv.block_manager import ROOT_HASH, BlockManager

Work = list[tuple[Sequence, int]]  # (sequence, tokens to compute in this step)


LONG_PREFIX = 8192  # cached tokens before a chunk counts as long
LONG_PREFIX_STEP = 256  # tokens of a step that carries decodes and a long-prefix chunk
LONG_PREFIX_MIN_CHUNK = 32  # such a chunk's least tokens, however many decodes there are


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_model_len: int,
        max_batch_tokens: int,
        max_seqs: int,
        long_prefix_step: int = LONG_PREFIX_STEP,
    ) -> None:
        """long_prefix_step: tokens of a step with decodes and a chunk over LONG_PREFIX cached
        tokens (0: no such limit)."""
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.long_prefix_step = long_prefix_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """ValueError if seq can never run here (empty, too long for the context or pool)."""
        total = len(seq.prompt_ids) + seq.max_tokens
        if not seq.prompt_ids:
            raise ValueError("the prompt is empty")
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(seq.prompt_ids)} tokens) plus max_tokens ({seq.max_tokens}) "
                f"exceeds the context length {self.max_model_len}"
            )
        if self._blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(f"{total} tokens need more KV blocks than this worker has")

    def remove(self, seq_id: int) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    return seq
        return None

    def release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def schedule(self, can_preempt: bool = True, prefill_cap: int | None = None) -> Work | None:
        """The next step's work. With can_preempt False (tokens in flight, whose ids a
        recompute would need), returns None instead of preempting anyone. prefill_cap limits
        the prompt tokens of a step that also carries decodes."""
        budget = self.max_batch_tokens
        work: Work = []
        decodes = 0
        for seq in sorted(self.running, key=lambda s: s.num_pending):
            if seq.status is not SeqStatus.RUNNING or budget == 0 or seq.sampling_done:
                continue
            if seq.num_pending > 1 and decodes and prefill_cap is not None:
                budget = min(budget, prefill_cap)  # decodes come first: the rest is prompts
                prefill_cap = None
            decodes += seq.num_pending == 1
            n = min(seq.num_pending, budget)
            if seq.num_pending > 1 and decodes:
                n = self._long_prefix_cap(seq, n, budget)
            if n == 0:
                continue
            n += self._verifying(seq, budget - n)
            while not self._reserve(seq, seq.num_computed + n):
                if not can_preempt:
                    return None
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                work.append((seq, n))
                budget -= n
        # a sequence scheduled above may have been preempted for a later one
        work = [(s, n) for s, n in work if s.status is SeqStatus.RUNNING]
        if decodes and prefill_cap is not None:
            budget = min(budget, prefill_cap)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self._match_prefix(seq)
            n = min(seq.num_pending, budget)
            if decodes:
                n = self._long_prefix_cap(seq, n, budget)
            if not self._reserve(seq, seq.num_computed + n):
                # a waiting sequence holds nothing: its prefix hits go back to the cache
                self.release(seq)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            work.append((seq, n))
            budget -= n
        return work

    def _verifying(self, seq: Sequence, budget: int) -> int:
        """Draft tokens a decoding sequence's step verifies: its proposal, within the budget,
        its max_tokens (the kept drafts and the model's own token after them) and the free
        blocks (a draft never preempts anyone: without room it waits for a later step)."""
        seq.num_verifying = 0
        if seq.num_pending != 1 or not seq.draft or seq.num_inflight:
            return 0
        d = min(len(seq.draft), budget, seq.max_tokens - len(seq.output_ids) - 1)
        if d <= 0 or not self._reserve(seq, seq.num_tokens + d):
            return 0
        seq.num_verifying = d
        return d

    def trim(self, seq: Sequence) -> None:
        """Frees a sequence's blocks past its tokens (those its rejected drafts were written
        to): never full of kept tokens, so never hashed."""
        keep = self._blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.blocks.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _long_prefix_cap(self, seq: Sequence, n: int, budget: int) -> int:
        """A prompt chunk's tokens in a step that carries decodes: over a long cached prefix,
        the step stays within long_prefix_step tokens (the chunk gets at least
        LONG_PREFIX_MIN_CHUNK)."""
        if not self.long_prefix_step or seq.num_computed < LONG_PREFIX:
            return n
        used = self.max_batch_tokens - budget
        return min(n, max(self.long_prefix_step - used, LONG_PREFIX_MIN_CHUNK))

    def after_step(self, work: Work) -> None:
        """Advance what was computed and name the blocks that became full."""
        bs = self.block_size
        for seq, n in work:
            if seq.status is not SeqStatus.RUNNING:
                continue  # finished or aborted while its step ran: its blocks are gone
            seq.num_computed += n
            ids = None
            while len(seq.block_hashes) < seq.num_computed // bs:
                # a verified step's kept drafts are computed before they join the output
                ids = ids or seq.all_ids + seq.draft
                i = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
                h = self.blocks.commit(seq.block_table[i], parent, ids[i * bs : (i + 1) * bs])
                seq.block_hashes.append(h)

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _match_prefix(self, seq: Sequence) -> None:
        ids = seq.all_ids
        # keep at least one token to compute, in a block of its own: a shared block is never
        # written again, and the last token's logits are needed anyway
        blocks, hashes = self.blocks.match_prefix(ids, (len(ids) - 1) // self.block_size)
        seq.block_table = blocks
        seq.block_hashes = hashes
        seq.num_computed = len(blocks) * self.block_size
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed)

    def _reserve(self, seq: Sequence, n_tokens: int) -> bool:
        need = self._blocks_for(n_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def check_integrity(self) -> None:
        held: dict[int, int] = {}
        for seq in [*self.running, *self.waiting]:
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        self.blocks.check_integrity(held)
