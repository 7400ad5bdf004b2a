"""`skiff serve MODEL.gguf`: every Skiff role as a process on this machine.

Owns what one-machine serving needs around the services themselves: which devices get a worker,
the free ports that join the gateway and the workers, the command line of each process, their
output (every line prefixed with the process's name), readiness (the gateway's /health), and
shutdown (terminate, then kill). The services are started exactly as compose.yaml starts them
(`python -m services.gateway`, `python -m services.decode`), so both paths run the same code.

Imports no torch: CUDA devices are counted in a short-lived subprocess, so the supervisor holds
neither torch's memory nor a CUDA context while the workers own the devices.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

DTYPES = ("float32", "float16", "bfloat16")
_DEVICE = re.compile(r"cpu|cuda:\d+")
# The checkout this module runs from; children get it on PYTHONPATH so that they run the same code
# as the launcher even when it was started from another directory.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ServeConfig:
    """Everything `skiff serve` was asked for, built once from its flags."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 8000
    devices: str = "auto"  # auto | cpu | cuda | comma-separated cpu / cuda:N
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    dtype: str | None = None  # None: each worker's default
    max_model_len: int | None = None
    kv_blocks: int | None = None
    max_batch_tokens: int | None = None
    stop_timeout_s: float = 10.0  # SIGTERM to SIGKILL

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name.removesuffix(".gguf")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        return cls(
            model=Path(args.model).expanduser().resolve(),
            host=args.host,
            port=args.port,
            devices=args.devices,
            api_keys=tuple(args.api_key or ()),
            served_model_name=args.served_model_name,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            kv_blocks=args.kv_blocks,
            max_batch_tokens=args.max_batch_tokens,
            stop_timeout_s=args.stop_timeout,
        )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--devices",
        default="auto",
        help="auto (every CUDA device, else the CPU), cpu, cuda, or a list such as cuda:0,cuda:1",
    )
    p.add_argument("--api-key", action="append", help="accepted bearer token; repeat for several")
    p.add_argument("--served-model-name", default=None, help="model name of the API")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="activation dtype of workers")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit per request")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="token budget per step")
    p.add_argument(
        "--stop-timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL"
    )


# -- devices --------------------------------------------------------------------------------------


def count_cuda_devices(timeout_s: float = 120.0) -> int:
    """CUDA devices torch sees, asked of a subprocess (0 when torch or CUDA is unusable)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return 0


def resolve_devices(spec: str, cuda_count: Callable[[], int] = count_cuda_devices) -> list[str]:
    """One device name per worker. `cuda_count` is only called when the spec needs it."""
    spec = spec.strip().lower()
    if spec in ("auto", "cuda"):
        n = cuda_count()
        if n == 0 and spec == "cuda":
            raise ValueError("--devices cuda: torch sees no CUDA device")
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError("--devices is empty")
    for d in devices:
        if not _DEVICE.fullmatch(d):
            raise ValueError(f"--devices: {d!r} is not cpu or cuda:N")
    if len(set(devices)) != len(devices):
        # Two workers on one device would each size their KV pool from the same free memory.
        raise ValueError(f"--devices names a device twice: {spec}")
    return devices


# -- processes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    """The gateway's two ZMQ sockets, which it binds and every worker connects to."""

    worker: str  # ROUTER: requests down, ready/heartbeats up
    tokens: str  # PULL: token batches up


def local_endpoints(host: str = "127.0.0.1") -> Endpoints:
    # Both sockets are held open together so that the OS cannot hand out one port twice.
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for s in socks:
            s.bind((host, 0))
        a, b = (s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()
    return Endpoints(worker=f"tcp://{host}:{a}", tokens=f"tcp://{host}:{b}")


@dataclass(frozen=True)
class Plan:
    """The processes to start: argv of the gateway and of each named worker."""

    gateway: list[str]
    workers: dict[str, list[str]]
    health_url: str
    api_url: str
    model_name: str


def _url_host(host: str) -> str:
    # A wildcard address is where the server listens, not where a client can reach it.
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def plan_processes(
    config: ServeConfig, devices: list[str], endpoints: Endpoints, python: str = sys.executable
) -> Plan:
    model = str(config.model)
    gateway = [
        python, "-m", "services.gateway",
        "--model", model,
        "--host", config.host,
        "--port", str(config.port),
        "--worker-bind", endpoints.worker,
        "--tokens-bind", endpoints.tokens,
        # Always named, so that the name printed with the URL is the name the API accepts.
        "--served-model-name", config.model_name,
    ]  # fmt: skip
    for key in config.api_keys:
        gateway += ["--api-key", key]
    optional = {
        "--dtype": config.dtype,
        "--max-model-len": config.max_model_len,
        "--kv-blocks": config.kv_blocks,
        "--max-batch-tokens": config.max_batch_tokens,
    }
    extra = [s for flag, v in optional.items() if v is not None for s in (flag, str(v))]
    workers = {
        f"worker {d}": [
            python,
            "-m",
            "services.decode",
            "--model",
            model,
            "--device",
            d,
            "--gateway",
            endpoints.worker,
            "--gateway-tokens",
            endpoints.tokens,
            *extra,
        ]  # fmt: skip
        for d in devices
    }
    base = f"http://{_url_host(config.host)}:{config.port}"
    return Plan(gateway, workers, f"{base}/health", f"{base}/v1", config.model_name)


class Console:
    """Where the launcher and its children write; one lock so that lines never interleave."""

    def __init__(self, out: TextIO, err: TextIO, width: int = 8) -> None:
        self.out, self.err, self.width = out, err, width
        self._lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        # A closed terminal must not stop the copying: a child whose pipe fills up would block.
        with self._lock, contextlib.suppress(OSError, ValueError):
            self.err.write(f"{name:<{self.width}} | {text}\n")
            self.err.flush()

    def say(self, text: str) -> None:
        self.line("skiff", text)

    def announce(self, text: str) -> None:
        with self._lock:
            self.out.write(text + "\n")
            self.out.flush()


class Child:
    """One subprocess in its own process group; its output is copied to the console by a thread."""

    def __init__(self, name: str, argv: list[str], console: Console, env: dict[str, str]) -> None:
        self.name = name
        # Own process group: the terminal's Ctrl-C reaches only the launcher, which then stops
        # every child (SIGTERM, then SIGKILL); signalling the group reaches what a child started.
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
        )
        self._pump = threading.Thread(target=self._copy, args=(console,), daemon=True)
        self._pump.start()

    def _copy(self, console: Console) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            # Progress bars redraw with \r; the last redraw is the news.
            text = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
            console.line(self.name, text)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited since poll()
                os.killpg(self.proc.pid, sig)

    def drain(self, timeout_s: float = 2.0) -> None:
        self._pump.join(timeout_s)


def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if (_SOURCE_ROOT / "pyproject.toml").exists():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_SOURCE_ROOT), env.get("PYTHONPATH", "")) if p
        )
    return env


def ready_workers(health_url: str, timeout_s: float = 1.0) -> int | None:
    """The gateway's count of ready workers; None while it does not answer."""
    try:
        with urllib.request.urlopen(health_url, timeout=timeout_s) as r:
            body = r.read()
    except urllib.error.HTTPError as e:  # 503 until a worker is ready, with the same body
        body = e.read()
    except (OSError, ValueError):
        return None
    try:
        return int(json.loads(body).get("workers", 0))
    except (ValueError, TypeError, AttributeError):
        return None


# -- supervision ----------------------------------------------------------------------------------


@dataclass
class _State:
    ready: int = 0
    announced: bool = False
    exited: set[str] = field(default_factory=set)


def supervise(
    plan: Plan,
    stop: threading.Event,
    console: Console,
    stop_timeout_s: float,
    hurry: threading.Event | None = None,
) -> int:
    """Runs the plan until `stop` is set (0) or the gateway exits (its code, at least 1).

    Stopping sends SIGTERM to every child and SIGKILL to those alive `stop_timeout_s` later, or
    at once when `hurry` is set (a second Ctrl-C).
    """
    env = _child_env()
    children: list[Child] = []
    try:
        gateway = Child("gateway", plan.gateway, console, env)
        children.append(gateway)
        console.say(f"started gateway (pid {gateway.proc.pid})")
        workers: list[Child] = []
        for name, argv in plan.workers.items():
            workers.append(Child(name, argv, console, env))
            children.append(workers[-1])
            console.say(f"started {name} (pid {workers[-1].proc.pid})")
        return _watch(plan, gateway, workers, stop, console)
    finally:
        _stop_all(children, console, stop_timeout_s, hurry or threading.Event())


def _watch(
    plan: Plan, gateway: Child, workers: list[Child], stop: threading.Event, console: Console
) -> int:
    state = _State()
    next_poll = 0.0
    while not stop.wait(0.2):
        rc = gateway.proc.poll()
        if rc is not None:
            console.say(f"the gateway exited with code {rc}; stopping the workers")
            return rc if rc > 0 else 1
        for w in workers:
            wrc = w.proc.poll()
            if wrc is None or w.name in state.exited:
                continue
            state.exited.add(w.name)
            alive = len(workers) - len(state.exited)
            console.say(
                f"{w.name} exited with code {wrc}; the gateway keeps serving with {alive} worker(s)"
                if alive
                else f"{w.name} exited with code {wrc}; no worker is left, requests fail until "
                "one connects to the gateway"
            )
        if not state.announced and len(state.exited) == len(workers):
            console.say("every worker exited before one was ready; stopping")
            return 1
        # Polled until every worker has been ready once; later changes the gateway logs itself,
        # and polling on would fill its access log.
        loading = state.ready < len(workers) - len(state.exited)
        if loading and time.monotonic() >= next_poll:
            _poll_health(plan, len(workers), state, console)
            next_poll = time.monotonic() + 0.5
    console.say("stopping")
    return 0


def _poll_health(plan: Plan, n_workers: int, state: _State, console: Console) -> None:
    n = ready_workers(plan.health_url)
    if n is None or n == state.ready:
        return
    console.say(f"workers ready: {n}/{n_workers}")
    state.ready = n
    if n > 0 and not state.announced:
        state.announced = True
        console.announce(f"Skiff is serving {plan.model_name} at {plan.api_url}")


def _stop_all(
    children: list[Child], console: Console, timeout_s: float, hurry: threading.Event
) -> None:
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
        if hurry.wait(0.1):
            break
    for c in children:
        if c.proc.poll() is None:
            console.say(f"{c.name} is still running after SIGTERM; killing it")
            c.signal(signal.SIGKILL)
        c.proc.wait()
    for c in children:
        c.drain()


# -- entry point ----------------------------------------------------------------------------------


def _port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the server will: a port held only by TIME_WAIT connections is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def serve(
    config: ServeConfig,
    out: TextIO | None = None,
    err: TextIO | None = None,
    cuda_count: Callable[[], int] = count_cuda_devices,
) -> int:
    """`skiff serve`: 0 once a signal stops it; non-zero if it cannot start or the gateway dies."""
    console = Console(out or sys.stdout, err or sys.stderr, width=len("worker cuda:0"))
    if not config.model.is_file():
        console.say(f"error: no such model file: {config.model}")
        return 2
    if not _port_is_free(config.host, config.port):
        console.say(f"error: {config.host}:{config.port} is in use; pass another --port")
        return 2
    if config.devices.strip().lower() in ("auto", "cuda"):
        console.say("looking for CUDA devices")
    try:
        devices = resolve_devices(config.devices, cuda_count)
    except ValueError as e:
        console.say(f"error: {e}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C while torch looks for devices: nothing started yet
        return 130
    console.say(f"{config.model.name}: {len(devices)} worker(s), on {', '.join(devices)}")
    plan = plan_processes(config, devices, local_endpoints())
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        (hurry if stop.is_set() else stop).set()

    # SIGHUP too: the children sit in their own process groups, so a closed terminal reaches
    # only the launcher, which must not leave them running.
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in handled}
    try:
        return supervise(plan, stop, console, config.stop_timeout_s, hurry)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
