"""compose.yaml, compose.gpu.yaml and the Dockerfile against the CLIs they start.

Docker cannot run here, so every command the containers would run is run with `--help` appended
instead: it must exit 0 without importing torch (a stand-in `torch` that raises is put first on
the path) and its help must list every flag compose passes, so compose cannot drift from the CLIs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools.fetch_models import SMOLLM2

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
DOCKERFILE = ROOT / "Dockerfile"
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _interpolate(value: str) -> str:
    # As compose does for ${VAR:-default}, with this process's environment as the shell's.
    return _VAR.sub(lambda m: os.environ.get(m.group(1)) or m.group(2) or "", value)


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in (COMPOSE, COMPOSE_GPU):
        for name, service in _load(path)["services"].items():
            if "command" in service:
                argv = [_interpolate(str(a)) for a in service["command"]]
                found.append((f"{path.name}:{name}", argv))
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("CMD "):
            found.append(("Dockerfile:CMD", json.loads(line.removeprefix("CMD "))))
    return found


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_services_volume_and_scalable_decode() -> None:
    compose = _load(COMPOSE)
    services = compose["services"]
    assert {"gateway", "prefill", "decode"} <= set(services)
    assert "models" in compose["volumes"]
    for name in ("gateway", "prefill", "decode"):
        assert any(str(v).startswith("models:/models") for v in services[name]["volumes"]), name
    decode = services["decode"]
    assert "container_name" not in decode and "ports" not in decode
    assert "container_name" not in services["prefill"] and "ports" not in services["prefill"]
    assert any(str(p).endswith(":8000") for p in services["gateway"]["ports"])


def test_workers_share_the_kvcache_segment_and_reach_its_endpoint() -> None:
    services = _load(COMPOSE)["services"]
    kv = services["kvcache"]
    assert kv["ipc"] == "shareable" and any(str(v).startswith("kvcache:") for v in kv["volumes"])
    port = _flag(kv["command"], "--endpoint").rsplit(":", 1)[1]
    for name in ("prefill", "decode"):
        assert services[name]["ipc"] == "service:kvcache", name
        assert _flag(services[name]["command"], "--kvcache") == f"tcp://kvcache:{port}", name


def test_decode_workers_reach_the_spec_service_and_every_worker_the_kvcache() -> None:
    services = _load(COMPOSE)["services"]
    port = _flag(services["spec"]["command"], "--endpoint").rsplit(":", 1)[1]
    assert _flag(services["decode"]["command"], "--spec") == f"tcp://spec:{port}"
    assert "spec" in services["decode"]["depends_on"]
    assert "--spec" not in services["prefill"]["command"]  # a prefill worker never decodes
    kv_port = _flag(services["kvcache"]["command"], "--endpoint").rsplit(":", 1)[1]
    # the prompts' blocks move from prefill to decode workers through the kvcache's RAM tier
    for compose in (COMPOSE, COMPOSE_GPU):
        for name in ("prefill", "decode"):
            command = _load(compose)["services"][name]["command"]
            assert _flag(command, "--kvcache") == f"tcp://kvcache:{kv_port}", (compose, name)


def test_workers_reach_the_gateway_by_service_name() -> None:
    services = _load(COMPOSE)["services"]
    gateway = services["gateway"]["command"]
    assert _flag(gateway, "--host") == "0.0.0.0"
    worker_port = _flag(gateway, "--worker-bind").rsplit(":", 1)[1]
    tokens_port = _flag(gateway, "--tokens-bind").rsplit(":", 1)[1]
    assert _flag(gateway, "--worker-bind") == f"tcp://0.0.0.0:{worker_port}"
    assert _flag(gateway, "--tokens-bind") == f"tcp://0.0.0.0:{tokens_port}"
    for name in ("prefill", "decode"):
        argv = services[name]["command"]
        assert _flag(argv, "--gateway") == f"tcp://gateway:{worker_port}", name
        assert _flag(argv, "--gateway-tokens") == f"tcp://gateway:{tokens_port}", name


def test_default_model_is_the_one_the_models_service_fetches() -> None:
    services = _load(COMPOSE)["services"]
    models = services["models"]["command"]
    assert models[:3] == ["python", "-m", "tools.fetch_models"] and "/models" in models
    saved = os.environ.pop("SKIFF_MODEL", None)
    try:
        for name in ("gateway", "prefill", "decode"):
            model = _interpolate(_flag(services[name]["command"], "--model"))
            assert model == f"/models/{SMOLLM2[1]}", name
    finally:
        if saved is not None:
            os.environ["SKIFF_MODEL"] = saved
    assert f"SKIFF_MODEL=/models/{SMOLLM2[1]}" in DOCKERFILE.read_text()


def test_gpu_variant_reserves_an_nvidia_device() -> None:
    services = _load(COMPOSE_GPU)["services"]
    for name in ("prefill", "decode"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        assert re.fullmatch(r"cuda:\d+", _flag(services[name]["command"], "--device")), name
        assert "container_name" not in services[name] and "ports" not in services[name]


@pytest.fixture(scope="module")
def torchless_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    # A `torch` that cannot be imported: `--help` must answer before any torch import.
    shadow = tmp_path_factory.mktemp("torchless")
    (shadow / "torch").mkdir()
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('--help imported torch')\n")
    path = os.pathsep.join(p for p in (str(shadow), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


@pytest.mark.parametrize("where, argv", _commands(), ids=[w for w, _ in _commands()])
def test_command_matches_its_cli(where: str, argv: list[str], torchless_env: dict) -> None:
    assert argv[:2] == ["python", "-m"], f"{where}: expected `python -m MODULE ...`"
    module, args = argv[2], argv[3:]
    # The arguments go first, so that argparse also converts and checks their values.
    done = subprocess.run(
        [sys.executable, "-m", module, *[a for a in args if a != "--help"], "--help"],
        cwd=ROOT,
        env=torchless_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"{where}: `{module} --help` failed:\n{done.stderr}"
    for flag in (a for a in args if a.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", done.stdout), (
            f"{where}: {module} --help does not list {flag}"
        )
