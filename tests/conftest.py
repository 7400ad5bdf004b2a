"""Shared fixtures: the real models (fetched by `make models`) and synthetic models (written here,
quantized by llama.cpp, cached under .models/synthetic)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.interpreter_speed import speed_up_interpreter
from tests.tiers import mark_exhaustive

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("SKIFF_MODELS_DIR", ROOT / ".models"))


REAL_MODELS = {
    "SKIFF_SMOLLM2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "SKIFF_GEMMA3": "gemma3-270m-q4_k_m.gguf",
}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        speed_up_interpreter()
    # Every test module finds the real models through these variables; default them to the
    # files `make models` fetched.
    for env, filename in REAL_MODELS.items():
        if not os.environ.get(env) and (MODELS / filename).exists():
            os.environ[env] = str(MODELS / filename)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks this adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_exhaustive(items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # SKIFF_TEST_TIMES=FILE: one line per test phase as it ends (seconds, outcome, test id), so a
    # run cut off by a device call's time limit still shows where its time went.
    # Under pytest-xdist the controller writes them (it gets every worker's reports too).
    path = os.environ.get("SKIFF_TEST_TIMES")
    worker = "PYTEST_XDIST_WORKER" in os.environ
    if path and not worker and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(f"{report.duration:8.2f} {report.outcome:7} {report.nodeid}\n")


def _model(env: str, filename: str) -> Path:
    path = Path(os.environ.get(env) or MODELS / filename)
    if not path.exists():
        pytest.skip(f"{path} is missing: run `make models` (or set {env})")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model("SKIFF_SMOLLM2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _model("SKIFF_GEMMA3", "gemma3-270m-q4_k_m.gguf")


@pytest.fixture(scope="session")
def synthetic_dir() -> Path:
    d = MODELS / "synthetic"
    d.mkdir(parents=True, exist_ok=True)
    return d
