"""A pipeline stage on "another host": a stage server (shared.pipeline.stage_server) reached
over TCP, here on the loopback. It takes its part from stage 0's StageAssign, serves the ring,
and outlives the worker: a second worker assigns it another part. A server holding another
file, or a remote stage without a given split, is refused with the reason."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.engine import Sequence
from shared.engine.factory import EngineConfig, build_engine
from shared.pipeline.lead import StageLost
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    " * 4]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(model: Path | None = None) -> tuple[subprocess.Popen, str]:
    endpoint = f"tcp://127.0.0.1:{_port()}"
    argv = [sys.executable, "-m", "shared.pipeline.stage_server", "--serve", endpoint,
            "--device", "cpu", "--threads", "1"]  # fmt: skip
    if model is not None:
        argv += ["--model", str(model)]
    proc = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert "waiting at" in proc.stderr.readline()
    return proc, endpoint


def _engine(path: Path, stages=(), split=()):
    cfg = EngineConfig(model_path=str(path), kv_blocks=64, max_batch_tokens=32, stages=stages,
                       layer_split=split, stage_host="127.0.0.1")  # fmt: skip
    return build_engine(cfg)


def _generate(loaded) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0).validate()
    for i, p in enumerate(PROMPTS):
        loaded.engine.add(Sequence(i, loaded.tokenizer.encode(p), greedy, 8, frozenset(), None))
    out: list[list[int]] = [[] for _ in PROMPTS]
    while loaded.engine.has_work():
        for ev in loaded.engine.step():
            out[ev.seq_id].append(ev.token_id)
    return out


def test_a_remote_stage_serves_two_workers_in_turn(smollm2_path: Path) -> None:
    one = _engine(smollm2_path)
    try:
        want = _generate(one)
    finally:
        one.close()
    proc, endpoint = _server()
    try:
        # the same server, assigned anew; the last time behind a local stage (TCP both ways)
        for stages, split in (((endpoint,), (15, 15)), (("cpu", endpoint), (10, 10, 10))):
            piped = _engine(smollm2_path, stages, split)
            try:
                assert piped.pipeline.ready[-1].layers == [30 - split[-1], 30]
                assert _generate(piped) == want
            finally:
                piped.close()
        assert proc.poll() is None  # waiting for the next worker
    finally:
        proc.kill()
        proc.wait()


def test_a_server_with_another_file_is_refused(smollm2_path: Path, gemma3_path: Path) -> None:
    proc, endpoint = _server(gemma3_path)
    try:
        start = time.monotonic()
        with pytest.raises(StageLost, match=r"stage 1 \(tcp://.*\) failed: .* bytes"):
            _engine(smollm2_path, (endpoint,), (15, 15))
        assert time.monotonic() - start < 60
    finally:
        proc.kill()
        proc.wait()


def test_a_remote_stage_needs_a_split(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --layer-split"):
        _engine(smollm2_path, ("tcp://127.0.0.1:9",))


def test_skiff_serve_names_a_stage_server_after_the_first_device() -> None:
    from shared.launch import Endpoints, ServeConfig, plan_processes, resolve_devices

    devices = resolve_devices("cuda:0,tcp://gpu-box:5601", repeats=True)
    assert devices == ["cuda:0", "tcp://gpu-box:5601"]
    with pytest.raises(ValueError, match="tcp://HOST:PORT of a stage server"):
        resolve_devices("cuda:0,tcp://gpu-box:5601")  # not a pipeline
    with pytest.raises(ValueError, match="is not cpu or cuda:N"):
        resolve_devices("tcp://gpu-box:5601,cpu", repeats=True)  # stage 0 is this host's
    config = ServeConfig(Path("m.gguf"), pipeline=True, layer_split="16,16")
    ends = Endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    (argv,) = plan_processes(config, devices, ends).workers.values()
    assert argv[argv.index("--stages") + 1] == "tcp://gpu-box:5601"
