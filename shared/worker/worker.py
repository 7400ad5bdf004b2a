"""The worker's main loop: requests in, one engine step at a time, one token message per step out.

The loop never waits on the network: requests arrive through the control thread's queue, and
the step's tokens leave on a PUSH socket this thread owns.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import sys
import threading
import time
import traceback
import uuid

import msgspec
import torch
import zmq

from shared.engine import Sequence, TokenEvent
from shared.engine.draft_length import DraftLength
from shared.engine.factory import EngineConfig, LoadedEngine, build_engine
from shared.kv.block_io import tier_key
from shared.kv.tier_client import TierClient
from shared.ops.paged_attention import ROW_WISE_QUERIES
from shared.protocol import (
    Abort,
    Generate,
    Heartbeat,
    Rejected,
    StepTokens,
    TokenOut,
    WorkerReady,
    encoder,
)
from shared.sampling import SamplingParams
from shared.worker.config import WorkerConfig, cpu_threads
from shared.worker.constraints import Constraints
from shared.worker.control import ControlChannel
from shared.worker.kv_tiers import KVTiers
from shared.worker.roles import HandOffFactory, HandOffRole, resumed_generator
from shared.worker.spec_client import SpecClient
from shared.worker.stalls import StallLog

IDLE_WAIT_S = 0.05
ATTACH_WAIT_S = 3.0  # at start, for the kvcache's first answer
TIER_WAIT_S = 0.001  # while a prompt waits for the kvcache's answer


def log(worker_id: str, msg: str) -> None:
    print(f"worker {worker_id}: {msg}", file=sys.stderr, flush=True)


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores)"


class WorkerLoop:
    def __init__(
        self,
        worker_id: str,
        loaded: LoadedEngine,
        control: ControlChannel,
        tokens: zmq.Socket,
        device: str,
        tiers: KVTiers | None = None,
        spec: SpecClient | None = None,
        spec_max_tokens: int = 8,
        spec_max_batch: int = 16,
        handoff: HandOffRole | None = None,
        constraints: Constraints | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.constraints = constraints  # structured output's grammars
        self.handoff = handoff  # a prefill worker's prompts handed on to decode workers
        self.tiers = tiers  # the kvcache service's RAM and disk tiers, if any
        self.spec = spec  # the spec service's proposals, if any
        self.spec_max_tokens = spec_max_tokens
        self.spec_max_batch = spec_max_batch  # more running sequences: no speculation
        self._step_s = 0.0  # the last step's time
        self._spec_counts: dict[str, int] = {}  # engine.spec_stats as of the last step (for
        # the heartbeat, which the control thread builds)
        self._grammar_counts: dict[str, int] = {}  # engine.runner.grammar_stats, likewise
        self.engine = loaded.engine
        self.control = control
        self.tokens = tokens
        self.device = device
        self.stopped = threading.Event()
        self.broken = ""  # why the worker stopped by itself (a lost pipeline stage)
        self._enc = encoder()
        self._ids = itertools.count()
        self._seq_of: dict[str, int] = {}
        self._request_of: dict[int, str] = {}
        self.stalls = StallLog(lambda msg: log(worker_id, msg))

    def heartbeat(self) -> Heartbeat:
        alloc = self.engine.blocks
        return Heartbeat(
            self.worker_id,
            alloc.num_blocks - alloc.num_free,
            alloc.num_free,
            len(self.engine.running),
            len(self.engine.waiting),
            self.tiers.counts() if self.tiers is not None else {},
            self._spec_counts,
            self._grammar_counts,
            self.tiers.histograms() if self.tiers is not None else {},
        )

    def run(self) -> None:
        while not self.stopped.is_set():
            busy = self.engine.has_work()
            self._drain(0.0 if busy else TIER_WAIT_S if self._restoring() else IDLE_WAIT_S)
            if self.tiers is not None:
                for seq in self.tiers.poll():
                    self.engine.add(seq)
            if self.handoff is not None:
                self.handoff.poll()
            if self.engine.has_work():
                if self.spec is not None:
                    self._take_drafts()
                self._step()

    def _restoring(self) -> bool:
        """Waiting on the kvcache: a lookup's answer, or the indexing of handed-on blocks."""
        return (self.tiers is not None and self.tiers.waiting) or (
            self.handoff is not None and self.handoff.waiting
        )

    def _drain(self, wait: float) -> None:
        try:
            msg = self.control.inbox.get(timeout=wait) if wait else self.control.inbox.get_nowait()
        except queue.Empty:
            return
        start, n = time.perf_counter(), 0
        while True:
            n += 1
            if isinstance(msg, Generate):
                self._admit(msg)
            elif isinstance(msg, Abort):
                self._abort(msg.request_id)
            try:
                msg = self.control.inbox.get_nowait()
            except queue.Empty:
                self.stalls.admit(time.perf_counter() - start, n)
                return

    def _admit(self, req: Generate) -> None:
        s = req.sampling
        try:
            # the wire struct and the runtime params have the same fields, and the grammar
            fields = msgspec.structs.asdict(s)
            grammar = fields.pop("grammar")
            params = SamplingParams(**fields).validate()
            if req.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
            seq_id = next(self._ids)
            if len(req.output_ids) >= req.max_tokens:
                raise ValueError(
                    f"{len(req.output_ids)} tokens given of max_tokens {req.max_tokens}"
                )
            seq = Sequence(
                seq_id,
                list(req.prompt_ids),
                params,
                req.max_tokens,
                frozenset(req.stop_ids),
                resumed_generator(req, self.device),
                output_ids=list(req.output_ids),
                domain=req.domain,
                spec=DraftLength(self.spec_max_tokens) if self.spec is not None else None,
            )
            if grammar:  # constrained: no drafts (a mask follows every token the step before)
                if self.constraints is None:
                    raise ValueError("this worker does not serve structured output")
                seq.constraint = self.constraints.compile(grammar, seq.output_ids)
                seq.spec = None
            if self.handoff is not None:
                self.handoff.admit(req, seq)
            self.engine.check(seq)
            if self.tiers is None or not self.tiers.admit(seq):
                self.engine.add(seq)
            if self.spec is not None:
                self.spec.introduce(seq)
        except ValueError as exc:
            self.control.send(Rejected(req.request_id, 400, str(exc)))
            return
        self._seq_of[req.request_id] = seq_id
        self._request_of[seq_id] = req.request_id

    def _abort(self, request_id: str) -> None:
        seq_id = self._seq_of.pop(request_id, None)
        if self.handoff is not None:
            self.handoff.forget(-1 if seq_id is None else seq_id, request_id)
        if seq_id is not None:
            self._request_of.pop(seq_id, None)
            if self.tiers is None or not self.tiers.abort(seq_id):
                self.engine.abort(seq_id)
            if self.spec is not None:
                self.spec.end([seq_id])

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as exc:  # a failed step fails its requests, never the worker
            traceback.print_exc()
            self._fail_all(f"the worker's engine step failed: {exc}")
            if getattr(exc, "fatal", False):  # nothing more can run here (a stage is gone)
                self.broken = str(exc)
                self.stopped.set()
            return
        self._step_s = time.perf_counter() - start
        if self.engine.runner.grammar_stats:
            self._grammar_counts = dict(self.engine.runner.grammar_stats)
        self.stalls.step(self._step_s, self._step_summary)
        if events:
            out = [self._token_out(ev) for ev in events if ev.seq_id in self._request_of]
            self.tokens.send(self._enc.encode(StepTokens(self.worker_id, out)))
            if self.spec is not None:
                self._ask_drafts(events)

    def _ask_drafts(self, events: list[TokenEvent]) -> None:
        """Proposals for the sequences this step moved on (while the gateway gets their
        tokens); the ended ones are forgotten."""
        self.spec.end([ev.seq_id for ev in events if ev.finish_reason is not None])
        self._spec_counts = dict(self.engine.spec_stats)
        running = self.engine.running
        self.engine.speculate = len(running) <= self.spec_max_batch
        if self.engine.speculate:
            moved = {ev.seq_id for ev in events}
            self.spec.ask([s for s in running if s.seq_id in moved and s.num_pending == 1])

    def _take_drafts(self) -> None:
        if self.engine.speculate:
            self.spec.collect({s.seq_id: s for s in self.engine.running}, self._step_s)

    def _step_summary(self) -> str:
        e = self.engine
        return f"{e.runner.last_runs}; {len(e.running)} running, {len(e.waiting)} waiting"

    def _token_out(self, ev: TokenEvent) -> TokenOut:
        rid = self._request_of[ev.seq_id]
        finish = ev.finish_reason
        if finish is not None:
            self._request_of.pop(ev.seq_id)
            self._seq_of.pop(rid, None)
            if self.handoff is not None and self.handoff.hands_on(ev.seq_id, finish):
                finish = None  # the request goes on on a decode worker
        top_ids = top_lps = None
        if ev.top is not None:
            top_ids = [t for t, _ in ev.top]
            top_lps = [lp for _, lp in ev.top]
        return TokenOut(rid, ev.token_id, ev.logprob, top_ids, top_lps, finish, ev.cached_tokens)

    def _fail_all(self, message: str) -> None:
        for seq_id, rid in list(self._request_of.items()):
            self.engine.abort(seq_id)
            self.control.send(Rejected(rid, 500, message))
        self._request_of.clear()
        self._seq_of.clear()


def _tiers(ctx: zmq.Context, cfg: WorkerConfig, wid: str, loaded: LoadedEngine) -> KVTiers | None:
    """The kvcache service's tiers for this worker's pool, when an endpoint is given and the
    pool's blocks can leave it (prefix caching on; no FP8 per-head scales)."""
    if not cfg.kvcache:
        return None
    if loaded.pipeline is not None:
        log(wid, "KV tiers off: a pipelined worker's blocks span its stages' pools (not yet)")
        return None
    engine = loaded.engine
    kv = engine.runner.kv
    key = tier_key(kv, engine.blocks.extra_key)
    if key is None or not engine.blocks.prefix_caching:
        log(wid, "KV tiers off: this pool's blocks cannot leave it (FP8 per-head scales)")
        return None
    client = TierClient(ctx, cfg.kvcache, wid, kv, key, lambda msg: log(wid, msg))
    if client.wait_attached(ATTACH_WAIT_S):
        log(wid, f"KV tiers: kvcache at {cfg.kvcache}")
    else:
        log(wid, f"KV tiers: no answer from {cfg.kvcache} yet; serving from the pool until one")
    return KVTiers(engine, client)


def run_worker(cfg: WorkerConfig, handoff: HandOffFactory | None = None) -> int:
    wid = cfg.resolved_id()
    if cfg.device == "cpu":
        torch.set_num_threads(cpu_threads(cfg.threads))
    log(wid, f"loading {cfg.model} on {cfg.device} ({cfg.dtype})")
    loaded = build_engine(
        EngineConfig(
            model_path=cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            kv_dtype=cfg.kv_dtype,
            kv_scales=cfg.kv_scales,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            kv_blocks=cfg.kv_blocks,
            max_batch_tokens=cfg.max_batch_tokens,
            overlap=cfg.overlap,
            step_target_ms=cfg.step_target_ms,
            dense_copies=cfg.dense_copies,
            cuda_graphs=cfg.cuda_graphs,
            cpu_weights=cfg.cpu_weights,
            stages=cfg.stages,
            layer_split=cfg.layer_split,
            memory_gib=cfg.memory_gib,
            stage_host=cfg.stage_host,
        )
    )
    engine = loaded.engine
    ready = WorkerReady(
        worker_id=wid,
        device=cfg.device,
        device_name=device_name(cfg.device),
        roles=list(cfg.roles),
        model=os.path.basename(cfg.model),
        kv_blocks_total=engine.blocks.num_blocks,
        block_size=cfg.block_size,
        max_model_len=engine.max_model_len,
        pid=os.getpid(),
        instance=uuid.uuid4().hex,
    )
    ctx = zmq.Context()
    tokens = ctx.socket(zmq.PUSH)
    tokens.setsockopt(zmq.LINGER, 0)
    tokens.connect(cfg.gateway_tokens)
    holder: list[WorkerLoop] = []
    control = ControlChannel(ctx, cfg.gateway, ready, lambda: holder[0].heartbeat())
    tiers = _tiers(ctx, cfg, wid, loaded)
    spec = None
    if cfg.spec:
        if not 1 <= cfg.spec_max_tokens < ROW_WISE_QUERIES:  # longer: rows no longer exact
            raise SystemExit(
                f"--spec-max-tokens must be 1..{ROW_WISE_QUERIES - 1}, got {cfg.spec_max_tokens}"
            )
        spec = SpecClient(ctx, cfg.spec, wid, lambda msg: log(wid, msg), cfg.spec_wait_ms / 1e3)
        log(wid, f"speculation: drafts of up to {cfg.spec_max_tokens} tokens from {cfg.spec}")
    role = None
    if handoff is not None:
        role = handoff(engine, tiers.client if tiers is not None else None, control.send)
        if tiers is None:
            log(wid, "prefill role without the kvcache: decode workers recompute the prompts")
    loop = WorkerLoop(
        wid, loaded, control, tokens, cfg.device, tiers, spec, cfg.spec_max_tokens,
        cfg.spec_max_batch, role, Constraints(loaded.tokenizer, engine.runner.model.cfg.vocab_size),
    )  # fmt: skip
    holder.append(loop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: loop.stopped.set())
    control.start()
    log(
        wid,
        f"ready: {ready.kv_blocks_total} KV blocks of {cfg.block_size} tokens, "
        f"context {ready.max_model_len}, gateway {cfg.gateway}",
    )
    try:
        loop.run()
    finally:
        loaded.close()
        loop.stalls.close()
        if tiers is not None:
            tiers.client.close()
        if spec is not None:
            spec.close()
        control.stop()
        tokens.close(linger=0)
        ctx.term()
    if loop.broken:
        log(wid, f"stopped: {loop.broken}")
        return 1
    log(wid, "stopped")
    return 0
