"""Starts real Skiff processes (gateway + workers) on free local ports for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE = os.environ.get("SKIFF_TEST_DEVICE", "cpu")  # cuda:0 runs the same tests on a GPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(
    url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 60
) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def start_service(module: str, *args: str) -> subprocess.Popen:
    """`python -m module args` (a service that logs a ready line to stderr), returned once that
    line is out; its log goes on to this process's stderr (pytest shows it with a failure)."""
    argv = [sys.executable, "-m", module, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines = [proc.stderr.readline()]
    while "ready" not in lines[-1] and lines[-1] and len(lines) < 20:
        lines.append(proc.stderr.readline())
    assert "ready" in lines[-1], "".join(lines)
    echo = proc.stderr
    threading.Thread(target=lambda: [sys.stderr.write(x) for x in echo], daemon=True).start()
    return proc


@dataclass
class Cluster:
    model: Path
    n_workers: int = 1
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    ctrl: int = field(default_factory=free_port)
    tokens: int = field(default_factory=free_port)
    gateway: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(os.environ.get("TMPDIR", "/tmp")))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict:
        # one torch thread per worker: several workers share this machine's cores
        return {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self) -> Cluster:
        self.gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.gateway",
                "--model",
                str(self.model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-bind",
                f"tcp://127.0.0.1:{self.ctrl}",
                "--tokens-bind",
                f"tcp://127.0.0.1:{self.tokens}",
                *self.gateway_args,
            ],
            cwd=ROOT,
            env=self._env(),
        )
        for _ in range(self.n_workers):
            self.start_worker()
        if self.n_workers:
            self.wait_workers(self.n_workers)
        return self

    def start_worker(
        self, module: str = "services.decode", args: tuple[str, ...] = ()
    ) -> subprocess.Popen:
        """`python -m module` (a worker role) with the cluster's worker args, then `args`."""
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--model",
                str(self.model),
                "--device",
                "cpu",
                "--gateway",
                f"tcp://127.0.0.1:{self.ctrl}",
                "--gateway-tokens",
                f"tcp://127.0.0.1:{self.tokens}",
                *self.worker_args,
                *args,
                # e.g. SKIFF_TEST_WORKER_ARGS=--overlap runs the suite with overlapped steps
                *os.environ.get("SKIFF_TEST_WORKER_ARGS", "").split(),
            ],
            cwd=ROOT,
            env=self._env(),
        )
        self.workers.append(p)
        return p

    def health(self) -> tuple[int, dict]:
        try:
            return http_json(f"{self.url}/health", timeout=5)
        except OSError:
            return 0, {}

    def wait_workers(self, n: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, body = self.health()
            if status == 200 and body.get("workers") == n:
                return
            if self.gateway.poll() is not None:
                raise RuntimeError("the gateway exited")
            time.sleep(0.2)
        raise TimeoutError(f"{n} workers not ready after {timeout} s: {self.health()}")

    def stop(self) -> None:
        for p in [*self.workers, self.gateway]:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*self.workers, self.gateway]:
            if p is None:
                continue
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
