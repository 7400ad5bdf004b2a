"""LLMEngine: continuous batching over a paged KV cache. `step()` = schedule, run, postprocess.

Scheduling per step: a token budget; sequences that are decoding go first, then prompt chunks
(chunked prefill) of running and newly admitted requests fill the rest. Admission needs free
KV blocks; when a running sequence cannot grow, the newest running sequence is preempted
(its blocks freed, recomputed later) rather than failing anyone.
"""

from __future__ import annotations

from collections import deque

from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import SeqStatus, Sequence, TokenEvent
from shared.kv import BlockAllocator


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        allocator: BlockAllocator,
        max_model_len: int,
        max_batch_tokens: int = 2048,
        max_seqs: int = 256,
    ) -> None:
        self.runner = runner
        self.allocator = allocator
        self.block_size = runner.kv.block_size
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        total = len(seq.prompt_ids) + seq.max_tokens
        if not seq.prompt_ids:
            raise ValueError("the prompt is empty")
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(seq.prompt_ids)} tokens) plus max_tokens ({seq.max_tokens}) "
                f"exceeds the context length {self.max_model_len}"
            )
        if self._blocks_for(total) > self.allocator.num_blocks:
            raise ValueError(f"{total} tokens need more KV blocks than this worker has")
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[TokenEvent]:
        work = self._schedule()
        if not work:
            return []
        sampled, out = self.runner.run(work)
        for seq, n in work:
            seq.num_computed += n
        return self._postprocess(sampled, out)

    # -- scheduling ------------------------------------------------------------------------------

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _reserve(self, seq: Sequence, n_tokens: int) -> bool:
        need = self._blocks_for(n_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_batch_tokens
        work: list[tuple[Sequence, int]] = []
        decoding_first = sorted(self.running, key=lambda s: s.num_pending)
        for seq in decoding_first:
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_pending, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                work.append((seq, n))
                budget -= n
        # a sequence scheduled above may have been preempted for a later one
        work = [(s, n) for s, n in work if s.status is SeqStatus.RUNNING]
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, seq.num_computed + n):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            work.append((seq, n))
            budget -= n
        return work

    # -- results ---------------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _postprocess(self, sampled: list[Sequence], out) -> list[TokenEvent]:
        if out is None:
            return []
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        tops = None
        if out.top_ids is not None:
            tops = list(zip(out.top_ids.tolist(), out.top_logprobs.tolist(), strict=True))
        events = []
        for i, seq in enumerate(sampled):
            token = token_ids[i]
            seq.output_ids.append(token)
            reason = None
            if token in seq.stop_ids:
                reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens:
                reason = "length"
            top = None
            if tops is not None and seq.params.logprobs is not None:
                ids, lps = tops[i]
                top = list(zip(ids, lps, strict=True))[: seq.params.logprobs]
            events.append(TokenEvent(seq.seq_id, token, logprobs[i], top, reason))
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
        return events
