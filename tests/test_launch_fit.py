"""One worker per device or one pipeline over them (shared.launch.fit): `skiff serve` with
several devices asks whether the model fits each alone with KV for a full context."""

from __future__ import annotations

import io
import json
import socket
import sys
from pathlib import Path

import pytest

from shared import launch
from shared.launch import ServeConfig
from shared.launch.fit import Layout, choose, main
from shared.pipeline.plan import GIB, MIB, DeviceProfile, ModelSizes, PlanError

# an 8B-like shape: 32 layers of 0.44 GiB, 1.2 GiB of ends, 128 KiB of KV a token and layer
SIZES = ModelSizes((int(0.44 * GIB),) * 32, int(1.2 * GIB), 128 * 1024 // 32)


def _gpu(name: str, free_gib: float) -> DeviceProfile:
    return DeviceProfile(name, "GPU", int(free_gib * GIB), 1000.0)


def test_a_model_that_fits_every_device_gets_a_worker_on_each() -> None:
    got = choose([_gpu("cuda:0", 40), _gpu("cuda:1", 24)], SIZES, 8192)
    assert got == Layout(False, ["cuda:0", "cuda:1"], "")


def test_a_device_too_small_alone_is_left_out_and_named() -> None:
    got = choose([_gpu("cuda:0", 40), _gpu("cuda:1", 8)], SIZES, 8192)
    assert not got.pipeline and got.devices == ["cuda:0"]
    assert "cuda:1: the model does not fit" in got.message and "--pipeline" in got.message


def test_a_model_that_fits_no_device_alone_is_split_over_all() -> None:
    got = choose([_gpu("cuda:0", 10), _gpu("cuda:1", 9)], SIZES, 8192)
    assert got.pipeline and got.devices == ["cuda:0", "cuda:1"]
    assert "fits no single device" in got.message
    split = got.message.split("split ")[1].split()[0]
    assert sum(int(n) for n in split.split(",")) == 32


def test_the_context_decides_what_fits() -> None:
    # 15.3 GiB of weights: with KV for 8k tokens (1 GiB) and the reserve it needs ~16.8 GiB
    devices = [_gpu("cuda:0", 16.5), DeviceProfile("cpu", "CPU", 64 * GIB, 50.0)]
    assert choose(devices, SIZES, 8192).devices == ["cpu"]
    assert choose(devices, SIZES, 1024).devices == ["cuda:0", "cpu"]


def test_a_model_that_fits_nowhere_says_so() -> None:
    with pytest.raises(PlanError, match="fits no single device, nor split over them"):
        choose([_gpu("cuda:0", 4), _gpu("cuda:1", 4)], SIZES, 8192)


def test_the_check_reads_a_real_file(smollm2_path: Path, capsys) -> None:
    assert main([str(smollm2_path), "--devices", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got == {"pipeline": False, "devices": ["cpu"], "message": ""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_asks_only_for_several_devices_and_stops_when_nothing_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    asked = []

    def nowhere(path: str, devices: list[str], max_len: int) -> Layout:
        asked.append((path, devices, max_len))
        raise ValueError("the model fits no single device, nor split over them: 99 GiB")

    def no_cuda() -> int:
        raise AssertionError("explicit devices")

    out, err = io.StringIO(), io.StringIO()
    config = ServeConfig(model, port=_free_port(), devices="cuda:0,cuda:1", max_model_len=512)
    rc = launch.serve(config, out, err, cuda_count=no_cuda, fit=nowhere)
    assert rc == 2 and "fits no single device" in err.getvalue()
    assert asked == [(str(model.resolve()), ["cuda:0", "cuda:1"], 512)]
    # a pipeline asked for is not second-guessed; nor is a single device (nothing started)
    module = sys.modules["shared.launch.supervise"]  # (the package exports its function)
    monkeypatch.setattr(module, "supervise", lambda *a, **k: 0)
    for devices, pipeline in (("cuda:0,cuda:1", True), ("cuda:0", False)):
        config = ServeConfig(model, port=_free_port(), devices=devices, pipeline=pipeline,
                             layer_split="1,1,1" if pipeline else "")  # fmt: skip
        asked.clear()
        rc = launch.serve(config, io.StringIO(), io.StringIO(), cuda_count=no_cuda, fit=nowhere)
        assert rc == 0 and asked == []


def test_reserve_is_counted() -> None:
    # just under what one stage needs with its reserve (512 MiB on a GPU)
    need = sum(SIZES.layer_bytes) + SIZES.ends_bytes + 8192 * 32 * SIZES.kv_bytes_per_token_layer
    assert choose([_gpu("cuda:0", (need + 600 * MIB) / GIB)], SIZES, 8192).devices == ["cuda:0"]
    with pytest.raises(PlanError):
        choose([_gpu("cuda:0", (need + 400 * MIB) / GIB)], SIZES, 8192)
