"""`skiff serve`'s plans for the other process layouts: the spec service beside the workers,
prefill and decode workers split over devices, and a pipeline over several devices as one
worker. Devices, command lines and the end-to-end run: tests/test_launch.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shared import launch
from shared.cli import build_parser
from shared.launch import Endpoints, ServeConfig
from shared.launch.devices import cpu_count


def _no_cuda() -> int:
    raise AssertionError("an explicit device list must not look for CUDA devices")


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_spec_service_and_the_workers_drafts() -> None:
    endpoints = Endpoints(*(f"tcp://127.0.0.1:{p}" for p in (5001, 5002, 5003, 5004)))
    config = ServeConfig(Path("/m.gguf"), spec_max_tokens=5)
    plan = launch.plan_processes(config, ["cpu", "cuda:0"], endpoints, python="py")
    assert plan.services["spec"] == ["py", "-m", "services.spec", "--endpoint", endpoints.spec]
    cpu, gpu = plan.workers["worker cpu"], plan.workers["worker cuda:0"]
    assert _flag(cpu, "--spec") == endpoints.spec and _flag(cpu, "--spec-max-tokens") == "5"
    # GPU workers do not speculate yet (their verification steps are not measured)
    assert "--spec" not in gpu
    off = launch.plan_processes(dataclasses.replace(config, spec="off"), ["cpu"], endpoints)
    assert "spec" not in off.services and "--spec" not in off.workers["worker cpu"]
    from shared.worker.config import parse_worker_args

    cfg = parse_worker_args(["--model", "/m", "--spec", "tcp://h:2", "--spec-max-tokens", "3"], "d")
    assert (cfg.spec, cfg.spec_max_tokens) == ("tcp://h:2", 3)


def test_prefill_and_decode_workers_split_over_devices() -> None:
    endpoints = Endpoints(*(f"tcp://127.0.0.1:{p}" for p in (5001, 5002, 5003, 5004)))
    args = build_parser().parse_args(
        ["serve", "/m.gguf", "--prefill-devices", "cuda:0", "--decode-devices", "cuda:0,cpu"]
    )
    config = ServeConfig.from_args(args)
    prefill, decode = launch.resolve_split(config)
    assert (prefill, decode) == (["cuda:0"], ["cuda:0", "cpu"])
    plan = launch.plan_processes(config, decode, endpoints, python="py", prefill=prefill)
    assert sorted(plan.workers) == ["decode cpu", "decode cuda:0", "prefill cuda:0"]
    assert plan.workers["prefill cuda:0"][:3] == ["py", "-m", "services.prefill"]
    assert plan.workers["decode cuda:0"][:3] == ["py", "-m", "services.decode"]
    # the hand-offs ride the kvcache's RAM tier: on for every worker, GPU ones included
    assert "kvcache" in plan.services
    assert all(_flag(w, "--kvcache") == "tcp://127.0.0.1:5003" for w in plan.workers.values())
    # speculation is the decode side's; a prefill worker never decodes
    assert "--spec" not in plan.workers["prefill cuda:0"]
    assert _flag(plan.workers["decode cpu"], "--spec") == "tcp://127.0.0.1:5004"
    # two CPU workers share the cores
    both = dataclasses.replace(config, prefill_devices="cpu", decode_devices="cpu")
    plan = launch.plan_processes(both, ["cpu"], endpoints, prefill=["cpu"])
    shares = {_flag(w, "--threads") for w in plan.workers.values()}
    assert shares == {str(max(1, cpu_count() // 2))}


@pytest.mark.parametrize(
    ("prefill", "decode"), [("cpu", ""), ("", "cuda:0"), ("auto", "cpu"), ("cpu", "cpu,cpu")]
)
def test_bad_role_splits_are_refused(prefill: str, decode: str) -> None:
    config = ServeConfig(Path("/m.gguf"), prefill_devices=prefill, decode_devices=decode)
    with pytest.raises(ValueError):
        launch.resolve_split(config)


def test_a_pipeline_is_one_worker_over_the_devices() -> None:
    endpoints = Endpoints(*(f"tcp://127.0.0.1:{p}" for p in (5001, 5002, 5003, 5004)))
    args = build_parser().parse_args(
        [
            "serve",
            "/m.gguf",
            "--devices",
            "cuda:0,cpu",
            "--layer-split",
            "20,12",
            "--memory-gib",
            "20,12",
        ]
    )
    config = ServeConfig.from_args(args)
    assert config.pipeline and config.layer_split == "20,12"  # a split implies --pipeline
    devices = launch.resolve_devices(config.devices, _no_cuda, repeats=config.pipeline)
    plan = launch.plan_processes(config, devices, endpoints, python="py")
    assert list(plan.workers) == ["pipeline cuda:0+cpu"]
    worker = plan.workers["pipeline cuda:0+cpu"]
    assert _flag(worker, "--device") == "cuda:0"
    assert _flag(worker, "--stages") == "cpu"
    assert _flag(worker, "--layer-split") == "20,12"
    assert _flag(worker, "--memory-gib") == "20,12"
    # the KV tiers hold one pool's layers: not a pipeline's yet
    cpu = dataclasses.replace(config, devices="cpu,cpu", layer_split="")
    plan = launch.plan_processes(cpu, ["cpu", "cpu"], endpoints, python="py")
    assert "kvcache" not in plan.services and "--kvcache" not in plan.workers["pipeline cpu+cpu"]
    # two stages on one device: repeats are a pipeline's only
    assert launch.resolve_devices("cpu,cpu", _no_cuda, repeats=True) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="twice"):
        launch.resolve_devices("cpu,cpu", _no_cuda)


def test_spec_draft_starts_the_spec_service_with_the_draft_and_the_target(tmp_path: Path) -> None:
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    endpoints = Endpoints(*(f"tcp://127.0.0.1:{p}" for p in (5001, 5002, 5003, 5004)))
    args = build_parser().parse_args(["serve", "/m.gguf", "--spec", f"draft:{draft}"])
    config = ServeConfig.from_args(args)
    assert config.spec == f"draft:{draft}"
    plan = launch.plan_processes(config, ["cpu"], endpoints, python="py")
    argv = plan.services["spec"]
    assert argv[:5] == ["py", "-m", "services.spec", "--endpoint", endpoints.spec]
    assert _flag(argv, "--draft") == str(draft) and _flag(argv, "--target") == "/m.gguf"
    worker = plan.workers["worker cpu"]
    # the worker waits for a draft model's guesses longer than for the n-grams'
    assert _flag(worker, "--spec") == endpoints.spec and _flag(worker, "--spec-wait-ms") == "300"
    for bad in ("draft:", "draft:/no/such.gguf", "lookup"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "/m.gguf", "--spec", bad])
