"""`skiff serve` supervision (shared.launch.supervise) against stand-in processes: a tiny HTTP
server answering /health as the gateway does, sleepers as workers, so no model is needed."""

from __future__ import annotations

import io
import re
import sys
import threading
import time
from pathlib import Path

from shared import launch
from shared.launch import Console, Plan
from tests.test_launch import _PID, _alive, _free_port

FAKE_GATEWAY = """
import http.server, json, sys, threading, time
port, workers, life, rc = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok" if workers else "loading", "workers": workers}).encode()
        self.send_response(200 if workers else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
print("fake gateway up", flush=True)
time.sleep(life)
sys.exit(rc)
"""


class _Run:
    """supervise() on a thread, with its console captured."""

    def __init__(self, plan: Plan, stop_timeout_s: float = 5.0) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()
        self.stop = threading.Event()
        self.rc: int | None = None
        console = Console(self.out, self.err, width=12)
        self._thread = threading.Thread(
            target=lambda: setattr(
                self, "rc", launch.supervise(plan, self.stop, console, stop_timeout_s)
            )
        )
        self._thread.start()

    def wait_for(self, text: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.err.getvalue() + self.out.getvalue():
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.err.getvalue()}"
            time.sleep(0.05)

    def join(self, timeout_s: float = 30.0) -> int:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "supervise() did not return"
        assert self.rc is not None
        return self.rc

    def pids(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in _PID.findall(self.err.getvalue())}


def _plan(tmp_path: Path, gateway: tuple[int, float, int], workers: dict[str, str]) -> Plan:
    script = tmp_path / "fake_gateway.py"
    script.write_text(FAKE_GATEWAY)
    port = _free_port()
    workers_ready, life_s, rc = gateway
    return Plan(
        gateway=[sys.executable, str(script), str(port), str(workers_ready), str(life_s), str(rc)],
        workers={name: [sys.executable, "-c", code] for name, code in workers.items()},
        health_url=f"http://127.0.0.1:{port}/health",
        api_url=f"http://127.0.0.1:{port}/v1",
        model_name="fake",
    )


SLEEPER = "import time; print('loading', flush=True); time.sleep(120)"


def test_gateway_exit_stops_the_workers_and_fails(tmp_path: Path) -> None:
    run = _Run(_plan(tmp_path, (1, 2.0, 3), {"worker a": SLEEPER}))
    rc = run.join()
    assert rc == 3
    assert "the gateway exited with code 3" in run.err.getvalue()
    assert re.fullmatch(
        r"Skiff is serving fake at http://127\.0\.0\.1:\d+/v1\n", run.out.getvalue()
    )
    err = run.err.getvalue()
    assert "gateway      | fake gateway up" in err and "worker a     | loading" in err
    pids = run.pids()
    assert set(pids) == {"gateway", "worker a"}
    assert not any(_alive(p) for p in pids.values())


def test_gateway_exiting_cleanly_still_fails(tmp_path: Path) -> None:
    run = _Run(_plan(tmp_path, (1, 0.5, 0), {"worker a": SLEEPER}))
    assert run.join() == 1


def test_dead_worker_is_reported_and_the_gateway_kept(tmp_path: Path) -> None:
    dies = "import sys, time; time.sleep(0.5); sys.exit(5)"
    run = _Run(_plan(tmp_path, (1, 120.0, 0), {"worker a": dies, "worker b": SLEEPER}))
    run.wait_for("worker a exited with code 5")
    run.wait_for("Skiff is serving fake")
    time.sleep(0.5)
    assert run.rc is None, "the launcher stopped although the gateway was serving"
    pids = run.pids()
    assert _alive(pids["gateway"]) and _alive(pids["worker b"])
    run.stop.set()
    assert run.join() == 0
    assert not any(_alive(p) for p in pids.values())


def test_every_worker_dead_before_ready_fails(tmp_path: Path) -> None:
    run = _Run(_plan(tmp_path, (0, 120.0, 0), {"worker a": "import sys; sys.exit(1)"}))
    assert run.join() == 1
    assert "every worker exited before one was ready" in run.err.getvalue()
    assert run.out.getvalue() == ""
    assert not any(_alive(p) for p in run.pids().values())


def test_child_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print('ignoring SIGTERM', flush=True); time.sleep(120)"
    )
    run = _Run(_plan(tmp_path, (1, 120.0, 0), {"worker a": stubborn}), stop_timeout_s=0.5)
    run.wait_for("ignoring SIGTERM")
    t0 = time.monotonic()
    run.stop.set()
    assert run.join() == 0
    assert time.monotonic() - t0 < 10
    assert "worker a is still running after SIGTERM; killing it" in run.err.getvalue()
    assert not any(_alive(p) for p in run.pids().values())
