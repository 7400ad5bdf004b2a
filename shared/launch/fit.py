"""One worker per device, or one pipeline over them: `skiff serve` with several `--devices` and
neither `--pipeline` nor a prefill/decode split asks here whether the model fits each device
alone with a useful KV pool (its weights, KV for one sequence of the worker's longest context,
and a reserve: shared.pipeline.plan's arithmetic).

- Every device fits: a worker on each (their requests shared by the gateway), as before.
- Some fit: workers on those; the others are named with what they lack.
- None fits: one worker whose model is split over all of them as pipeline stages, if that fits.
- Not even that: the planner's message (what is needed, what is free).

`python -m shared.launch.fit MODEL --devices cuda:0,cuda:1 [--max-model-len N]` prints the
choice as one JSON line. It runs in a subprocess of the launcher, which imports neither torch
nor the model code and holds no CUDA context; `choose()` is the pure part, tested with
invented devices.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from shared.pipeline.plan import GIB, DeviceProfile, ModelSizes, PlanError, plan

BLOCK_SIZE = 16
KV_BYTES = 2  # a KV element: bf16 on a GPU, float16 on the CPU (an fp8 cache needs half)


@dataclass(frozen=True)
class Layout:
    pipeline: bool
    devices: list[str]  # the workers' devices, or the stages' in order
    message: str  # what `skiff serve` says about the choice ("": nothing to say)


def choose(
    profiles: Sequence[DeviceProfile], sizes: ModelSizes, context: int, block: int = BLOCK_SIZE
) -> Layout:
    """The layout for these devices (in `--devices` order). PlanError: it fits nowhere, not
    even split over all of them."""
    names = [p.name for p in profiles]
    alone, why = [], {}
    for p in profiles:
        try:
            plan([p], sizes, block, context)
            alone.append(p.name)
        except PlanError as exc:
            why[p.name] = str(exc)
    if len(alone) == len(names):
        return Layout(False, names, "")
    if alone:
        skipped = "; ".join(f"{n}: {why[n]}" for n in names if n not in alone)
        return Layout(
            False,
            alone,
            f"workers on {', '.join(alone)} only ({skipped}); --pipeline splits the model over "
            "every device instead",
        )
    try:
        chosen = plan(profiles, sizes, block, context)
    except PlanError as exc:
        raise PlanError(f"the model fits no single device, nor split over them: {exc}") from exc
    total = sum(sizes.layer_bytes) + sizes.ends_bytes
    return Layout(
        True,
        names,
        f"the model ({total / GIB:.1f} GiB) fits no single device with KV for {context} "
        f"tokens: one worker, its layers split {','.join(map(str, chosen.layer_split))} over "
        f"{', '.join(names)} as pipeline stages",
    )


def _profiles(devices: Sequence[str]) -> list[DeviceProfile]:
    """Each device's free memory now (bandwidth is not measured here: every device counts the
    same, which only matters to the split the worker plans again at start)."""
    import torch

    from shared.pipeline.plan import _mem_available_bytes

    out = []
    for d in devices:
        if d == "cpu":
            out.append(DeviceProfile("cpu", "CPU", _mem_available_bytes(), 1.0))
        else:
            free = torch.cuda.mem_get_info(torch.device(d))[0]
            out.append(DeviceProfile(d, torch.cuda.get_device_name(torch.device(d)), free, 1.0))
    return out


def _sizes(model: str) -> tuple[ModelSizes, int]:
    """The model's sizes with bf16/f16 KV, and the worker's default context (at most 8,192)."""
    from shared.loader import GGUFFile
    from shared.model.config import ModelConfig
    from shared.pipeline.plan import model_sizes

    f = GGUFFile(model)
    mc = ModelConfig.from_gguf(f)
    per_token_layer = 2 * mc.n_kv_heads * mc.head_dim * KV_BYTES
    return model_sizes(f, per_token_layer), min(mc.context_length, 8192)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shared.launch.fit", description=__doc__)
    p.add_argument("model")
    p.add_argument("--devices", required=True)
    p.add_argument("--max-model-len", type=int, default=0)
    a = p.parse_args(argv)
    try:
        sizes, context = _sizes(a.model)
        layout = choose(_profiles(a.devices.split(",")), sizes, a.max_model_len or context)
        print(json.dumps(asdict(layout)))
    except (PlanError, ValueError, RuntimeError) as exc:  # GGUFError is a ValueError
        print(json.dumps({"error": str(exc)}))
    return 0


def ask(model: str, devices: Sequence[str], max_model_len: int = 0) -> Layout:
    """`main` in a subprocess (the launcher holds no CUDA context). ValueError: the model fits
    nowhere, or the check could not run (its output)."""
    argv = [sys.executable, "-m", "shared.launch.fit", model, "--devices", ",".join(devices)]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise ValueError(f"checking where the model fits failed: {done.stderr[-500:]}") from None
    if "error" in answer:
        raise ValueError(answer["error"])
    return Layout(**answer)


if __name__ == "__main__":
    sys.exit(main())
