"""The split planner: which contiguous decoder layers each pipeline stage of a worker holds.

A worker spanning several devices (`cuda:0,cuda:1`, `cuda:0,cpu`) runs them as pipeline stages.
The first stage also holds the ends, i.e. the token embedding, the final norm and the LM head,
because each step's hidden states come back to its process for sampling. A decode step reads
every weight once, so a stage's step time is about its weight bytes over its memory bandwidth,
and the pipeline's throughput is bounded by its slowest stage: `plan()` picks the split that
minimises that slowest stage, among the splits where every stage's weights, its KV for
`min_kv_tokens` tokens and a reserve fit the device's free memory (ties go to fewer layers on the
later stages). It also sets one KV block count for every stage, since the first stage's block
manager drives all the pools. `plan()` is pure arithmetic on invented or measured profiles;
`profile()` is the one function that measures a device.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from shared.loader import GGUFError, GGUFFile

GIB = 1 << 30
MIB = 1 << 20
GPU_RESERVE_BYTES = 512 * MIB  # activations, workspaces, the CUDA context's allocations
CPU_RESERVE_BYTES = 256 * MIB


class PlanError(ValueError):
    """No split fits, or a requested one is malformed or overflows a device; shown at start."""


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # "cuda:0", "cpu"
    kind: str  # "NVIDIA H100 80GB HBM3", "CPU"
    free_bytes: int  # memory the stage may use
    bandwidth_gbs: float  # memory bandwidth, GB/s


def default_reserve_bytes(device: DeviceProfile) -> int:
    return CPU_RESERVE_BYTES if device.name.startswith("cpu") else GPU_RESERVE_BYTES


@dataclass(frozen=True)
class ModelSizes:
    layer_bytes: tuple[int, ...]  # weight bytes of decoder layer i (every `blk.{i}.*` tensor)
    ends_bytes: int  # every other tensor (embedding, final norm, head, rope_freqs): stage 0's
    kv_bytes_per_token_layer: int  # K+V bytes of one token in one layer

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)


def model_sizes(f: GGUFFile, kv_bytes_per_token_layer: int) -> ModelSizes:
    """The sizes from the file's tensor table (no tensor data is read)."""
    # model code imports torch; a process that only plans (or reports a PlanError) need not
    from shared.model.config import ModelConfig

    n_layers = ModelConfig.from_gguf(f).n_layers
    layers = [0] * n_layers
    ends = 0
    for name, info in f.tensors.items():
        if not name.startswith("blk."):
            ends += info.nbytes
            continue
        index = name.split(".")[1]
        if not index.isdigit() or int(index) >= n_layers:
            raise GGUFError(str(f.path), f"not a block of the file's {n_layers} layers", name)
        layers[int(index)] += info.nbytes
    return ModelSizes(tuple(layers), ends, kv_bytes_per_token_layer)


@dataclass(frozen=True)
class Stage:
    device: DeviceProfile
    first: int  # first layer
    last: int  # one past the last layer
    weight_bytes: int  # its layers, plus the ends on the first stage
    ends: bool  # holds the embedding, final norm and LM head
    step_ms: float  # expected decode-step time at batch 1: weight bytes / bandwidth

    @property
    def n_layers(self) -> int:
        return self.last - self.first


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    kv_blocks: int  # per stage: one count for all, the first stage's block manager drives them

    @property
    def layer_split(self) -> tuple[int, ...]:
        return tuple(s.n_layers for s in self.stages)

    @property
    def bottleneck_ms(self) -> float:
        return max(s.step_ms for s in self.stages)

    def table(self) -> str:
        rows = [("device", "kind", "layers", "weights GiB", "KV blocks", "step ms")]
        for s in self.stages:
            layers = f"{s.first}-{s.last - 1}" + (" +ends" if s.ends else "")
            gib, blocks, ms = _gib(s.weight_bytes), str(self.kv_blocks), f"{s.step_ms:.2f}"
            rows.append((s.device.name, s.device.kind, layers, gib, blocks, ms))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows)
        return "\n".join(line.rstrip() for line in lines)


@dataclass(frozen=True)
class _Costs:
    """The arithmetic of one stage on one device: bytes, memory need and step time."""

    devices: tuple[DeviceProfile, ...]
    sizes: ModelSizes
    kv_tokens: int  # min_kv_tokens rounded up to whole blocks
    reserves: tuple[int, ...]
    prefix: tuple[int, ...]  # prefix[i]: bytes of layers 0..i-1

    def weights(self, s: int, first: int, last: int) -> int:
        return self.prefix[last] - self.prefix[first] + (self.sizes.ends_bytes if s == 0 else 0)

    def kv(self, first: int, last: int) -> int:
        return self.kv_tokens * (last - first) * self.sizes.kv_bytes_per_token_layer

    def fits(self, s: int, first: int, last: int) -> bool:
        need = self.weights(s, first, last) + self.kv(first, last) + self.reserves[s]
        return need <= self.devices[s].free_bytes

    def step_ms(self, s: int, first: int, last: int) -> float:
        return self.weights(s, first, last) / (self.devices[s].bandwidth_gbs * 1e6)

    def overflow(self, what: str, s: int, first: int, last: int) -> str:
        w, kv, r = self.weights(s, first, last), self.kv(first, last), self.reserves[s]
        free = self.devices[s].free_bytes
        return f"{what} needs {_need(w, kv, r, self.kv_tokens)} but has {_gib(free)} GiB free"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _need(weights: int, kv: int, reserve: int, tokens: int) -> str:
    return (
        f"{_gib(weights)} GiB of weights + {_gib(kv)} GiB of KV for {tokens} tokens + "
        f"{_gib(reserve)} GiB of reserve = {_gib(weights + kv + reserve)} GiB"
    )


def plan(
    devices: Sequence[DeviceProfile],
    sizes: ModelSizes,
    block_size: int,
    min_kv_tokens: int,
    layer_split: Sequence[int] | None = None,
    reserve_bytes: int | Sequence[int] | None = None,
) -> Plan:
    """The stages of `sizes` over `devices` (in pipeline order) whose slowest stage is fastest.

    `layer_split` (layers per stage) overrides the choice and is only checked; `reserve_bytes`
    (one for all, or one per device) defaults to `default_reserve_bytes` of each device.
    """
    costs = _costs(devices, sizes, block_size, min_kv_tokens, reserve_bytes)
    split = _checked(costs, layer_split) if layer_split is not None else _best_split(costs)
    stages, first = [], 0
    for s, (device, n) in enumerate(zip(costs.devices, split, strict=True)):
        w, ms = costs.weights(s, first, first + n), costs.step_ms(s, first, first + n)
        stages.append(Stage(device, first, first + n, w, s == 0, ms))
        first += n
    per_block = block_size * sizes.kv_bytes_per_token_layer
    kv_blocks = min(
        (st.device.free_bytes - st.weight_bytes - r) // (per_block * st.n_layers)
        for st, r in zip(stages, costs.reserves, strict=True)
    )
    return Plan(tuple(stages), kv_blocks)


def _costs(
    devices: Sequence[DeviceProfile],
    sizes: ModelSizes,
    block_size: int,
    min_kv_tokens: int,
    reserve_bytes: int | Sequence[int] | None,
) -> _Costs:
    devices = tuple(devices)
    names = [d.name for d in devices]
    if not devices or len(set(names)) != len(names):
        raise PlanError(f"the devices must be distinct and at least one: {','.join(names)}")
    for d in devices:
        if d.bandwidth_gbs <= 0:
            raise PlanError(f"{d.name}: bandwidth {d.bandwidth_gbs} GB/s is not positive")
    if block_size < 1 or min_kv_tokens < 0 or sizes.kv_bytes_per_token_layer < 1:
        raise PlanError(
            "block_size and kv_bytes_per_token_layer must be at least 1 and min_kv_tokens at "
            f"least 0: got {block_size}, {sizes.kv_bytes_per_token_layer} and {min_kv_tokens}"
        )
    if reserve_bytes is None:
        reserves = tuple(default_reserve_bytes(d) for d in devices)
    elif isinstance(reserve_bytes, int):
        reserves = (reserve_bytes,) * len(devices)
    else:
        reserves = tuple(reserve_bytes)
        if len(reserves) != len(devices):
            raise PlanError(f"{len(reserves)} reserves for {len(devices)} devices")
    prefix = tuple(itertools.accumulate(sizes.layer_bytes, initial=0))
    kv_tokens = math.ceil(min_kv_tokens / block_size) * block_size
    return _Costs(devices, sizes, kv_tokens, reserves, prefix)


def _checked(costs: _Costs, split: Sequence[int]) -> tuple[int, ...]:
    split, devices, n_layers = tuple(split), costs.devices, costs.sizes.n_layers
    text = ",".join(str(n) for n in split)
    if len(split) != len(devices):
        raise PlanError(f"layer split {text}: {len(split)} counts for {len(devices)} devices")
    if min(split) < 1:
        raise PlanError(f"layer split {text}: every stage needs at least one layer")
    if sum(split) != n_layers:
        raise PlanError(f"layer split {text} sums to {sum(split)}, the model has {n_layers}")
    first = 0
    for s, n in enumerate(split):
        if not costs.fits(s, first, first + n):
            ends = " with the embedding and LM head" if s == 0 else ""
            what = f"{devices[s].name} holding layers {first}-{first + n - 1}{ends}"
            raise PlanError(f"layer split {text}: {costs.overflow(what, s, first, first + n)}")
        first += n
    return split


def _best_split(costs: _Costs) -> tuple[int, ...]:
    """Exact: best[s][i] is the least bottleneck of layers 0..i-1 over stages 0..s; then, with
    that bottleneck fixed, each stage from the last takes the fewest layers it can."""
    n_stages, n_layers = len(costs.devices), costs.sizes.n_layers
    if n_layers < n_stages:
        raise PlanError(
            f"the model has {n_layers} layers, fewer than the {n_stages} devices: "
            "every stage needs at least one layer"
        )
    inf = math.inf
    best = [[inf] * (n_layers + 1) for _ in range(n_stages)]
    for i in range(1, n_layers + 1):
        if costs.fits(0, 0, i):
            best[0][i] = costs.step_ms(0, 0, i)
    for s in range(1, n_stages):
        for i in range(s + 1, n_layers + 1):
            for j in range(s, i):
                if best[s - 1][j] < best[s][i] and costs.fits(s, j, i):
                    best[s][i] = min(best[s][i], max(best[s - 1][j], costs.step_ms(s, j, i)))
    bottleneck = best[-1][n_layers]
    if bottleneck == inf:
        raise PlanError(_no_fit(costs))
    split, last = [], n_layers
    for s in range(n_stages - 1, 0, -1):
        first = next(
            j
            for j in range(last - 1, s - 1, -1)
            if best[s - 1][j] <= bottleneck
            and costs.fits(s, j, last)
            and costs.step_ms(s, j, last) <= bottleneck
        )
        split.append(last - first)
        last = first
    return (last, *reversed(split))


def _no_fit(costs: _Costs) -> str:
    devices, n_layers = costs.devices, costs.sizes.n_layers
    if not costs.fits(0, 0, 1):
        what = f"{devices[0].name}, the first stage, holding the embedding, LM head and layer 0,"
        return costs.overflow(what, 0, 0, 1)
    smallest = min(range(n_layers), key=lambda i: costs.prefix[i + 1] - costs.prefix[i])
    for s in range(1, len(devices)):
        if not costs.fits(s, smallest, smallest + 1):
            what = f"{devices[s].name}, a stage, holding one layer (layer {smallest}, the smallest)"
            return costs.overflow(what, s, smallest, smallest + 1)
    weights = costs.prefix[-1] + costs.sizes.ends_bytes
    need = _need(weights, costs.kv(0, n_layers), sum(costs.reserves), costs.kv_tokens)
    free = ", ".join(f"{d.name} {_gib(d.free_bytes)}" for d in devices)
    total = _gib(sum(d.free_bytes for d in devices))
    names = " + ".join(d.name for d in devices)
    return f"the model does not fit on {names}: it needs {need}; GiB free: {free} ({total} in all)"


def profile(device: str, free_cap_bytes: int | None = None) -> DeviceProfile:
    """Measure a device: its free memory (capped at `free_cap_bytes`, so that one device can
    stand in for a smaller one) and its copy bandwidth (best of 3 copies, read + write bytes)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise PlanError(f"device {device}: {exc}") from exc
    if dev.type == "cpu":
        name, kind, free = "cpu", "CPU", _mem_available_bytes()
        nbytes = min(256 * MIB, free // 8)
    elif dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        name, kind = f"cuda:{index}", torch.cuda.get_device_name(index)
        free = torch.cuda.mem_get_info(index)[0]
        nbytes = min(GIB, free // 8)
    else:
        raise PlanError(f"device {device}: only cpu and cuda:N can be pipeline stages")
    src = torch.empty(nbytes, dtype=torch.uint8, device=name)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults, lazy allocation
    seconds = min(_copy_seconds(dst, src) for _ in range(3))
    del src, dst
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if free_cap_bytes is not None:
        free = min(free, free_cap_bytes)
    return DeviceProfile(name, kind, free, 2 * nbytes / seconds / 1e9)


def _copy_seconds(dst, src) -> float:
    import torch

    if dst.device.type == "cpu":
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start
    with torch.cuda.device(dst.device):  # the events record on the current device's stream
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts in kB (KiB)
    raise PlanError(f"{meminfo} has no MemAvailable line")
