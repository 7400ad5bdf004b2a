"""WorkerConfig: one typed object built once from flags and environment, then passed in."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    device: str = "cpu"
    gateway: str = "tcp://127.0.0.1:5555"
    gateway_tokens: str = "tcp://127.0.0.1:5556"
    roles: tuple[str, ...] = ROLES
    dtype: str = "float32"
    kv_dtype: str = "auto"
    kv_scales: str = "token"  # an fp8 cache's scales: per (token, KV head), or per KV head
    block_size: int = 16
    kv_blocks: int = 0  # 0: sized from the device (see shared.engine.factory)
    max_model_len: int = 0  # 0: the model's context, capped
    max_batch_tokens: int = 512  # the H200's W2/W3 runs (BENCHMARKS.md 2026-11-30 (m)-(o))
    overlap: bool = True  # prepare step N+1 on the CPU while the device runs step N
    step_target_ms: float = 0.0  # steps with decodes: 0 auto (2x theirs), > 0 floor, < 0 off
    dense_copies: str = "auto"  # dense copies of packed weights for big batches (auto/on/off)
    cuda_graphs: str = "all"  # steps replayed from CUDA graphs: all, decode or off
    cpu_weights: str = "native"  # CPU: quantized linears as GGUF blocks, int4 planes or floats
    threads: int = 0  # CPU threads of torch's ops (0: the cores this process may run on)
    kvcache: str = ""  # the kvcache service's ROUTER (RAM and disk tiers); "": VRAM alone
    spec: str = ""  # the spec service's ROUTER (draft proposals); "": no speculation
    spec_max_tokens: int = 8  # the longest draft a step verifies
    spec_max_batch: int = 16  # more running sequences than this: no speculation
    spec_wait_ms: float = 0.0  # a step's wait for proposals (0: a tenth of a step, <= 2 ms)
    stages: tuple[str, ...] = ()  # pipeline stages after `device`: their devices
    layer_split: tuple[int, ...] = ()  # layers per stage, `device`'s first (empty: planned)
    memory_gib: tuple[float, ...] = ()  # with stages: each stage's memory cap, `device`'s first
    stage_host: str = ""  # with remote stages: the address they reach this host at
    worker_id: str = ""

    def resolved_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{self.device}-{os.getpid()}"


def cpu_threads(requested: int) -> int:
    """The threads a CPU worker runs torch's ops on: `requested`, else every core this process
    may run on (its affinity: a container's or taskset's share, not the machine's)."""
    if requested > 0:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def parse_worker_args(
    argv: list[str] | None, role_help: str, roles: tuple[str, ...] = ROLES
) -> WorkerConfig:
    env = os.environ.get
    p = argparse.ArgumentParser(description=role_help)
    p.add_argument("--model", default=env("SKIFF_MODEL"), help="GGUF file (env SKIFF_MODEL)")
    p.add_argument("--device", default=env("SKIFF_DEVICE", "cpu"), help="cpu or cuda:N")
    p.add_argument(
        "--gateway",
        default=env("SKIFF_GATEWAY", WorkerConfig.gateway),
        help="the gateway's control socket (env SKIFF_GATEWAY)",
    )
    p.add_argument(
        "--gateway-tokens",
        default=env("SKIFF_GATEWAY_TOKENS", WorkerConfig.gateway_tokens),
        help="the gateway's token socket (env SKIFF_GATEWAY_TOKENS)",
    )
    p.add_argument(
        "--dtype",
        default=env("SKIFF_DTYPE", "auto"),
        choices=["auto", "float32", "float16", "bfloat16"],
        help="activation dtype (auto: float32 on the CPU, bfloat16 on a GPU)",
    )
    p.add_argument(
        "--kv-dtype",
        default=env("SKIFF_KV_DTYPE", "auto"),
        choices=["auto", "float32", "float16", "bfloat16", "fp8"],
        help="KV cache dtype (auto: the activation dtype; fp8: e4m3 with per-token "
        "scales, on sm_89+ GPUs)",
    )
    p.add_argument(
        "--kv-scales",
        default=env("SKIFF_KV_SCALES", "token"),
        choices=["token", "head"],
        help="an fp8 KV cache's scales: token (one per token and KV head, written with it) or "
        "head (one per layer and KV head, calibrated at start: half of fp16's bytes exactly)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-blocks", type=int, default=0, help="KV blocks (0: size from memory)")
    p.add_argument("--max-model-len", type=int, default=0, help="context limit (0: the model's)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="token budget per step")
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and launch step N+1 before step N's tokens reach the host (default on; "
        "--no-overlap: one step at a time)",
    )
    p.add_argument(
        "--step-target-ms",
        type=float,
        default=0.0,
        help="steps that carry decodes take prompt chunks that keep them within twice the "
        "decodes' own step time and at least this many ms (0, the default: 20 ms; -1: no cap "
        "beyond --max-batch-tokens)",
    )
    p.add_argument(
        "--dense-copies",
        default=env("SKIFF_DENSE_COPIES", "auto"),
        choices=["auto", "on", "off"],
        help="keep a dense copy of each quantized weight for batches of more than 16 rows "
        "(auto: on a GPU with four times the copies' size free; env SKIFF_DENSE_COPIES)",
    )
    p.add_argument(
        "--cuda-graphs",
        default=env("SKIFF_CUDA_GRAPHS", "all"),
        choices=["all", "decode", "off"],
        help="steps replayed from CUDA graphs captured at startup: all (decode and mixed "
        "prefill/decode steps), decode (decode steps only) or off (env SKIFF_CUDA_GRAPHS)",
    )
    p.add_argument(
        "--cpu-weights",
        default=env("SKIFF_CPU_WEIGHTS", "native"),
        choices=["native", "int4", "float"],
        help="on the CPU, the quantized weights: native (the GGUF blocks, multiplied by a C "
        "library compiled at first use: Q4_0..Q8_0, Q4_K, Q5_K, Q6_K; int4 where it cannot "
        "build or for other types), int4 (4-bit planes for torch's int4 GEMM, Q4_0..Q8_0, "
        "Q4_K, Q5_K; other types bf16) or float (float32 copies of every weight) "
        "(env SKIFF_CPU_WEIGHTS)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(env("SKIFF_THREADS", "0")),
        help="CPU threads for torch's ops (0, the default: the cores this process may run on; "
        "env SKIFF_THREADS)",
    )
    p.add_argument(
        "--kvcache",
        default=env("SKIFF_KVCACHE", ""),
        help="the kvcache service's endpoint (RAM and disk tiers of KV blocks; env "
        "SKIFF_KVCACHE; default none: the KV pool alone)",
    )
    p.add_argument(
        "--spec",
        default=env("SKIFF_SPEC", ""),
        help="the spec service's endpoint (draft proposals, verified in the decode steps; env "
        "SKIFF_SPEC; default none: no speculation)",
    )
    p.add_argument(
        "--spec-max-tokens", type=int, default=8, help="the longest draft a step verifies"
    )
    p.add_argument(
        "--spec-wait-ms",
        type=float,
        default=0.0,
        help="the longest a step waits for the spec service's proposals (default 0: a tenth of "
        "the last step, at most 2 ms, for the n-gram proposers; a draft model needs its "
        "guesses' time)",
    )
    p.add_argument(
        "--spec-max-batch",
        type=int,
        default=16,
        help="no speculation while more sequences than this run (their steps are big enough)",
    )
    p.add_argument(
        "--stages",
        default=env("SKIFF_STAGES", ""),
        help="pipeline parallelism: the devices of the stages after --device's, comma-separated "
        "(e.g. cuda:1 or cpu); each runs in a process of its own with a range of layers; "
        "tcp://HOST:PORT names a stage server on another host (python -m "
        "shared.pipeline.stage_server; needs --layer-split) (env SKIFF_STAGES; default none: "
        "one device holds the model)",
    )
    p.add_argument(
        "--stage-host",
        default=env("SKIFF_STAGE_HOST", ""),
        help="with remote stages: the address they reach this host at (default: its name's)",
    )
    p.add_argument(
        "--layer-split",
        default=env("SKIFF_LAYER_SPLIT", ""),
        help="with --stages: the layers of each stage, --device's first, e.g. 20,12 "
        "(default: as even as can be)",
    )
    p.add_argument(
        "--memory-gib",
        default=env("SKIFF_MEMORY_GIB", ""),
        help="with --stages: the memory each stage may use, GiB, --device's first, e.g. 20,12 "
        "(the split is planned within them and a GPU stage's allocations are capped there: one "
        "GPU can stand in for a smaller pair)",
    )
    p.add_argument("--worker-id", default=env("SKIFF_WORKER_ID", ""))
    a = p.parse_args(argv)
    if not a.model:
        p.error("--model (or SKIFF_MODEL) is required")
    return WorkerConfig(
        model=a.model,
        device=a.device,
        gateway=a.gateway,
        gateway_tokens=a.gateway_tokens,
        dtype=a.dtype if a.dtype != "auto" else default_dtype(a.device),
        kv_dtype=a.kv_dtype,
        kv_scales=a.kv_scales,
        block_size=a.block_size,
        kv_blocks=a.kv_blocks,
        max_model_len=a.max_model_len,
        max_batch_tokens=a.max_batch_tokens,
        overlap=a.overlap,
        step_target_ms=a.step_target_ms,
        dense_copies=a.dense_copies,
        cuda_graphs=a.cuda_graphs,
        cpu_weights=a.cpu_weights,
        threads=a.threads,
        kvcache=a.kvcache,
        spec=a.spec,
        spec_max_tokens=a.spec_max_tokens,
        spec_max_batch=a.spec_max_batch,
        spec_wait_ms=a.spec_wait_ms,
        stages=tuple(d.strip() for d in a.stages.split(",") if d.strip()),
        layer_split=_counts(p, a.layer_split),
        memory_gib=_gibs(p, a.memory_gib),
        stage_host=a.stage_host,
        worker_id=a.worker_id,
        roles=roles,
    )


def _gibs(p: argparse.ArgumentParser, text: str) -> tuple[float, ...]:
    try:
        gibs = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        gibs = (-1.0,)
    if any(g <= 0 for g in gibs):
        p.error(f"--memory-gib {text!r}: comma-separated GiB above 0, e.g. 20,12")
    return gibs


def _counts(p: argparse.ArgumentParser, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        p.error(f"--layer-split {text!r}: comma-separated layer counts, e.g. 20,12")
