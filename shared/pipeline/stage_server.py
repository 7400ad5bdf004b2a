"""A pipeline stage on another host: `python -m shared.pipeline.stage_server --serve
tcp://0.0.0.0:5601 --device cuda:0 [--model PATH]`, started by hand (or by that host's own
supervisor) before the worker whose `--stages` names `tcp://HOST:5601`.

It binds its endpoint and waits. Stage 0 sends a `StageAssign` there: the layers it holds, the
KV blocks, and where its ring goes (the next stage's endpoint, stage 0's control endpoint);
the server loads that part (its own copy of the model file, which must have the same size as
stage 0's) and says `StageReady` or `StageFailed` to stage 0. Then the ring's steps arrive on
the same socket as raw frames (shared.pipeline.frames), as they do between processes of one
host. On `StageStop` it passes the stop on, drops the part and waits for the next assignment;
an assignment that comes while it holds a part (a restarted worker) replaces it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback

import torch
import zmq

from shared.pipeline.build import cap_memory
from shared.pipeline.stage import Stage
from shared.protocol import (
    StageAssign,
    StageFailed,
    StageReady,
    StageStop,
    StageToStage,
    decoder,
    encoder,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shared.pipeline.stage_server", description=__doc__)
    p.add_argument("--serve", required=True, help="endpoint to bind, e.g. tcp://0.0.0.0:5601")
    p.add_argument("--device", default="cpu", help="this host's device for the stage")
    p.add_argument("--model", default="", help="this host's copy of the model (default: the "
                   "path stage 0 names)")  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    p.add_argument("--memory-gib", type=float, default=0.0, help="a GPU stage's memory cap")
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(f"stage server: {msg}", file=sys.stderr, flush=True)


def _stage_args(a: argparse.Namespace, m: StageAssign) -> argparse.Namespace:
    """What `Stage` loads with: the assignment, on this server's device and model copy."""
    model = a.model or m.model
    if not os.path.isfile(model):
        raise FileNotFoundError(f"no model file {model} on this host (pass --model)")
    size = os.path.getsize(model)
    if size != m.model_bytes:
        raise ValueError(f"{model} here has {size} bytes, stage 0's file {m.model_bytes}")
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    return argparse.Namespace(
        model=model, device=a.device, layers=f"{m.layers[0]}:{m.layers[1]}", dtype=dtype,
        kv_dtype=m.kv_dtype, block_size=m.block_size, kv_blocks=m.kv_blocks,
        cpu_weights=m.cpu_weights, dense_copies=m.dense_copies, max_seqs=m.max_seqs,
        max_model_len=m.max_model_len, cuda_graphs=m.cuda_graphs,
    )  # fmt: skip


class _Ring:
    """The part held now and its sockets to the next stage and to stage 0."""

    def __init__(self, ctx: zmq.Context, a: argparse.Namespace, m: StageAssign) -> None:
        self.assign = m
        self.lead = ctx.socket(zmq.PUSH)
        self.lead.setsockopt(zmq.LINGER, 2000)
        self.lead.connect(m.lead)
        self.out = None
        self.stage: Stage | None = None
        self._ctx, self._a = ctx, a

    def load(self, enc) -> None:
        self.stage = Stage(_stage_args(self._a, self.assign))
        self.out = self._ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(self.assign.send)
        st, m = self.stage, self.assign
        kind = torch.cuda.get_device_name(st.device) if st.device.type == "cuda" else "CPU"
        ready = StageReady(m.stage, self._a.device, kind, st.layers, m.kv_blocks,
                           f"{st.model.ops.name} ops, on {self._a.serve}")  # fmt: skip
        self.lead.send(enc.encode(ready))

    def fail(self, enc, exc: Exception) -> None:
        traceback.print_exc()
        self.lead.send(enc.encode(StageFailed(self.assign.stage, f"{type(exc).__name__}: {exc}")))

    def close(self) -> None:
        for s in (self.out, self.lead):
            if s is not None:
                s.close()
        self.stage = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def serve(a: argparse.Namespace) -> int:
    if a.device == "cpu" and a.threads > 0:
        torch.set_num_threads(a.threads)
    cap_memory(a.device, a.memory_gib)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    enc, dec = encoder(), decoder(StageToStage)
    ring: _Ring | None = None
    try:
        try:
            inbox.bind(a.serve)
        except zmq.ZMQError as exc:
            _log(f"cannot bind {a.serve} ({exc})")
            return 2
        _log(f"waiting at {a.serve} for a pipeline's stage 0 (device {a.device})")
        while True:
            frames = inbox.recv_multipart()
            msg = dec.decode(frames[0])
            if isinstance(msg, StageAssign):
                if ring is not None:
                    ring.close()
                _log(f"stage {msg.stage}: layers {msg.layers[0]}-{msg.layers[1] - 1}")
                ring = _Ring(ctx, a, msg)
                try:
                    ring.load(enc)
                except Exception as exc:  # noqa: BLE001 - told to stage 0, which stops
                    ring.fail(enc, exc)
                    ring.close()
                    ring = None
            elif isinstance(msg, StageStop):
                if ring is not None and ring.out is not None:
                    ring.out.send(enc.encode(StageStop()))
                if ring is not None:
                    ring.close()
                ring = None
                _log("stopped; waiting for the next assignment")
            elif ring is not None and ring.stage is not None:
                try:
                    ring.stage.run(frames, msg, ring.out, enc)
                except Exception as exc:  # noqa: BLE001 - told to stage 0
                    ring.fail(enc, exc)
                    ring.close()
                    ring = None
    finally:
        if ring is not None:
            ring.close()
        ctx.destroy(linger=2000)


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
