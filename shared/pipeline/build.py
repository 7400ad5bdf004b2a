"""A worker's pipeline at start: the split (planned from the devices, or as asked), printed as a
table, and the stage processes after stage 0 started and ready."""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from shared.kv import KVPool
from shared.loader import GGUFFile
from shared.model.config import ModelConfig
from shared.pipeline.lead import Pipeline, StageOptions, StageSpec
from shared.pipeline.plan import GIB, DeviceProfile, PlanError, model_sizes, plan, profile


def profiles(devices: list[str], caps_gib: tuple[float, ...] = ()) -> list[DeviceProfile]:
    """Each device measured once; stages sharing a device (two CPU stages) share its memory,
    each named apart for the planner (cpu, cpu#2). caps_gib: each stage's cap (GiB)."""
    if caps_gib and len(caps_gib) != len(devices):
        raise PlanError(f"--memory-gib: {len(caps_gib)} values for {len(devices)} stages")
    seen: dict[str, DeviceProfile] = {}
    for d in devices:
        if d not in seen:
            seen[d] = profile(d)
    count = {d: devices.count(d) for d in devices}
    out, k = [], {d: 0 for d in devices}
    for i, d in enumerate(devices):
        k[d] += 1
        p = seen[d]
        name = p.name if k[d] == 1 else f"{p.name}#{k[d]}"
        free = p.free_bytes // count[d]
        if caps_gib:
            free = min(free, int(caps_gib[i] * GIB))
        out.append(replace(p, name=name, free_bytes=free))
    return out


def cap_memory(device: str, gib: float) -> None:
    """A GPU stage's allocations capped at `gib` (torch's per-process fraction of the device):
    one GPU stands in for a smaller one. Nothing on the CPU."""
    dev = torch.device(device)
    if gib > 0 and dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), dev)


def plan_stages(cfg, f: GGUFFile, kv_dtype: torch.dtype) -> tuple[list[int], int]:
    """(layers per stage, KV blocks every stage can hold) for the EngineConfig `cfg` with
    stages: `cfg.layer_split` checked, else planned from the devices' free memory and
    measured bandwidth so that the slowest stage is as fast as can be (shared.pipeline.plan).
    The plan's table goes to stderr. PlanError (a ValueError) says what does not fit."""
    mc = ModelConfig.from_gguf(f)
    remote = [d for d in cfg.stages if d.startswith("tcp://")]
    if remote:  # a stage server's device cannot be measured from here: the split is given
        return _given_split(cfg, mc.n_layers, remote), 0
    per_token_layer = KVPool.bytes_per_block(
        1, 1, mc.n_kv_heads, mc.head_dim, kv_dtype, cfg.kv_scales
    )
    max_len = cfg.max_model_len or min(mc.context_length, 8192)
    devices = [cfg.device, *cfg.stages]
    try:
        chosen = plan(
            profiles(devices, cfg.memory_gib), model_sizes(f, per_token_layer), cfg.block_size,
            max_len,
            cfg.layer_split or None,
        )  # fmt: skip
    except PlanError as exc:
        raise PlanError(f"pipeline over {','.join(devices)}: {exc}") from exc
    print(f"pipeline plan ({'as asked' if cfg.layer_split else 'planned'}):", file=sys.stderr)
    print(chosen.table(), file=sys.stderr, flush=True)
    return list(chosen.layer_split), chosen.kv_blocks


def _given_split(cfg, n_layers: int, remote: list[str]) -> list[int]:
    split = list(cfg.layer_split)
    if not split:
        raise PlanError(
            f"a pipeline with remote stages ({', '.join(remote)}) needs --layer-split: their "
            "devices are not measured from here"
        )
    if len(split) != 1 + len(cfg.stages) or min(split) < 1 or sum(split) != n_layers:
        raise PlanError(
            f"layer split {','.join(map(str, split))}: one count of at least 1 per stage "
            f"({1 + len(cfg.stages)}), summing to the model's {n_layers} layers"
        )
    print(f"pipeline split as asked: {split} (remote stages: {', '.join(remote)})",
          file=sys.stderr, flush=True)  # fmt: skip
    return split


def start_stages(cfg, kv: KVPool, model, split: list[int], max_len: int) -> Pipeline:
    """The stage processes after stage 0, each with its layers and kv's block count, ready
    (their decode steps captured as CUDA graphs on a GPU, as the worker's own are)."""
    specs, first = [], split[0]
    caps = cfg.memory_gib[1:] or (0.0,) * len(cfg.stages)
    for device, n, gib in zip(cfg.stages, split[1:], caps, strict=True):
        specs.append(StageSpec(device, first, first + n, gib))
        first += n
    opts = StageOptions(
        cfg.model_path, kv.num_blocks, cfg.block_size, cfg.kv_dtype, cfg.cpu_weights,
        cfg.dense_copies, max_seqs=cfg.max_seqs, max_model_len=max_len,
        cuda_graphs=cfg.cuda_graphs, host=cfg.stage_host,
    )  # fmt: skip
    pipeline = Pipeline(model, kv, specs, opts, torch.device(cfg.device), getattr(torch, cfg.dtype))
    try:
        for r in pipeline.wait_ready():
            first, last = r.layers
            print(
                f"pipeline stage {r.stage} ready on {r.device} ({r.kind}): layers {first}-"
                f"{last - 1}, {r.kv_blocks} KV blocks, {r.choices}",
                file=sys.stderr,
                flush=True,
            )
    except BaseException:
        pipeline.close()
        raise
    return pipeline
