"""`skiff serve` (shared.launch): device choice, command lines, refusals, and end to end (the
real gateway and worker on SmolLM2). Supervision: tests/test_launch_supervise.py."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shared import launch
from shared.cli import build_parser
from shared.launch import Endpoints, ServeConfig

ROOT = Path(__file__).resolve().parent.parent
_PID = re.compile(r"started (.+?) \(pid (\d+)\)")


def _no_cuda() -> int:
    raise AssertionError("an explicit device list must not look for CUDA devices")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- devices --------------------------------------------------------------------------------------


def test_auto_without_cuda_is_one_cpu_worker() -> None:
    assert launch.resolve_devices("auto", lambda: 0) == ["cpu"]


def test_auto_takes_every_cuda_device() -> None:
    assert launch.resolve_devices("auto", lambda: 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert launch.resolve_devices("cuda", lambda: 2) == ["cuda:0", "cuda:1"]


def test_explicit_devices_are_taken_as_given() -> None:
    assert launch.resolve_devices("cpu", _no_cuda) == ["cpu"]
    assert launch.resolve_devices("cuda:0,cuda:1", _no_cuda) == ["cuda:0", "cuda:1"]
    assert launch.resolve_devices(" cuda:1 , cpu ", _no_cuda) == ["cuda:1", "cpu"]


@pytest.mark.parametrize("spec", ["", "tpu", "cuda:x", "gpu0", "cuda:0,cuda:0", "cpu,,cpu"])
def test_bad_device_lists_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--devices"):
        launch.resolve_devices(spec, _no_cuda)


def test_cuda_without_a_cuda_device_is_refused() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        launch.resolve_devices("cuda", lambda: 0)


# -- command lines --------------------------------------------------------------------------------


def test_serve_flags_build_the_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", str(tmp_path / "m.gguf"), "--port", "9001", "--devices", "cpu"]
        + ["--api-key", "a", "--api-key", "b", "--dtype", "bfloat16", "--max-model-len", "512"]
        + ["--kv-dtype", "fp8", "--kv-scales", "head"]
    )
    config = ServeConfig.from_args(args)
    assert config.kv_dtype == "fp8"  # W2/W3's FP8 configuration: `skiff serve --kv-dtype fp8`
    assert config.kv_scales == "head"
    assert config.model == tmp_path / "m.gguf"
    assert (config.host, config.port, config.devices) == ("127.0.0.1", 9001, "cpu")
    assert config.api_keys == ("a", "b")
    assert (config.dtype, config.max_model_len, config.kv_blocks) == ("bfloat16", 512, None)
    assert config.model_name == "m"


def test_gateway_and_worker_commands_agree_on_ports() -> None:
    config = ServeConfig(
        model=Path("/m/SmolLM2-135M-Instruct.Q4_1.gguf"), port=8123, api_keys=("k1", "k2")
    )
    endpoints = Endpoints("tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002")
    plan = launch.plan_processes(config, ["cpu", "cuda:1"], endpoints, python="py")

    gw = plan.gateway
    assert gw[:3] == ["py", "-m", "services.gateway"]
    assert _flag(gw, "--model") == "/m/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (_flag(gw, "--host"), _flag(gw, "--port")) == ("127.0.0.1", "8123")
    assert _flag(gw, "--worker-bind") == "tcp://127.0.0.1:5001"
    assert _flag(gw, "--tokens-bind") == "tcp://127.0.0.1:5002"
    assert _flag(gw, "--served-model-name") == "SmolLM2-135M-Instruct.Q4_1"
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--api-key"] == ["k1", "k2"]

    assert list(plan.workers) == ["worker cpu", "worker cuda:1"]
    for device, argv in zip(["cpu", "cuda:1"], plan.workers.values(), strict=True):
        assert argv[:3] == ["py", "-m", "services.decode"]
        assert _flag(argv, "--device") == device
        assert _flag(argv, "--model") == _flag(gw, "--model")
        assert _flag(argv, "--gateway") == _flag(gw, "--worker-bind")
        assert _flag(argv, "--gateway-tokens") == _flag(gw, "--tokens-bind")
        # Unset options are left to the worker's defaults.
        assert "--dtype" not in argv and "--kv-blocks" not in argv
    assert plan.health_url == "http://127.0.0.1:8123/health"
    assert plan.api_url == "http://127.0.0.1:8123/v1"


def test_worker_options_are_passed_on() -> None:
    config = ServeConfig(
        model=Path("/m.gguf"), dtype="float16", max_model_len=1024, kv_blocks=64,
        max_batch_tokens=256, overlap=True, step_target_ms=20.0, dense_copies="off",
        kv_dtype="fp8", kv_scales="head",
    )  # fmt: skip
    plan = launch.plan_processes(config, ["cpu"], launch.local_endpoints())
    argv = plan.workers["worker cpu"]
    assert _flag(argv, "--dtype") == "float16"
    assert _flag(argv, "--max-model-len") == "1024"
    assert _flag(argv, "--kv-blocks") == "64"
    assert _flag(argv, "--max-batch-tokens") == "256"
    assert "--overlap" in argv
    assert _flag(argv, "--step-target-ms") == "20.0"
    assert _flag(argv, "--dense-copies") == "off"
    assert _flag(argv, "--kv-dtype") == "fp8"
    assert _flag(argv, "--kv-scales") == "head"
    # the worker accepts what the plan passes
    from shared.worker.config import parse_worker_args

    assert parse_worker_args(["--model", "/m.gguf", "--kv-dtype", "fp8"], "d").kv_dtype == "fp8"
    worker = parse_worker_args(["--model", "/m.gguf", "--kv-scales", "head"], "d")
    assert worker.kv_scales == "head"
    assert parse_worker_args(["--model", "/m.gguf"], "d").kv_scales == "token"  # the default

    assert parse_worker_args(["--model", "/m.gguf", "--overlap"], "decode").overlap
    assert parse_worker_args(["--model", "/m.gguf"], "decode").overlap  # the default
    assert not parse_worker_args(["--model", "/m.gguf", "--no-overlap"], "decode").overlap
    assert parse_worker_args(["--model", "/m.gguf"], "decode").max_batch_tokens == 512
    off = dataclasses.replace(config, overlap=False)
    assert (
        "--no-overlap"
        in launch.plan_processes(off, ["cpu"], launch.local_endpoints()).workers["worker cpu"]
    )
    assert parse_worker_args(["--model", "/m.gguf"], "decode").dense_copies == "auto"
    assert parse_worker_args(["--model", "/m", "--dense-copies", "off"], "d").dense_copies == "off"


def test_the_kvcache_service_and_its_tiers() -> None:
    endpoints = Endpoints("tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002", "tcp://127.0.0.1:5003")
    config = ServeConfig(Path("/m.gguf"), kv_ram_gb=2.5, kv_disk_dir="/d")
    plan = launch.plan_processes(config, ["cpu"], endpoints, python="py")
    kv = plan.services["kvcache"]
    assert kv[:3] == ["py", "-m", "services.kvcache"]
    assert _flag(kv, "--endpoint") == "tcp://127.0.0.1:5003"
    assert (_flag(kv, "--ram-gb"), _flag(kv, "--disk-dir")) == ("2.5", "/d")
    assert "--disk-gb" not in kv  # its default
    assert _flag(plan.workers["worker cpu"], "--kvcache") == "tcp://127.0.0.1:5003"
    from shared.worker.config import parse_worker_args

    assert (
        parse_worker_args(["--model", "/m", "--kvcache", "tcp://h:1"], "d").kvcache == "tcp://h:1"
    )
    # both tiers off: no service, and the workers use their pools alone
    off = launch.plan_processes(
        dataclasses.replace(config, kv_ram_gb=0, kv_disk_gb=0), ["cpu"], endpoints
    )
    assert "kvcache" not in off.services and "--kvcache" not in off.workers["worker cpu"]
    # GPU workers do not use them yet (their copies are not measured); without a CPU worker
    # no kvcache starts
    mixed = launch.plan_processes(config, ["cpu", "cuda:0"], endpoints)
    assert "--kvcache" in mixed.workers["worker cpu"]
    assert "--kvcache" not in mixed.workers["worker cuda:0"]
    assert "kvcache" not in launch.plan_processes(config, ["cuda:0"], endpoints).services


def test_wildcard_hosts_print_a_reachable_url() -> None:
    endpoints = launch.local_endpoints()
    plan = launch.plan_processes(ServeConfig(Path("/m.gguf"), host="0.0.0.0"), ["cpu"], endpoints)
    assert plan.api_url == "http://127.0.0.1:8000/v1"
    assert _flag(plan.gateway, "--host") == "0.0.0.0"
    plan = launch.plan_processes(ServeConfig(Path("/m.gguf"), host="::"), ["cpu"], endpoints)
    assert plan.api_url == "http://[::1]:8000/v1"


def test_local_endpoints_are_two_distinct_loopback_ports() -> None:
    e = launch.local_endpoints()
    ports = {int(e.worker.rsplit(":", 1)[1]), int(e.tokens.rsplit(":", 1)[1])}
    assert len(ports) == 2 and all(p > 0 for p in ports)
    assert e.worker.startswith("tcp://127.0.0.1:") and e.tokens.startswith("tcp://127.0.0.1:")


def test_cli_does_not_import_torch() -> None:
    code = "import sys, shared.cli, shared.launch; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


# -- refusals before anything starts --------------------------------------------------------------


def _serve_quietly(config: ServeConfig) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = launch.serve(config, out, err, cuda_count=_no_cuda)
    assert out.getvalue() == ""
    return rc, err.getvalue()


def test_missing_model_is_refused(tmp_path: Path) -> None:
    rc, err = _serve_quietly(ServeConfig(tmp_path / "absent.gguf", devices="cpu"))
    assert rc == 2 and "no such model file" in err


def test_busy_port_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, err = _serve_quietly(ServeConfig(model, port=port, devices="cpu"))
    assert rc == 2 and f"127.0.0.1:{port} is in use" in err


def test_bad_devices_are_refused(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    rc, err = _serve_quietly(ServeConfig(model, port=_free_port(), devices="tpu:0"))
    assert rc == 2 and "not cpu or cuda:N" in err


# -- end to end -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_skiff_serve_answers_a_chat_completion_and_stops_on_sigint(tmp_path: Path) -> None:
    model = os.environ.get("SKIFF_SMOLLM2")
    if not model or not Path(model).exists():
        pytest.skip("SmolLM2 is missing: run `make models` (or set SKIFF_SMOLLM2)")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "serve", model, "--port", str(port)]
        + [
            "--devices",
            "cpu",
            "--stop-timeout",
            "10",
            "--kv-disk-dir",
            str(tmp_path),
            "--kv-ram-gb",
            "0.25",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()

    def pids() -> list[int]:
        return [int(m.group(2)) for line in seen if (m := _PID.search(line))]

    try:
        url, deadline = None, time.monotonic() + 120
        while url is None:
            assert time.monotonic() < deadline, "no URL in 120 s:\n" + "".join(seen)
            assert proc.poll() is None, "skiff serve exited:\n" + "".join(seen)
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            if m := re.search(r"Skiff is serving (\S+) at (http://\S+)", seen[-1]):
                name, url = m.group(1), m.group(2)
        assert name == "SmolLM2-135M-Instruct.Q4_1"
        assert len(pids()) == 4  # the gateway, the kvcache, the spec service and one CPU worker

        body = {
            "model": name,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                status, reply = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            status, reply = e.code, e.read().decode(errors="replace")
        while not lines.empty():
            seen.append(lines.get())
        assert status == 200, f"{reply}\n" + "".join(seen)
        assert reply["choices"][0]["message"]["content"].strip()

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        alive = [p for p in pids() if _alive(p)]
        assert not alive, f"children still running after SIGINT: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
