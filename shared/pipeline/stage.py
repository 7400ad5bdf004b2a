"""A pipeline stage after the first: `python -m shared.pipeline.stage`, started by stage 0.

It holds decoder layers [first, last) of the model on its own device, with a KV pool for those
layers only (as many blocks as stage 0's: stage 0's block manager names blocks for every
stage). It receives each micro-batch's activations from the stage before it, runs its layers
and sends the result to the next stage (the last stage: back to stage 0). It exits on a
`StageStop`, when stage 0 is gone, or after telling stage 0 why it failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import zmq

from shared.engine.cuda_graphs import GRAPH_MODES, StepGraphs, capture_graphs
from shared.kv import KVPool
from shared.kv.kv_dtype import resolve_kv_dtype
from shared.loader import GGUFFile
from shared.model import load_model
from shared.model.causal_lm import LayerSpan
from shared.pipeline.build import cap_memory
from shared.pipeline.frames import local_batch, read_step, send_step
from shared.pipeline.span_step import SpanStep
from shared.protocol import StageFailed, StageReady, StageStep, StageStop, StageToStage, decoder
from shared.protocol import encoder as make_encoder

PARENT_CHECK_MS = 1000  # how often an idle stage looks for stage 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="One pipeline stage of a Skiff worker")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--stage", type=int, required=True, help="its place: 1 .. stages - 1")
    p.add_argument("--layers", required=True, help="first:last (last exclusive)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, required=True)
    p.add_argument("--cpu-weights", default="native", choices=["native", "int4", "float"])
    p.add_argument("--dense-copies", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--recv", required=True, help="endpoint this stage binds (PULL)")
    p.add_argument("--send", required=True, help="the next stage's endpoint (PUSH)")
    p.add_argument("--lead", required=True, help="stage 0's control endpoint (PUSH)")
    p.add_argument("--parent", type=int, default=0, help="stage 0's pid: exit when it is gone")
    p.add_argument("--memory-gib", type=float, default=0.0, help="a GPU stage's memory cap")
    p.add_argument("--max-seqs", type=int, default=256, help="the worker's (graph buckets)")
    p.add_argument("--max-model-len", type=int, default=8192, help="the worker's (block tables)")
    p.add_argument("--cuda-graphs", default="all", choices=GRAPH_MODES, help="off: run eagerly")
    return p.parse_args(argv)


class Stage:
    def __init__(self, a: argparse.Namespace) -> None:
        first, last = (int(v) for v in a.layers.split(":"))
        self.device = torch.device(a.device)
        self.dtype = getattr(torch, a.dtype)
        cpu_weights = a.cpu_weights if self.device.type == "cpu" else "float"
        f = GGUFFile(a.model)
        self.model = load_model(
            f, self.device, self.dtype, dense_copies=a.dense_copies,
            cpu_weights=cpu_weights,
            span=LayerSpan(first, last, False),
        )  # fmt: skip
        mc = self.model.cfg
        kv_dtype = resolve_kv_dtype(a.kv_dtype, self.dtype, a.device)
        self.kv = KVPool(
            last - first, a.kv_blocks, a.block_size, mc.n_kv_heads, mc.head_dim, kv_dtype,
            self.device,
        )  # fmt: skip
        self.width = mc.d_model
        self.layers = [first, last]
        self.graphs = self.span = None
        on_cuda = self.device.type == "cuda" and self.model.ops.name == "triton"
        if a.cuda_graphs != "off" and on_cuda:
            # decode steps only: prompt chunks are large enough to run eagerly
            self.span = SpanStep(self.model, a.max_seqs, False, self.dtype, self.device)

            def make(_tokens: int) -> StepGraphs:
                return StepGraphs(self.span, self.kv, a.max_seqs, a.max_model_len, 0)

            self.graphs = capture_graphs(make, 0)

    @torch.inference_mode()
    def run(self, frames: list[bytes], msg: StageStep, out: zmq.Socket, enc) -> None:
        batch = local_batch(msg.batch, self.device)
        x, residual = read_step(frames, msg, self.device, self.dtype, self.width)
        if self.graphs is not None and self.graphs.fits(batch):
            self.span.load(x, residual)
            x, residual = self.span.split(self.graphs.run(batch))
        else:
            x, residual, _ = self.model.run_layers(x, residual, batch, self.kv)
        send_step(out, enc, msg.step, msg.batch, x, residual)


def _parent_gone(parent: int) -> bool:
    return parent > 0 and os.getppid() != parent


def serve(a: argparse.Namespace) -> int:
    ctx = zmq.Context()
    lead = ctx.socket(zmq.PUSH)
    lead.setsockopt(zmq.LINGER, 2000)
    lead.connect(a.lead)
    enc = make_encoder()
    try:
        if a.device == "cpu" and a.threads > 0:
            torch.set_num_threads(a.threads)
        cap_memory(a.device, a.memory_gib)
        stage = Stage(a)
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(a.recv)
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)
        out.connect(a.send)
        kind = torch.cuda.get_device_name(stage.device) if stage.device.type == "cuda" else "CPU"
        ops = f"{stage.model.ops.name} ops"
        lead.send(enc.encode(StageReady(a.stage, a.device, kind, stage.layers, a.kv_blocks, ops)))
        dec = decoder(StageToStage)
        while True:
            if not inbox.poll(PARENT_CHECK_MS):
                if _parent_gone(a.parent):
                    return 0
                continue
            frames = inbox.recv_multipart()
            msg = dec.decode(frames[0])
            if isinstance(msg, StageStop):
                out.send(enc.encode(StageStop()))
                return 0
            stage.run(frames, msg, out, enc)
    except Exception as exc:  # noqa: BLE001 - told to stage 0, which fails its requests
        traceback.print_exc()
        lead.send(enc.encode(StageFailed(a.stage, f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        ctx.destroy(linger=2000)


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
