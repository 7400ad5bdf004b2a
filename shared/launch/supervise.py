"""`skiff serve` at run time: the child processes, their prefixed output, readiness through the
gateway's /health, and shutdown (terminate, then kill)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TextIO

from shared.launch.devices import count_cuda_devices, resolve_devices
from shared.launch.fit import Layout, ask
from shared.launch.plan import (
    _SOURCE_ROOT,
    Plan,
    ServeConfig,
    local_endpoints,
    plan_processes,
    resolve_split,
)


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
        services = [Child(name, argv, console, env) for name, argv in plan.services.items()]
        for c in services:
            children.append(c)
            console.say(f"started {c.name} (pid {c.proc.pid})")
        workers: list[Child] = []
        for name, argv in plan.workers.items():
            workers.append(Child(name, argv, console, env))
            children.append(workers[-1])
            console.say(f"started {name} (pid {workers[-1].proc.pid})")
        return _watch(plan, gateway, workers, stop, console, services, children, env)
    finally:
        _stop_all(children, console, stop_timeout_s, hurry or threading.Event())


SERVICE_RESTART_S = 2.0  # a side service that exits is started again, at most this often


def _watch(
    plan: Plan,
    gateway: Child,
    workers: list[Child],
    stop: threading.Event,
    console: Console,
    services: list[Child],
    children: list[Child],
    env: dict[str, str],
) -> int:
    state = _State()
    next_poll = 0.0
    services = list(services)
    started = {c.name: time.monotonic() for c in services}
    while not stop.wait(0.2):
        rc = gateway.proc.poll()
        if rc is not None:
            console.say(f"the gateway exited with code {rc}; stopping the workers")
            return rc if rc > 0 else 1
        for i, c in enumerate(services):  # the workers serve on without it meanwhile
            src = c.proc.poll()
            if src is not None and time.monotonic() - started[c.name] >= SERVICE_RESTART_S:
                started[c.name] = time.monotonic()
                console.say(f"{c.name} exited with code {src}; starting it again")
                services[i] = Child(c.name, plan.services[c.name], console, env)
                children.append(services[i])
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
    fit: Callable[[str, list[str], int], Layout] = ask,
) -> int:
    """`skiff serve`: 0 once a signal stops it; non-zero if it cannot start or the gateway dies.
    fit: where the model fits, asked when several devices are named (shared.launch.fit)."""
    console = Console(out or sys.stdout, err or sys.stderr, width=len("prefill cuda:0"))
    if not config.model.is_file():
        console.say(f"error: no such model file: {config.model}")
        return 2
    if not _port_is_free(config.host, config.port):
        console.say(f"error: {config.host}:{config.port} is in use; pass another --port")
        return 2
    try:
        split = resolve_split(config)
        if split is None and config.devices.strip().lower() in ("auto", "cuda"):
            console.say("looking for CUDA devices")
        if split is not None and config.pipeline:
            raise ValueError("--pipeline splits one worker over --devices; not with prefill/decode")
        prefill, devices = split or (
            [],
            resolve_devices(config.devices, cuda_count, repeats=config.pipeline),
        )
        if not prefill and not config.pipeline and len(devices) > 1:
            console.say("checking that the model fits each device")
            layout = fit(str(config.model), devices, config.max_model_len or 0)
            if layout.message:
                console.say(layout.message)
            devices = layout.devices
            config = replace(config, pipeline=layout.pipeline)
    except ValueError as e:
        console.say(f"error: {e}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C while torch looks for devices: nothing started yet
        return 130
    if prefill:
        console.say(
            f"{config.model.name}: prefill on {', '.join(prefill)}, decode on {', '.join(devices)}"
        )
    elif config.pipeline:
        console.say(f"{config.model.name}: one worker, pipeline stages on {', '.join(devices)}")
    else:
        console.say(f"{config.model.name}: {len(devices)} worker(s), on {', '.join(devices)}")
    plan = plan_processes(config, devices, local_endpoints(), prefill=prefill)
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
