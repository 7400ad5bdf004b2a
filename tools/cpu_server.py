"""`skiff serve MODEL --devices cpu` as a context manager for the CPU benchmarks (W3-cpu, W5):
started in its own process group, waited for until a worker is ready, stopped with SIGINT (then
SIGKILL) when the block ends; its output goes to a log file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"skiff serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if json.loads(r.read()).get("workers", 0) >= 1:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("no worker ready")


@contextmanager
def cpu_server(model: Path, port: int, args: tuple[str, ...], log: Path) -> Iterator[str]:
    """Yields the server's URL."""
    argv = [sys.executable, "-m", "shared.cli", "serve", str(model), "--devices", "cpu",
            "--port", str(port), *args]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
