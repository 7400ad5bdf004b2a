"""A fresh machine's first command: `make serve` builds the runtime environment alone (no [test]
extra: no llama.cpp, no pytest) in a new virtual environment, starts every role and answers a
chat request. Every package a role imports at run time must be a runtime dependency."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

from tests.cluster import ROOT, free_port, http_json

_START_S = 900  # a new venv installs torch and the rest (pip's cache makes it ~1-2 min)


def _clean_env() -> dict:
    # make's own variables would join the outer `make test`; the test's venv must not leak in
    drop = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "VIRTUAL_ENV", "PYTHONPATH", "TRITON_INTERPRET"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_make_serve_from_runtime_install(tmp_path, smollm2_path):
    venv, port = tmp_path / "venv", free_port()
    cmd = ["make", "-C", str(ROOT), "serve", f"VENV={venv}", f"PORT={port}"]
    cmd.append(f"MODELS={smollm2_path.parent}")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_clean_env(),
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if re.search(rf"http://127\.0\.0\.1:{port}/v1", line):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + _START_S
        while not ready.wait(1.0):
            assert proc.poll() is None, "make serve exited:\n" + "".join(lines[-40:])
            assert time.monotonic() < deadline, "no URL printed:\n" + "".join(lines[-40:])
        # the runtime install alone: the test oracles are absent from this environment
        probe = "import importlib.util as u; print(u.find_spec('llama_cpp'), u.find_spec('pytest'))"
        found = subprocess.run(
            [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
        )
        assert found.stdout.split() == ["None", "None"], found.stdout
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        status, reply = http_json(f"http://127.0.0.1:{port}/v1/chat/completions", body, timeout=120)
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"].strip(), reply
        assert reply["usage"]["completion_tokens"] >= 1, reply
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
