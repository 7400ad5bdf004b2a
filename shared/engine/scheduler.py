"""Scheduler: which sequences run in the next step, and how many of their tokens.

Per step a token budget: sequences that are decoding go first, then prompt chunks (chunked
prefill) of running and newly admitted requests fill the rest. Beside decodes, a chunk is sized
by the ``ChunkBudget`` so the decoding streams' step stays short on whatever device this is.
Prompts take turns by how much of them has been computed (``_prompt_order``). A newly admitted
prompt first takes whatever full blocks of it the prefix cache holds and skips their
computation. When a running sequence cannot grow, the newest running sequence is preempted
(its blocks are freed but stay cached, so recomputing it mostly hits the prefix cache) rather
than failing anyone. When a preempted sequence fits again but the pool has lost some of its
blocks meanwhile, `on_resume` (the KV tiers', when a worker has them) may take it aside to bring
them back first; it returns through `add`, ahead of the prompts waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from shared.engine.chunk_budget import ChunkBudget
from shared.engine.sequence import SeqStatus, Sequence
from shared.engine.step_cost import chunk_pairs
from shared.kv.block_manager import ROOT_HASH, BlockManager

Work = list[tuple[Sequence, int]]  # (sequence, tokens to compute in this step)


PREFILL_QUANTUM = 2048  # prompt tokens a prompt computes before it yields to less-served ones


def _served(seq: Sequence) -> int:
    """Prompt tokens this sequence has computed itself (not taken from the prefix cache)."""
    return max(0, seq.num_computed - seq.num_cached_tokens)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_model_len: int,
        max_batch_tokens: int,
        max_seqs: int,
    ) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # a preempted sequence about to run again: True when the hook took it (out of the
        # waiting queue; it comes back through `add`)
        self.on_resume: Callable[[Sequence], bool] | None = None

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        if seq.num_preemptions:  # back from `on_resume`: it keeps its place in the queue
            self.waiting.appendleft(seq)
        else:
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

    def schedule(self, can_preempt: bool = True, budget: ChunkBudget | None = None) -> Work | None:
        """The next step's work. With can_preempt False (tokens in flight, whose ids a
        recompute would need), returns None instead of preempting anyone. With a budget, the
        prompt chunks of a step that also carries decodes are sized to keep it short."""
        left = self.max_batch_tokens
        load = [0, 0]  # the step's rows and query-key pairs so far
        work: Work = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.sampling_done or left == 0:
                continue
            if seq.num_pending != 1:
                continue
            n = 1 + self._verifying(seq, left - 1)
            if not self._place(seq, n, can_preempt):
                return None
            if seq.status is SeqStatus.RUNNING:
                work.append((seq, n))
                left -= n
        # a sequence scheduled above may have been preempted for a later one
        work = [(s, n) for s, n in work if s.status is SeqStatus.RUNNING]
        for seq, n in work:
            load[0] += n
            load[1] += chunk_pairs(n, seq.num_computed)
        allowed = budget.allowed_ms(*load) if budget is not None and work else None
        admitting = True
        for seq in self._prompt_order():
            if left == 0:
                break
            waiting = seq.status is SeqStatus.WAITING
            seq.num_verifying = 0
            if waiting and not (admitting and len(self.running) < self.max_seqs):
                continue
            if not waiting and (seq.status is not SeqStatus.RUNNING or seq.num_pending < 1):
                continue  # preempted above, or nothing to compute
            if waiting and not seq.block_table:
                self._match_prefix(seq)
            n = min(seq.num_pending, left)
            if allowed is not None:
                n = budget.chunk(load[0], load[1], seq.num_computed, n, allowed)
            if waiting:
                if not self._reserve(seq, seq.num_computed + n):
                    # a waiting sequence holds nothing: its prefix hits go back to the cache
                    self.release(seq)
                    seq.num_computed = 0
                    admitting = False  # later prompts do not overtake it
                    continue
                if self._resume(seq, n):
                    continue
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            elif not self._place(seq, n, can_preempt):
                return None
            if seq.status is SeqStatus.RUNNING:
                work.append((seq, n))
                left -= n
                load[0] += n
                load[1] += chunk_pairs(n, seq.num_computed)
        return [(s, n) for s, n in work if s.status is SeqStatus.RUNNING]

    def _place(self, seq: Sequence, n: int, can_preempt: bool) -> bool:
        """Reserves blocks for a running sequence's n more tokens, preempting the newest
        running sequences (seq itself last) for room; False where that needs a preemption
        and can_preempt is False."""
        while not self._reserve(seq, seq.num_computed + n):
            if not can_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                break
        return True

    def _prompt_order(self) -> list[Sequence]:
        """Prompts to compute, running ones before waiting ones, in classes of how much prompt
        they have computed so far (PREFILL_QUANTUM tokens a class): first come, first served
        within a class, and a prompt that has had its quantum yields to those that have had
        less. A short prompt arriving during a long one's prefill starts at once; several long
        ones take turns by quanta, none waiting for another to end."""
        prompts = [s for s in self.running if s.num_pending > 1] + list(self.waiting)
        return sorted(prompts, key=lambda s: _served(s) // PREFILL_QUANTUM)

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

    def _resume(self, seq: Sequence, n: int) -> bool:
        """A preempted sequence that fits again (its blocks reserved for n more tokens), but
        whose full blocks the pool has partly lost meanwhile: True when `on_resume` takes it
        aside (its blocks released) to bring those back before it runs. Asked once a
        preemption."""
        if not seq.swapped or self.on_resume is None:
            return False
        seq.swapped = False
        if len(seq.block_hashes) >= (seq.num_tokens - 1) // self.block_size:
            return False  # the pool holds every one
        self.release(seq)
        seq.num_computed = 0
        if self.on_resume(seq):
            self.waiting.remove(seq)
            return True
        # not taken (no tiers at present): as it was, on the blocks just released
        self._match_prefix(seq)
        if not self._reserve(seq, seq.num_computed + n):
            raise AssertionError("the blocks a sequence released could not be taken again")
        return False

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
        seq.swapped = True
        self.waiting.appendleft(seq)

    def check_integrity(self) -> None:
        held: dict[int, int] = {}
        for seq in [*self.running, *self.waiting]:
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        self.blocks.check_integrity(held)
