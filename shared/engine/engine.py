"""LLMEngine: continuous batching over a paged KV cache. `step()` = schedule, run, postprocess."""

from __future__ import annotations

from shared.engine.model_runner import ModelRunner
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import SeqStatus, Sequence, TokenEvent
from shared.kv.block_manager import BlockManager
from shared.sampling import SampleOutput


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        max_model_len: int,
        max_batch_tokens: int = 2048,
        max_seqs: int = 256,
    ) -> None:
        if blocks.block_size != runner.kv.block_size:
            raise ValueError("the block manager and the KV pool disagree on the block size")
        self.runner = runner
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(blocks, max_model_len, max_batch_tokens, max_seqs)

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq_id: int) -> bool:
        seq = self.scheduler.remove(seq_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list[TokenEvent]:
        work = self.scheduler.schedule()
        if not work:
            return []
        sampled, out = self.runner.run(work)
        self.scheduler.after_step(work)
        return self._postprocess(sampled, out)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _postprocess(self, sampled: list[Sequence], out: SampleOutput | None) -> list[TokenEvent]:
        if out is None:
            return []
        token_ids = out.token_ids.tolist()  # the step's one host sync
        logprobs = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
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
            if top_ids is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
            events.append(TokenEvent(seq.seq_id, token, logprobs[i], top, reason))
            if reason is not None:
                self.scheduler.running.remove(seq)
                self._finish(seq, reason)
        return events
