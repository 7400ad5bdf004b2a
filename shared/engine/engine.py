"""LLMEngine: continuous batching over a paged KV cache. `step()` = schedule, run, postprocess.

With ``overlap`` the CPU prepares step N+1 while the device runs step N: step N+1 is scheduled
and launched before step N's sampled ids reach the host (each decode's new token id is copied
from step N's output on the device), and only then does the engine wait for step N's ids and
postprocess them. A step's events therefore come out of the *next* call to ``step()``. A
sequence that stops at step N has already been given a place in step N+1; that row is computed
and dropped. Steps fall back to the synchronous order when a running request uses penalties
(they need every id on the host) or when a sequence must be preempted (its recompute needs
them too). A grammar's mask needs the token before it too, but only at sampling: the runner
waits for step N's ids after launching step N+1's forward (``_catch_up``), so the device keeps
running while the host advances the grammars and fills the masks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.chunk_budget import ChunkBudget
from shared.engine.model_runner import ModelRunner
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import SeqStatus, Sequence, TokenEvent
from shared.engine.step_cost import chunk_pairs
from shared.kernels.host_copy import copy_to_host
from shared.kv.block_manager import BlockManager
from shared.sampling import SampleOutput
from shared.staging import PinnedRing


@dataclass
class _InFlight:
    """A launched step whose sampled ids are still on their way to the host."""

    sampled: list[Sequence]
    device_out: SampleOutput  # read by the next step on the device
    host_out: SampleOutput  # pinned copies, valid once `ready` has passed
    ready: torch.cuda.Event | None
    shape: tuple[int, int]  # (rows, query-key pairs): for the step cost model


def _shape(work: list[tuple[Sequence, int]]) -> tuple[int, int]:
    """A scheduled step's rows and its attention's query-key pairs (before it advances)."""
    return sum(n for _, n in work), sum(chunk_pairs(n, s.num_computed) for s, n in work)


def _to_host(
    out: SampleOutput, ids: torch.Tensor | None
) -> tuple[SampleOutput, torch.cuda.Event | None]:
    """Start copying a step's results to pinned host memory; the event marks their arrival
    (waiting on it does not wait for steps launched after this one). ids: pinned int64 (a
    PinnedRing's; given for a CUDA step, None off CUDA) for the token ids, where the argmax
    stored them already (out.host_ids) or a kernel stores them now (host_copy), not a
    device->host copy on the stream. H200, W1 (BENCHMARKS.md 2026-12-03 (at)): with the pinned
    inputs, against both copies, +0.2 to +0.6 % (call 2, the copy kernel); the argmax's own
    stores against the copy, Q6_K +0.4 / +0.2 % (call 6)."""
    if out.token_ids.device.type != "cuda":
        return out, None

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    if out.host_ids is not None:
        host_ids = out.host_ids
    else:
        host_ids = copy_to_host(out.token_ids.contiguous(), ids[: out.token_ids.shape[0]])
    host = SampleOutput(host_ids, copy(out.logprobs), copy(out.top_ids), copy(out.top_logprobs))
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        max_model_len: int,
        max_batch_tokens: int = 2048,
        max_seqs: int = 256,
        overlap: bool = False,
        step_target_ms: float = 0.0,
    ) -> None:
        """The prompt chunks of steps that carry decodes are sized by a ``ChunkBudget``:
        step_target_ms 0 lets it keep such steps within twice the decodes' own time (at least
        its floor), > 0 sets that floor, < 0 turns it off (chunks up to max_batch_tokens)."""
        if blocks.block_size != runner.kv.block_size:
            raise ValueError("the block manager and the KV pool disagree on the block size")
        self.runner = runner
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.overlap = overlap
        self.scheduler = Scheduler(blocks, max_model_len, max_batch_tokens, max_seqs)
        self._inflight: _InFlight | None = None
        self.chunk_budget = (
            ChunkBudget(max_batch_tokens, target_ms=step_target_ms) if step_target_ms >= 0 else None
        )
        self._resolved_at = 0.0  # when the last overlapped step's ids arrived
        self._ids_ring = PinnedRing()  # pinned buffers the sampled ids are stored into
        # verified drafts: steps, and tokens drafted and accepted by proposer ("drafted:prompt")
        self.spec_stats: Counter[str] = Counter()
        self.speculate = True  # False: drafts are not asked for (the worker's batch rule)
        # hears of every sequence that ends (with its reason) while it still holds its blocks
        self.on_finish: Callable[[Sequence, str], None] | None = None

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def check(self, seq: Sequence) -> None:
        """ValueError if seq could never run on this engine (what `add` would raise)."""
        self.scheduler.check(seq)

    def abort(self, seq_id: int) -> bool:
        seq = self.scheduler.remove(seq_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight)

    def step(self) -> list[TokenEvent]:
        speculating = self._speculating()
        if self.overlap and not speculating:
            return self._step_overlapped()
        if self._inflight is not None:  # the overlapped step before this one's, first
            prev, self._inflight = self._inflight, None
            return self._resolve(prev)
        start = time.perf_counter()
        work = self.scheduler.schedule(budget=self.chunk_budget)
        if not work:
            return []
        shape = _shape(work)
        sampled, out = self.runner.run(work)
        host = _HostOut.of(out)
        if speculating:
            work = self._keep_accepted(work, sampled, host)
        self.scheduler.after_step(work)
        events = self._postprocess(sampled, host)
        if speculating:
            for seq, _ in work:
                seq.draft, seq.num_verifying = [], 0
                if seq.status is SeqStatus.RUNNING:
                    self.scheduler.trim(seq)
        if self.chunk_budget is not None:
            # a verified step computed every draft row, kept or not
            self.chunk_budget.observe(*shape, time.perf_counter() - start)
        return events

    def _speculating(self) -> bool:
        """Whether a running sequence asks for drafts or holds one: its steps are verified
        one at a time (a proposal follows the tokens the step before it kept)."""
        if not self.speculate:
            return False
        return any(s.draft or (s.spec is not None and s.spec.k) for s in self.scheduler.running)

    def _keep_accepted(
        self, work: list[tuple[Sequence, int]], sampled: list[Sequence], host: _HostOut
    ) -> list[tuple[Sequence, int]]:
        """The work as far as it holds: a verifying sequence computed its own token and its
        accepted drafts; the K/V written for the drafts after them is left to be overwritten."""
        row, rejected = 0, {}
        for seq in sampled:
            d = seq.num_verifying
            kept = 0
            while kept < d and host.accepted[row + kept]:
                kept += 1
            if seq.spec is not None and seq.output_ids:  # a decode (not a prompt's end)
                seq.spec.observe(d, kept)
            if d:
                self.spec_stats[f"drafted:{seq.draft_source}"] += d
                self.spec_stats[f"accepted:{seq.draft_source}"] += kept
                self.spec_stats["steps"] += 1
                rejected[seq.seq_id] = d - kept
            row += d + 1
        return [(s, n - rejected.get(s.seq_id, 0)) for s, n in work]

    def _step_overlapped(self) -> list[TokenEvent]:
        prev = self._inflight
        work = None
        if prev is None or not any(s.params.has_penalties for s in self.scheduler.running):
            work = self.scheduler.schedule(can_preempt=prev is None, budget=self.chunk_budget)
        if work is None:  # penalties or a preemption need the in-flight ids first
            self._inflight = None
            return self._resolve(prev) if prev else []
        launched = None
        if work:
            if prev is None:  # the pipeline (re)starts: time its first step from its launch
                self._resolved_at = time.perf_counter()
            ids = None  # where the step's ids go on the host (a buffer of the ring)
            if self.runner.device.type == "cuda":
                ids = self._ids_ring.take(8 * len(work)).view(torch.int64)
            catch_up = (lambda: self._catch_up(prev)) if prev else None
            sampled, out = self.runner.run(work, prev.device_out if prev else None, ids, catch_up)
            ready = None
            if out is not None:
                host, ready = _to_host(out, ids)
                launched = _InFlight(sampled, out, host, ready, _shape(work))
            if ids is not None:  # their writer is queued (or none was: no sampled rows)
                self._ids_ring.read(ready)
        events = self._resolve(prev) if prev else []
        if work:
            self.scheduler.after_step(work)
        self._inflight = None
        if launched is not None:
            for row, seq in enumerate(launched.sampled):
                if seq.status is SeqStatus.RUNNING:
                    seq.num_inflight, seq.inflight_row = 1, row
            self._inflight = launched
        return events

    @staticmethod
    def _catch_up(step: _InFlight) -> None:
        """The in-flight step's tokens given to its running sequences' grammars ahead of their
        postprocessing (the runner calls this, once the next step's forward is launched, before
        it fills a grammar's masks)."""
        rows = [(r, s) for r, s in enumerate(step.sampled) if s.constraint is not None]
        if not rows:
            return
        if step.ready is not None:
            step.ready.synchronize()
        ids = step.host_out.token_ids.tolist()
        for row, seq in rows:
            if seq.status is SeqStatus.RUNNING:
                seq.constraint.take_ahead(ids[row])

    def _resolve(self, step: _InFlight) -> list[TokenEvent]:
        """Wait for a launched step's ids and postprocess the sequences still running."""
        if step.ready is not None:
            step.ready.synchronize()
        now = time.perf_counter()
        if self.chunk_budget is not None and self._resolved_at:
            # steps overlap: the time between two arrivals is one step's device time
            self.chunk_budget.observe(*step.shape, now - self._resolved_at)
        self._resolved_at = now
        for seq in step.sampled:
            seq.num_inflight, seq.inflight_row = 0, -1
        return self._postprocess(step.sampled, step.host_out)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.on_finish is not None:
            self.on_finish(seq, reason)
        self.scheduler.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _postprocess(self, sampled: list[Sequence], out: SampleOutput | _HostOut | None):
        """The step's tokens as events: a sequence's row, or its verified rows up to the first
        that is not its draft (that row's token the model's own)."""
        host = out if isinstance(out, _HostOut) else _HostOut.of(out)
        if host is None:
            return []
        events: list[TokenEvent] = []
        row = 0
        for seq in sampled:
            first, row = row, row + seq.num_verifying + 1
            if seq.status is not SeqStatus.RUNNING:
                continue  # stopped or aborted while this (overlapped) step ran
            for i in range(first, row):
                if self._emit(seq, host, i, events) or not host.accepted[i]:
                    break
        return events

    def _emit(self, seq: Sequence, host: _HostOut, i: int, events: list[TokenEvent]) -> bool:
        """Row i's token appended to seq as an event; True when that finished it."""
        token = host.token_ids[i]
        seq.output_ids.append(token)
        reason = None
        if token in seq.stop_ids:
            reason = "stop"
        elif seq.constraint is not None and seq.constraint.advance(token):
            reason = "stop"  # the grammar's output is complete: nothing but EOS may follow
        elif len(seq.output_ids) >= seq.max_tokens:
            reason = "length"
        top = None
        if host.top_ids is not None and seq.params.logprobs is not None:
            k = seq.params.logprobs
            top = list(zip(host.top_ids[i][:k], host.top_lps[i][:k], strict=True))
        logprob = host.logprobs[i] if host.logprobs is not None else 0.0  # read only if asked
        cached = seq.num_cached_tokens if len(seq.output_ids) == 1 else 0
        events.append(TokenEvent(seq.seq_id, token, logprob, top, reason, cached))
        if reason is not None:
            self.scheduler.running.remove(seq)
            self._finish(seq, reason)
        return reason is not None


@dataclass
class _HostOut:
    """A step's sampled rows as host lists (one host sync)."""

    token_ids: list[int]
    accepted: list[bool]  # verification rows: whether the token is the row's draft
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_lps: list[list[float]] | None

    @staticmethod
    def of(out: SampleOutput | None) -> _HostOut | None:
        if out is None:
            return None
        ids = out.token_ids.tolist()  # the step's one host sync
        return _HostOut(
            ids,
            out.accepted.tolist() if out.accepted is not None else [False] * len(ids),
            out.logprobs.tolist() if out.logprobs is not None else None,
            out.top_ids.tolist() if out.top_ids is not None else None,
            out.top_logprobs.tolist() if out.top_logprobs is not None else None,
        )
