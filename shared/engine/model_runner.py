"""Runs one scheduled step on the device: builds the flat batch, runs the model, samples."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

import llguidance
import torch

from shared.engine.cuda_graphs import StepGraphs
from shared.engine.sequence import Sequence
from shared.grammar import Constraint, apply_masks, fill_masks
from shared.kv import KVPool
from shared.model import ForwardBatch, SeqChunk
from shared.model.causal_lm import CausalLM
from shared.sampling import SampleOutput, Sampler
from shared.sampling.verify import verify
from shared.staging import PinnedRing


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVPool,
        device: torch.device | str,
        graphs: StepGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.graphs = graphs  # steps replay CUDA graphs when given and one fits
        self._inputs = PinnedRing()  # the steps' inputs, with graphs on a CUDA device
        # the last two steps (tokens, sequences, graph key or None), for stall logs
        self._runs: deque[tuple[int, int, tuple[str, int] | None]] = deque(maxlen=2)
        self._grammar_threads: llguidance.LLExecutor | None = None  # fills the token masks
        # structured output since start: steps with masks ("steps"), masked rows ("rows"), and
        # host microseconds waiting for the tokens in flight ("catch_up_us"), filling the masks
        # ("fill_us") and applying them ("apply_us", the launches' host time)
        self.grammar_stats: Counter[str] = Counter()

    def run(
        self,
        work: list[tuple[Sequence, int]],
        prev: SampleOutput | None = None,
        host_ids: torch.Tensor | None = None,
        catch_up: Callable[[], None] | None = None,
    ) -> tuple[list[Sequence], SampleOutput | None]:
        """`work` lists (sequence, tokens to compute now). Sequences whose pending tokens all
        run in this step get a sampled token; the returned list names them in row order.

        `prev` is the output of the step still in flight (overlapped steps): a sequence whose
        last token it sampled (``num_inflight``) gets that token's id copied on the device from
        row ``inflight_row`` of ``prev.token_ids``; nothing waits for the host. host_ids:
        pinned int64 of at least len(work) entries, which a greedy step's argmax stores its
        picks into (``SampleOutput.host_ids``). catch_up: called once the forward is launched,
        before a grammar's masks are filled (it gives the grammars the tokens still in flight).
        """
        chunks, sampled = [], []
        for seq, n in work:
            start, d = seq.num_computed, seq.num_verifying  # d: draft tokens after its own
            finishes = start + n - d == seq.num_tokens
            ids = seq.token_slice(start, start + n - d)
            chunks.append(
                SeqChunk(
                    ids + seq.draft[:d] if d else ids,
                    start,
                    seq.block_table,
                    "all" if d else "last" if finishes else "none",
                )
            )
            if finishes:
                sampled.append(seq)
        # each token's row in prev (-1: its own id; tokens in flight have one): copied with the
        # batch (one host->device copy a step), filled in on the device
        in_flight, end = False, 0
        from_prev: list[int] = []
        for seq, n in work:
            end += n
            from_prev.extend([-1] * n)
            if seq.num_inflight:
                from_prev[end - 1], in_flight = seq.inflight_row, True
        ring = self._inputs if self._reads_pinned() else None
        batch = ForwardBatch.build(
            chunks, self.kv.block_size, self.device, from_prev if in_flight else (),
            pinned=ring.take if ring is not None else None,
        )  # fmt: skip
        staged = self.graphs is not None and self.graphs.fits(batch)  # run() stages its inputs
        if ring is not None and not staged:
            batch = batch.on_device(self.device)  # an eager step's kernels read the device
        on_device = None  # (per-token rows, prev's tokens): filled in by the graph's staging
        if in_flight:
            if prev is None:
                raise ValueError("a sequence has a token in flight but no previous output given")
            if staged:
                on_device = (batch.extra, prev.token_ids)
            else:
                ids, rows = batch.token_ids, batch.extra
                taken = prev.token_ids.index_select(0, rows.clamp(min=0))
                ids.copy_(torch.where(rows >= 0, taken, ids))
        logits = self.graphs.run(batch, on_device) if self.graphs is not None else None
        if ring is not None:
            ring.read()  # its reader (the staging kernel, or the copy) is queued
        key = self.graphs.last_key if logits is not None else None
        if logits is None:  # no graph fits this step
            logits = self.model(batch, self.kv)
        self._runs.append((batch.token_ids.shape[0], len(work), key))
        if not sampled:
            return sampled, None
        if any(s.num_verifying for s in sampled):
            return sampled, self._verify(logits, sampled)
        constraints = [s.constraint for s in sampled]
        if catch_up is not None and any(c is not None for c in constraints):
            start = time.perf_counter()
            catch_up()
            self.grammar_stats["catch_up_us"] += _us(start)
        logits = self._masked(logits, constraints)
        out = self.sampler.sample(
            logits,
            [s.params for s in sampled],
            [s.prompt_ids for s in sampled],
            [s.output_ids for s in sampled],
            [s.generator for s in sampled],
            host_ids[: len(sampled)] if host_ids is not None else None,
        )
        return sampled, out

    def _verify(self, logits: torch.Tensor, sampled: list[Sequence]) -> SampleOutput:
        """A step with drafts: a row per drafted position and one after (verify.py), each row
        seeing the drafts before it as output (penalties)."""
        params, prompts, outputs, gens, drafts = [], [], [], [], []
        for seq in sampled:
            d = seq.num_verifying
            for j in range(d + 1):
                params.append(seq.params)
                prompts.append(seq.prompt_ids)
                outputs.append(seq.output_ids + seq.draft[:j] if j else seq.output_ids)
                gens.append(seq.generator)
                drafts.append(seq.draft[j] if j < d else -1)
        # a constrained sequence has no drafts: its one row is masked
        rows = [c for s in sampled for c in [s.constraint] + [None] * s.num_verifying]
        logits = self._masked(logits, rows)
        return verify(self.sampler, logits, params, prompts, outputs, gens, drafts)

    def _masked(self, logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
        """The logits with each constrained row's disallowed tokens at -inf: the masks are
        computed on the host (llguidance's threads) while the device runs the step."""
        if all(c is None for c in constraints):
            return logits
        if self._grammar_threads is None:
            self._grammar_threads = llguidance.LLExecutor()
        start = time.perf_counter()
        filled = fill_masks(constraints, logits.shape[1], self._grammar_threads, logits.is_cuda)
        if filled is None:
            return logits
        filled_at = time.perf_counter()
        logits = apply_masks(logits, *filled)
        stats = self.grammar_stats
        stats["steps"] += 1
        stats["rows"] += len(filled[0])
        stats["fill_us"] += _us(start, filled_at)
        stats["apply_us"] += _us(filled_at)
        return logits

    def _reads_pinned(self) -> bool:
        """Whether steps are built into pinned host memory (graphs on a CUDA device), which the
        graph's staging kernel reads in place (staging.PinnedRing): no host->device copy on the
        stream. H200, W1, against one copy to the device as an eager step's, two rounds
        (BENCHMARKS.md 2026-12-03 (at) call 2): Q4_K_M +0.6 / +0.4 %, Q6_K +0.4 / +0.3 %, Q8_0
        +0.2 / +0.3 %."""
        return self.graphs is not None and self.device.type == "cuda"

    @property
    def last_runs(self) -> str:
        """The last two steps launched: their tokens, sequences and how they ran."""
        return " | ".join(
            f"{n} tokens of {seqs} sequences, {f'{key[0]} graph of {key[1]}' if key else 'eager'}"
            for n, seqs, key in self._runs
        )


def _us(start: float, end: float | None = None) -> int:
    """Microseconds from start to end (to now without one)."""
    return round(((time.perf_counter() if end is None else end) - start) * 1e6)
