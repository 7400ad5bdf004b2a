"""The split planner (shared/pipeline/plan.py): invented device profiles and model shapes, an
exhaustive oracle on small cases, the errors a user sees, and model_sizes on a real GGUF."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from shared.loader import GGUFFile
from shared.pipeline.plan import (
    CPU_RESERVE_BYTES,
    GIB,
    GPU_RESERVE_BYTES,
    DeviceProfile,
    ModelSizes,
    PlanError,
    model_sizes,
    plan,
    profile,
)

MB = 1_000_000
KV = 4096  # K+V bytes per token per layer of an 8B shape: 8 KV heads x 128 x 2 x fp16
BLOCK = 16

FAST = DeviceProfile("cuda:0", "NVIDIA H100 80GB HBM3", 32 * GIB, 1800.0)
SLOW = DeviceProfile("cuda:1", "NVIDIA L4", 24 * GIB, 1000.0)
CPU = DeviceProfile("cpu", "CPU", 64 * GIB, 60.0)
EIGHT_B = ModelSizes((150 * MB,) * 32, 1000 * MB, KV)


def stage_ms(sizes: ModelSizes, device: DeviceProfile, first: int, last: int) -> float:
    ends = sizes.ends_bytes if first == 0 else 0
    return (sum(sizes.layer_bytes[first:last]) + ends) / (device.bandwidth_gbs * 1e6)


def stage_need(sizes: ModelSizes, device: DeviceProfile, first: int, last: int, tokens: int):
    ends = sizes.ends_bytes if first == 0 else 0
    reserve = CPU_RESERVE_BYTES if device.name == "cpu" else GPU_RESERVE_BYTES
    kv = tokens * (last - first) * sizes.kv_bytes_per_token_layer
    return sum(sizes.layer_bytes[first:last]) + ends + kv + reserve


def test_fast_and_slow_gpu_put_more_layers_on_the_fast_one():
    best = plan([FAST, SLOW], EIGHT_B, BLOCK, 8192)
    even = plan([FAST, SLOW], EIGHT_B, BLOCK, 8192, layer_split=(16, 16))
    # 18 layers + the ends at 1800 GB/s take 2.06 ms, 14 layers at 1000 GB/s 2.10 ms
    assert best.layer_split == (18, 14)
    assert best.bottleneck_ms == pytest.approx(2.10)
    assert even.bottleneck_ms == pytest.approx(2.40)  # 16 x 150 MB at 1000 GB/s
    assert best.bottleneck_ms < even.bottleneck_ms
    first, second = best.stages
    assert (first.device, first.first, first.last, first.ends) == (FAST, 0, 18, True)
    assert (second.device, second.first, second.last, second.ends) == (SLOW, 18, 32, False)
    assert first.weight_bytes == 18 * 150 * MB + 1000 * MB
    assert second.weight_bytes == 14 * 150 * MB
    assert first.step_ms == pytest.approx(3700 / 1800)


def test_gpu_and_cpu_give_the_cpu_one_layer():
    p = plan([FAST, CPU], EIGHT_B, BLOCK, 8192)
    # one layer on the CPU takes 2.5 ms, below the GPU's 3.14 ms; two would take 5 ms
    assert p.layer_split == (31, 1)
    assert p.bottleneck_ms == pytest.approx((31 * 150 + 1000) / 1800)
    assert p.stages[1].step_ms == pytest.approx(2.5)
    gpu, cpu = p.stages
    gpu_blocks = (FAST.free_bytes - gpu.weight_bytes - GPU_RESERVE_BYTES) // (BLOCK * 31 * KV)
    cpu_blocks = (CPU.free_bytes - cpu.weight_bytes - CPU_RESERVE_BYTES) // (BLOCK * 1 * KV)
    assert p.kv_blocks == gpu_blocks < cpu_blocks


def test_memory_caps_the_fast_device_below_its_fair_share():
    small_fast = DeviceProfile("cuda:0", "small", 3 * GIB, 3000.0)
    p = plan([small_fast, SLOW], EIGHT_B, BLOCK, 4096)
    n = p.layer_split[0]
    assert stage_need(EIGHT_B, small_fast, 0, n, 4096) <= small_fast.free_bytes
    assert stage_need(EIGHT_B, small_fast, 0, n + 1, 4096) > small_fast.free_bytes
    # unbounded it would take 22 layers; 1000 MB + 10 x (150 MB + 16.8 MB of KV) + 512 MiB of
    # reserve = 3205 MB fit its 3 GiB (3221 MB), an 11th layer does not
    assert n == 10


def test_single_device_takes_every_layer():
    p = plan([FAST], EIGHT_B, BLOCK, 8192)
    assert p.layer_split == (32,)
    (stage,) = p.stages
    assert (stage.first, stage.last, stage.ends) == (0, 32, True)
    assert stage.weight_bytes == 32 * 150 * MB + 1000 * MB
    free = FAST.free_bytes - stage.weight_bytes - GPU_RESERVE_BYTES
    assert p.kv_blocks == free // (BLOCK * 32 * KV)


def test_kv_blocks_is_the_least_over_stages_and_covers_min_kv_tokens():
    p = plan([FAST, SLOW], EIGHT_B, BLOCK, 8192)
    per_stage = [
        (s.device.free_bytes - s.weight_bytes - GPU_RESERVE_BYTES) // (BLOCK * s.n_layers * KV)
        for s in p.stages
    ]
    assert per_stage[0] != per_stage[1]
    assert p.kv_blocks == min(per_stage)
    assert p.kv_blocks >= 8192 / BLOCK


def test_min_kv_tokens_round_up_to_whole_blocks_in_the_memory_check():
    sizes = ModelSizes((100 * MB,), 0, KV)
    need = 100 * MB + 2 * BLOCK * KV + GPU_RESERVE_BYTES  # 17 tokens take 2 blocks
    tight = DeviceProfile("cuda:0", "tight", need, 1000.0)
    assert plan([tight], sizes, BLOCK, 17).kv_blocks == 2
    short = DeviceProfile("cuda:0", "short", need - 1, 1000.0)
    with pytest.raises(PlanError, match="KV for 32 tokens"):
        plan([short], sizes, BLOCK, 17)


def test_model_that_fits_nowhere_names_devices_and_gib():
    a = DeviceProfile("cuda:0", "small", 4 * GIB, 1000.0)
    b = DeviceProfile("cuda:1", "small", 4 * GIB, 1000.0)
    sizes = ModelSizes((GIB // 2,) * 24, 0, KV)
    with pytest.raises(PlanError) as err:
        plan([a, b], sizes, BLOCK, 4096)
    text = str(err.value)
    assert "cuda:0" in text and "cuda:1" in text
    assert "12.00 GiB of weights" in text
    assert "0.38 GiB of KV for 4096 tokens" in text  # 4096 x 24 x 4096 bytes
    assert "1.00 GiB of reserve" in text
    assert "cuda:0 4.00, cuda:1 4.00 (8.00 in all)" in text


def test_first_device_too_small_for_the_ends_is_named():
    tiny = DeviceProfile("cuda:0", "tiny", GIB, 1000.0)
    with pytest.raises(PlanError, match=r"cuda:0, the first stage.*but has 1.00 GiB free"):
        plan([tiny, SLOW], ModelSizes((100 * MB,) * 4, 2 * GIB, KV), BLOCK, 16)


def test_later_device_too_small_for_one_layer_is_named():
    tiny = DeviceProfile("cuda:1", "tiny", GIB, 1000.0)
    with pytest.raises(PlanError, match=r"cuda:1, a stage, holding one layer.*1.00 GiB free"):
        plan([FAST, tiny], ModelSizes((GIB,) * 4, 0, KV), BLOCK, 16)


def test_more_devices_than_layers_is_refused():
    with pytest.raises(PlanError, match="2 layers, fewer than the 3 devices"):
        plan([FAST, SLOW, CPU], ModelSizes((MB, MB), 0, KV), BLOCK, 16)


def test_explicit_layer_split_is_honoured_even_when_slower():
    p = plan([FAST, SLOW], EIGHT_B, BLOCK, 8192, layer_split=(20, 12))
    assert p.layer_split == (20, 12)
    assert [(s.first, s.last) for s in p.stages] == [(0, 20), (20, 32)]
    assert p.bottleneck_ms == pytest.approx((20 * 150 + 1000) / 1800)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ((20, 11), "layer split 20,11 sums to 31, the model has 32"),
        ((32, 0), "layer split 32,0: every stage needs at least one layer"),
        ((32,), "layer split 32: 1 counts for 2 devices"),
    ],
)
def test_malformed_layer_split_is_refused(split, message):
    with pytest.raises(PlanError) as err:
        plan([FAST, SLOW], EIGHT_B, BLOCK, 8192, layer_split=split)
    assert str(err.value) == message


def test_layer_split_that_overflows_a_device_is_refused_with_the_numbers():
    small = DeviceProfile("cuda:1", "small", 3 * GIB, 1000.0)
    with pytest.raises(PlanError) as err:
        plan([FAST, small], EIGHT_B, BLOCK, 8192, layer_split=(4, 28))
    assert str(err.value) == (
        "layer split 4,28: cuda:1 holding layers 4-31 needs 3.91 GiB of weights + 0.88 GiB of KV "
        "for 8192 tokens + 0.50 GiB of reserve = 5.29 GiB but has 3.00 GiB free"
    )


def test_duplicate_devices_and_bad_arguments_are_refused():
    with pytest.raises(PlanError, match="distinct"):
        plan([FAST, FAST], EIGHT_B, BLOCK, 8192)
    with pytest.raises(PlanError, match="must be at least 1.*got 0, 4096 and 8192"):
        plan([FAST], EIGHT_B, 0, 8192)
    with pytest.raises(PlanError, match="2 reserves for 1 devices"):
        plan([FAST], EIGHT_B, BLOCK, 8192, reserve_bytes=(1, 2))


def test_reserve_bytes_override_changes_what_fits():
    sizes = ModelSizes((100 * MB,), 0, KV)
    dev = DeviceProfile("cuda:0", "d", 100 * MB + BLOCK * KV + 10 * MB, 1000.0)
    with pytest.raises(PlanError, match="0.50 GiB of reserve"):
        plan([dev], sizes, BLOCK, BLOCK)
    assert plan([dev], sizes, BLOCK, BLOCK, reserve_bytes=10 * MB).kv_blocks == 1


def test_plan_matches_an_exhaustive_search():
    rng = random.Random(45)
    checked = refused = 0
    for _ in range(150):
        n_layers, n_dev = rng.randint(3, 10), rng.randint(1, 3)
        sizes = ModelSizes(
            tuple(rng.randint(1, 100) * MB for _ in range(n_layers)), rng.randint(0, 300) * MB, KV
        )
        devices = [
            DeviceProfile(
                f"cuda:{i}", "gpu", rng.randint(600, 1100) * MB, float(rng.choice([60, 900, 1800]))
            )
            for i in range(n_dev)
        ]
        tokens = 64
        best = None
        for cuts in itertools.combinations(range(1, n_layers), n_dev - 1):
            bounds = (0, *cuts, n_layers)
            stages = list(zip(devices, bounds, bounds[1:], strict=False))
            if all(stage_need(sizes, d, a, b, tokens) <= d.free_bytes for d, a, b in stages):
                split = tuple(b - a for _, a, b in stages)
                key = (max(stage_ms(sizes, d, a, b) for d, a, b in stages), split[::-1])
                best = min(best or key, key)
        if best is None:
            with pytest.raises(PlanError):
                plan(devices, sizes, BLOCK, tokens)
            refused += 1
            continue
        p = plan(devices, sizes, BLOCK, tokens)
        assert p.bottleneck_ms == best[0]
        assert p.layer_split == best[1][::-1]
        checked += 1
    assert checked > 50 and refused > 10  # both branches ran on many cases


def test_two_hundred_layers_over_eight_devices_is_planned_quickly():
    sizes = ModelSizes((200 * MB,) * 200, 2000 * MB, KV)
    devices = [DeviceProfile(f"cuda:{i}", "gpu", 80 * GIB, 1000.0 + 100 * i) for i in range(8)]
    p = plan(devices, sizes, BLOCK, 4096)
    assert sum(p.layer_split) == 200
    # the bound: 42 GB spread over 10.8 TB/s of bandwidth, within one layer per stage
    assert p.bottleneck_ms < 42_000 / 10_800 + 200 / 1000


def test_table_has_one_line_per_stage_with_the_ranges():
    p = plan([FAST, SLOW], EIGHT_B, BLOCK, 8192)
    header, *lines = p.table().splitlines()
    assert header == "device  kind                   layers      weights GiB  KV blocks  step ms"
    assert len(lines) == 2
    assert lines[0].startswith("cuda:0") and " 0-17 +ends " in lines[0]
    assert lines[1].startswith("cuda:1") and " 18-31 " in lines[1]
    assert lines[0].split()[-3:] == ["3.45", str(p.kv_blocks), "2.06"]
    assert lines[1].split()[-3:] == ["1.96", str(p.kv_blocks), "2.10"]


def test_model_sizes_covers_every_tensor_of_a_real_gguf(smollm2_path):
    f = GGUFFile(smollm2_path)
    sizes = model_sizes(f, 1536)
    assert sizes.n_layers == 30
    assert sizes.kv_bytes_per_token_layer == 1536
    assert len(set(sizes.layer_bytes)) == 1  # SmolLM2's layers all have one shape
    tied_ends = f.tensors["token_embd.weight"].nbytes + f.tensors["output_norm.weight"].nbytes
    assert sizes.ends_bytes == tied_ends
    total = sum(sizes.layer_bytes) + sizes.ends_bytes
    assert total == sum(t.nbytes for t in f.tensors.values())
    file_size = smollm2_path.stat().st_size
    assert 0.97 * file_size < total < file_size  # the rest is header and padding


def test_profile_of_the_cpu_measures_memory_and_bandwidth():
    capped = profile("cpu", free_cap_bytes=GIB)
    assert (capped.name, capped.kind, capped.free_bytes) == ("cpu", "CPU", GIB)
    assert 0.5 < capped.bandwidth_gbs < 2000
    free = profile("cpu").free_bytes
    assert free > 256 * 1024 * 1024 and math.isfinite(free)
    with pytest.raises(PlanError, match="only cpu and cuda"):
        profile("meta")
