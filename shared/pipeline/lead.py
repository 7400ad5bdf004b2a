"""Stage 0 of a pipeline: the worker's own part of the model and the stage processes after it.

Stage 0 holds the embedding, the first layers, the final norm and the LM head; stages 1.. hold
the rest of the layers, each in a process of its own on its own device (shared.pipeline.stage).
A step's micro-batches go round the ring stage 0 -> 1 -> ... -> 0: stage 0 runs its layers for
micro-batch k+1 while the later stages run k, then takes each one's last hidden states back for
the final norm, the LM head and sampling (here, where the sequences' sampling state lives). A
row of hidden state is d_model values; a row of logits would be the vocabulary's.

`Pipeline` stands in for the model in the ModelRunner (`pipeline(batch, kv)` -> logits). A
stage that dies or fails raises `StageLost`: the worker fails its requests and exits, and its
supervisor (skiff serve) or the gateway's routing takes it from there.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from shared.engine.cuda_graphs import StepGraphs, capture_graphs
from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.causal_lm import CausalLM
from shared.pipeline.frames import read_step, send_step, stage_batch
from shared.pipeline.span_step import SpanStep
from shared.protocol import (
    StageAssign,
    StageFailed,
    StageReady,
    StageStep,
    StageStop,
    StageToLead,
    StageToStage,
    decoder,
    encoder,
)

READY_TIMEOUT_S = 600.0  # loading a stage's layers (a big file from a slow disk)
REMOTE_STEP_TIMEOUT_S = 120.0  # a ring through another host: a step not back by then failed
POLL_MS = 100  # how often a waiting stage 0 looks at its stages' processes


def micro_batches(batch: ForwardBatch, most: int, device: torch.device) -> list[ForwardBatch]:
    """The batch's sequences in at most `most` contiguous groups of about equal tokens, each a
    batch of its own (rows renumbered); the logits rows keep their order across the groups."""
    ids, pos, slots, rows, tables, width, starts, seq_lens = batch.to_lists()
    n_seqs = len(seq_lens)
    k = min(most, n_seqs)
    if k <= 1:
        return [batch]
    cuts, total = [0], starts[-1]
    for g in range(1, k):  # the first sequence boundary at or past g/k of the tokens
        goal = total * g / k
        cut = next((i for i in range(cuts[-1] + 1, n_seqs) if starts[i] >= goal), n_seqs - 1)
        cuts.append(max(cut, cuts[-1] + 1))
    cuts.append(n_seqs)
    out = []
    for a, b in itertools.pairwise(cuts):
        if a >= b:
            continue
        t0, t1 = starts[a], starts[b]
        out.append(
            ForwardBatch.from_lists(
                ids[t0:t1],
                pos[t0:t1],
                slots[t0:t1],
                [r - t0 for r in rows if t0 <= r < t1],
                tables[a * width : b * width],
                width,
                [s - t0 for s in starts[a : b + 1]],
                seq_lens[a:b],
                device,
            )  # fmt: skip
        )
    return out


class StageLost(RuntimeError):
    """A stage process exited or failed: the pipeline cannot run another step."""

    fatal = True  # the worker stops after failing its requests


@dataclass(frozen=True)
class StageSpec:
    device: str
    first: int
    last: int  # exclusive
    memory_gib: float = 0.0  # a GPU stage's allocations capped there (0: the device's)

    def describe(self, i: int) -> str:
        return f"stage {i} ({self.device}, layers {self.first}-{self.last - 1})"

    @property
    def remote(self) -> bool:
        """A stage server on another host (shared.pipeline.stage_server), named by endpoint."""
        return self.device.startswith("tcp://")


@dataclass(frozen=True)
class StageOptions:
    """What every stage process loads with (the worker's own settings)."""

    model: str
    kv_blocks: int
    block_size: int = 16
    kv_dtype: str = "auto"
    cpu_weights: str = "native"
    dense_copies: str = "auto"
    threads: int = 0
    max_seqs: int = 256  # the worker's: the decode graphs' buckets
    max_model_len: int = 8192  # the worker's: the graphs' block tables
    cuda_graphs: str = "all"  # "off": every stage runs eagerly
    host: str = ""  # with remote stages: the address they reach this host at (default: its name's)

    def dtype(self, device: str) -> str:
        return "bfloat16" if device.startswith("cuda") else "float32"


class Pipeline:
    def __init__(
        self,
        model: CausalLM,
        kv: KVPool,
        stages: list[StageSpec],
        opts: StageOptions,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if not stages:
            raise ValueError("a pipeline has at least one stage after the first")
        self.model = model  # stage 0's part: embedding, layers [0, k), final norm, LM head
        self.kv = kv
        self.stages = stages
        self.opts = opts
        self.device, self.dtype = device, dtype  # stage 0's, and its activations'
        self.width = model.cfg.d_model
        self._step = 0
        self._dir = tempfile.mkdtemp(prefix=f"skiff-pipe-{os.getpid()}-")
        self._ctx = zmq.Context()
        self.remote = any(s.remote for s in stages)
        # one host: ipc sockets; with a stage elsewhere, TCP on the address it reaches us at
        host = (opts.host or socket.gethostbyname(socket.gethostname())) if self.remote else ""
        ep = [s.device if s.remote else self._endpoint(host, f"in{i}")
              for i, s in enumerate(stages, start=1)]  # fmt: skip
        self._back, self._ret = self._bound(host, "ret")
        self._lead, self._ctrl = self._bound(host, "ctrl")
        self._out = self._socket(zmq.PUSH, connect=ep[0])
        self._enc = encoder()
        self._dec = decoder(StageToStage)
        self._dec_lead = decoder(StageToLead)
        self._assigners: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen | None] = []  # None: a remote stage
        for i, spec in enumerate(stages, start=1):
            nxt = ep[i] if i < len(stages) else self._ret
            if spec.remote:
                self._assign(i, spec, nxt)
                self.procs.append(None)
            else:
                self.procs.append(self._spawn(i, spec, ep[i - 1], nxt))
        self.ready: list[StageReady] = []
        self.graphs: StepGraphs | None = None  # stage 0's decode steps (capture_front)
        self._span: SpanStep | None = None

    def capture_front(self, max_seqs: int, max_model_len: int) -> None:
        """CUDA graphs of stage 0's own part (embedding and layers) at the decode buckets, as
        every later stage captures its layers; the head runs eagerly after the ring."""
        self._span = SpanStep(self.model, max_seqs, True, self.dtype, self.device)

        def make(_tokens: int) -> StepGraphs:
            return StepGraphs(self._span, self.kv, max_seqs, max_model_len, 0)

        self.graphs = capture_graphs(make, 0)

    def _front(self, b: ForwardBatch, kv: KVPool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 0's layers over micro-batch b: (x, residual or None), replayed where a graph
        fits it. A replay's rows stay valid until the next (send_step copies them first)."""
        if self.graphs is not None and self.graphs.fits(b):
            return self._span.split(self.graphs.run(b))
        x, residual, _ = self.model.run_layers(self.model.embed_batch(b), None, b, kv)
        return x, residual

    def __getattr__(self, name: str):  # cfg, ops, ...: stage 0's model answers
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def _socket(self, kind: int, connect: str = "") -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if connect:
            s.connect(connect)
        return s

    def _endpoint(self, host: str, name: str) -> str:
        """A local stage's inbox: an ipc path, or with remote stages a free TCP port here."""
        if not host:
            return f"ipc://{self._dir}/{name}"
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def _bound(self, host: str, name: str) -> tuple[zmq.Socket, str]:
        """A PULL socket bound here and the endpoint the stages reach it at."""
        sock = self._socket(zmq.PULL)
        if not host:
            endpoint = f"ipc://{self._dir}/{name}"
            sock.bind(endpoint)
            return sock, endpoint
        port = sock.bind_to_random_port(f"tcp://{host}")
        return sock, f"tcp://{host}:{port}"

    def _assign(self, i: int, spec: StageSpec, send: str) -> None:
        """A remote stage's part, sent to its server (which answers on the control socket)."""
        o = self.opts
        sock = self._out if i == 1 else self._socket(zmq.PUSH, connect=spec.device)
        if sock is not self._out:
            self._assigners.append(sock)
        msg = StageAssign(
            i, o.model, os.path.getsize(o.model), [spec.first, spec.last], o.kv_blocks,
            o.block_size, o.kv_dtype, send, self._ctrl, o.max_seqs, o.max_model_len,
            o.cuda_graphs, o.dense_copies, o.cpu_weights,
        )  # fmt: skip
        sock.send(self._enc.encode(msg))

    def _spawn(self, i: int, spec: StageSpec, recv: str, send: str) -> subprocess.Popen:
        o = self.opts
        argv = [
            sys.executable, "-m", "shared.pipeline.stage", "--model", o.model,
            "--device", spec.device, "--stage", str(i), "--layers", f"{spec.first}:{spec.last}",
            "--dtype", o.dtype(spec.device), "--kv-dtype", o.kv_dtype,
            "--block-size", str(o.block_size), "--kv-blocks", str(o.kv_blocks),
            "--cpu-weights", o.cpu_weights, "--dense-copies", o.dense_copies,
            "--threads", str(o.threads), "--recv", recv, "--send", send, "--lead", self._ctrl,
            "--parent", str(os.getpid()), "--memory-gib", str(spec.memory_gib),
            "--max-seqs", str(o.max_seqs), "--max-model-len", str(o.max_model_len),
            "--cuda-graphs", "off" if o.cuda_graphs == "off" else "all",
        ]  # fmt: skip
        return subprocess.Popen(argv)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> list[StageReady]:
        """Every stage's StageReady, in stage order; StageLost when one fails or exits."""
        deadline = time.monotonic() + timeout
        got: dict[int, StageReady] = {}
        while len(got) < len(self.stages):
            if time.monotonic() > deadline:
                raise StageLost(f"pipeline stages not ready after {timeout:.0f} s")
            if self._lead.poll(POLL_MS):
                msg = self._dec_lead.decode(self._lead.recv())
                if isinstance(msg, StageFailed):
                    self._lost(msg)
                got[msg.stage] = msg
            else:
                self._check()
        self.ready = [got[i] for i in sorted(got)]
        return self.ready

    def _lost(self, failed: StageFailed) -> None:
        spec = self.stages[failed.stage - 1]
        raise StageLost(f"pipeline {spec.describe(failed.stage)} failed: {failed.error}")

    def _check(self) -> None:
        """StageLost when a stage process has exited or reported a failure."""
        if self._lead.poll(0):
            msg = self._dec_lead.decode(self._lead.recv())
            if isinstance(msg, StageFailed):
                self._lost(msg)
        for i, (p, spec) in enumerate(zip(self.procs, self.stages, strict=True), start=1):
            if p is not None and p.poll() is not None:
                raise StageLost(f"pipeline {spec.describe(i)} exited with code {p.returncode}")

    def _receive(self) -> tuple[StageStep, list[bytes]]:
        deadline = time.monotonic() + REMOTE_STEP_TIMEOUT_S
        while not self._back.poll(POLL_MS):
            self._check()
            if self.remote and time.monotonic() > deadline:  # no process here to watch
                raise StageLost(
                    f"pipeline: no step back within {REMOTE_STEP_TIMEOUT_S:.0f} s (a remote "
                    "stage may be gone)"
                )
        frames = self._back.recv_multipart()
        msg = self._dec.decode(frames[0])
        if not isinstance(msg, StageStep):
            raise StageLost("pipeline: a stage stopped while a step was running")
        return msg, frames

    @torch.inference_mode()
    def __call__(
        self, batch: ForwardBatch, kv: KVPool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step's logits, its sequences cut into as many micro-batches as there are
        stages (fewer when fewer sequences), so that the stages overlap."""
        parts = micro_batches(batch, 1 + len(self.stages), self.device)
        if len(parts) == 1:
            return self.forward_many([batch], kv, [out])[0]
        logits = torch.cat(self.forward_many(parts, kv, [None] * len(parts)))
        if out is None:
            return logits
        return out.copy_(logits)

    @torch.inference_mode()
    def forward_many(
        self, batches: list[ForwardBatch], kv: KVPool, outs: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Each micro-batch's logits: stage 0 runs its layers for every micro-batch in turn,
        handing each on as soon as it is done (the later stages start on it while stage 0 runs
        the next), then takes them back in order for the head."""
        model, first = self.model, self._step
        for b in batches:
            x, residual = self._front(b, kv)
            send_step(self._out, self._enc, self._step, stage_batch(b), x, residual)
            self._step += 1
        logits = []
        for k, (b, out) in enumerate(zip(batches, outs, strict=True)):
            msg, frames = self._receive()
            if msg.step != first + k:
                raise StageLost(f"pipeline: step {msg.step} came back, {first + k} expected")
            x, residual = read_step(frames, msg, self.device, self.dtype, self.width)
            if b.logits_rows.numel() == 0:  # prompt chunks that sample nothing yet
                logits.append(torch.empty(0, self.cfg.vocab_size, device=self.device))
                continue
            logits.append(model.logits(x, residual, None, b, out))
        return logits

    def close(self) -> None:
        """Stops the stages (StageStop round the ring; any left after 5 s are killed)."""
        with contextlib.suppress(zmq.ZMQError):
            self._out.send(self._enc.encode(StageStop()), zmq.NOBLOCK)
        if self.remote:  # the stop goes round the ring through the remote stages
            with contextlib.suppress(zmq.ZMQError):
                self._back.poll(2000)
        deadline = time.monotonic() + 5
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._ctx.destroy(linger=0)
        for f in Path(self._dir).glob("*"):
            f.unlink(missing_ok=True)
        os.rmdir(self._dir)
