"""Builds a ready engine (model, KV pool, allocator, tokenizer) for one device from one config."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shared.engine.cuda_graphs import GRAPH_MODES, StepGraphs, capture_graphs
from shared.engine.engine import LLMEngine
from shared.engine.model_runner import ModelRunner
from shared.engine.warm_up import warm_up
from shared.kv import BlockManager, KVPool
from shared.kv.calibrate import calibrate
from shared.kv.kv_dtype import resolve_kv_dtype
from shared.loader import GGUFFile
from shared.model import load_model
from shared.model.causal_lm import LayerSpan
from shared.model.loading import CPU_WEIGHTS
from shared.pipeline.build import cap_memory, plan_stages, start_stages
from shared.pipeline.lead import Pipeline
from shared.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"  # activations: float32, float16 or bfloat16
    kv_dtype: str = "auto"  # auto (= dtype), float32, float16, bfloat16 or fp8 (e4m3)
    kv_scales: str = "token"  # fp8: per (token, KV head), or per KV head calibrated at start
    block_size: int = 16
    max_model_len: int = 0  # 0 = the model's context length, capped at 8192
    kv_blocks: int = 0  # 0 = sized from kv_cpu_bytes (CPU) or kv_gpu_fraction of free memory
    kv_cpu_bytes: int = 512 << 20
    kv_gpu_fraction: float = 0.5
    max_batch_tokens: int = 512  # as the worker's default (shared/worker/config.py)
    cache_dequantized: bool | None = None  # None = yes on CPU
    prefix_caching: bool = True
    max_seqs: int = 256
    cuda_graphs: str = "all"  # CUDA steps replayed from graphs: all, decode (steps) or off
    overlap: bool = False  # prepare step N+1 on the CPU while the device runs step N
    step_target_ms: float = 0.0  # steps with decodes: 0 auto (2x theirs), > 0 floor, < 0 off
    dense_copies: str = "auto"  # auto / on / off: dense copies of packed weights (big batches)
    # CPU: quantized linears as torch's int4 planes (int4_linear), else float copies ("float")
    cpu_weights: str = "native"
    # pipeline stages after this device's (shared.pipeline): their devices, and the layers of
    # every stage, this one first (empty: split evenly)
    stages: tuple[str, ...] = ()
    layer_split: tuple[int, ...] = ()
    memory_gib: tuple[float, ...] = ()  # each stage's memory cap (a GPU's allocations too)
    stage_host: str = ""  # with remote stages: the address they reach this host at


@dataclass
class LoadedEngine:
    engine: LLMEngine
    tokenizer: Tokenizer
    gguf: GGUFFile
    pipeline: Pipeline | None = None  # the stage processes after this one, if any

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()


def _default_kv_blocks(
    cfg: EngineConfig, n_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> int:
    per_block = KVPool.bytes_per_block(
        n_layers, cfg.block_size, n_kv_heads, head_dim, kv_dtype, cfg.kv_scales
    )
    device = torch.device(cfg.device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.kv_gpu_fraction)
    else:
        budget = cfg.kv_cpu_bytes
    return max(1, budget // per_block)


def build_engine(cfg: EngineConfig) -> LoadedEngine:
    if cfg.cuda_graphs not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs {cfg.cuda_graphs!r}: one of {', '.join(GRAPH_MODES)}")
    f = GGUFFile(cfg.model_path)
    dtype = getattr(torch, cfg.dtype)
    if cfg.cpu_weights not in CPU_WEIGHTS:
        raise ValueError(f"cpu_weights {cfg.cpu_weights!r}: one of {', '.join(CPU_WEIGHTS)}")
    cpu_weights = cfg.cpu_weights if torch.device(cfg.device).type == "cpu" else "float"
    kv_dtype = resolve_kv_dtype(cfg.kv_dtype, dtype, cfg.device)
    split, planned_blocks = [], 0
    if cfg.stages:
        split, planned_blocks = plan_stages(cfg, f, kv_dtype)
        if cfg.memory_gib:
            cap_memory(cfg.device, cfg.memory_gib[0])
    span = LayerSpan(0, split[0], True) if cfg.stages else None
    model = load_model(
        f, cfg.device, dtype, cfg.cache_dequantized, dense_copies=cfg.dense_copies,
        cpu_weights=cpu_weights,
        span=span,
    )  # fmt: skip
    mc = model.cfg
    max_len = cfg.max_model_len or min(mc.context_length, 8192)
    num_blocks = cfg.kv_blocks or _default_kv_blocks(
        cfg, len(model.layers), mc.n_kv_heads, mc.head_dim, kv_dtype
    )
    if planned_blocks:  # every stage's pool has this many: the smallest fits all
        num_blocks = min(num_blocks, planned_blocks)
    kv = KVPool(
        len(model.layers), num_blocks, cfg.block_size, mc.n_kv_heads, mc.head_dim, kv_dtype,
        cfg.device, cfg.kv_scales,
    )  # fmt: skip
    tokenizer = load_tokenizer(f.metadata)
    pipeline = None
    if cfg.stages:
        if kv.head_scales:
            raise ValueError("FP8 per-head KV scales are not calibrated across pipeline stages")
        pipeline = start_stages(cfg, kv, model, split, max_len)
    if kv.head_scales:
        t = time.perf_counter()
        n = calibrate(model, kv, tokenizer)
        took = time.perf_counter() - t
        log.info("FP8 KV scales per head calibrated over %d tokens in %.2f s", n, took)
    elif cfg.kv_scales == "head":
        log.warning("kv_scales 'head' is for an fp8 KV cache; this one is %s", kv_dtype)
    graphs = None
    on_cuda = torch.device(cfg.device).type == "cuda" and model.ops.name == "triton"
    if cfg.cuda_graphs != "off" and on_cuda and pipeline is None:
        mixed = cfg.max_batch_tokens if cfg.cuda_graphs == "all" else 0

        def make(tokens: int) -> StepGraphs:
            return StepGraphs(model, kv, cfg.max_seqs, max_len, tokens)

        graphs = capture_graphs(make, mixed)
    elif cfg.cuda_graphs != "off" and on_cuda:
        pipeline.capture_front(cfg.max_seqs, max_len)
    runner = ModelRunner(pipeline or model, kv, cfg.device, graphs)
    blocks = BlockManager(
        num_blocks,
        cfg.block_size,
        cfg.prefix_caching,
        f"{f.path.name}:{f.path.stat().st_size}".encode(),
    )
    engine = LLMEngine(
        runner,
        blocks,
        max_len,
        cfg.max_batch_tokens,
        cfg.max_seqs,
        overlap=cfg.overlap,
        step_target_ms=cfg.step_target_ms,
    )
    try:
        warm_up(engine, cfg.device)
    except BaseException:
        if pipeline is not None:
            pipeline.close()
        raise
    return LoadedEngine(engine, tokenizer, f, pipeline)
