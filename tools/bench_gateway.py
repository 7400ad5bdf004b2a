"""How many tokens a second the serving path (gateway + HTTP streaming + the W2 client) can carry,
with the GPU taken out: a stand-in worker answers every running request with one token per
fixed-length step, as a real worker does, and W2 runs against the real gateway.

    python -m tools.bench_gateway MODEL.gguf [--step-ms 14] [--concurrency 16 64 256] [--w3]

--w3 runs W3 instead: 7 streams, then a 32,000-token prompt (the stand-in answers it at its next
step), so W3's gaps during it show what the serving path adds to a step while it takes in a
long prompt (the model needs over 6,000 tokens in its vocabulary: the stand-in's ids);
--long-text sends that prompt as text, which the gateway tokenizes.

The gateway runs as its own process (as `skiff serve` starts it) on the model's tokenizer; the
stand-in worker is a second process speaking the wire protocol (shared/protocol.py). If the
serving path keeps up, W2's TPOT equals the step and its output rate C / step; where it falls
short, the difference is the serving path's cost, not the engine's. Prints one JSON line per
concurrency. A benchmark, not a test: it times the machine it runs on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stand_in_worker(worker_bind: str, tokens_bind: str, step_s: float, name: str) -> None:
    """One token per step for every running request (token ids cycle over a safe range)."""
    import zmq

    from shared.protocol import (
        Abort,
        GatewayToWorker,
        Generate,
        Heartbeat,
        StepTokens,
        TokenOut,
        WorkerReady,
        decoder,
        encoder,
    )

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"stand-in")
    dealer.connect(worker_bind)
    push = ctx.socket(zmq.PUSH)
    push.connect(tokens_bind)
    enc, dec = encoder(), decoder(GatewayToWorker)
    ready = WorkerReady("stand-in", "cpu", "stand-in", ["prefill", "decode"], name, 1 << 20, 16,
                        1 << 20, os.getpid())  # fmt: skip
    dealer.send(enc.encode(ready))
    active: dict[str, list] = {}  # request id -> [max_tokens, sent]
    next_step = time.monotonic()
    next_heartbeat = 0.0
    while True:
        while dealer.poll(0):
            msg = dec.decode(dealer.recv())
            if isinstance(msg, Generate):
                active[msg.request_id] = [msg.max_tokens, 0]
            elif isinstance(msg, Abort):
                active.pop(msg.request_id, None)
        now = time.monotonic()
        if now >= next_heartbeat:
            dealer.send(enc.encode(Heartbeat("stand-in", 0, 1 << 16, len(active), 0)))
            next_heartbeat = now + 0.2
        if now < next_step:
            time.sleep(min(next_step - now, 0.001))
            continue
        next_step += step_s
        if active:
            out = []
            for rid, state in list(active.items()):
                state[1] += 1
                done = state[1] >= state[0]
                token = 1000 + state[1] % 5000
                out.append(TokenOut(rid, token, finish_reason="length" if done else None))
                if done:
                    del active[rid]
            push.send(enc.encode(StepTokens("stand-in", out)))


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"gateway at {url} not ready after {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a GGUF file (its tokenizer and name)")
    p.add_argument("--step-ms", type=float, default=14.0, help="the stand-in's step time")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--w3", action="store_true", help="W3 instead of W2 (see above)")
    p.add_argument("--long-text", action="store_true", help="W3's long prompt as text")
    a = p.parse_args(argv)
    port = _free_port()
    worker_bind = f"tcp://127.0.0.1:{_free_port()}"
    tokens_bind = f"tcp://127.0.0.1:{_free_port()}"
    url = f"http://127.0.0.1:{port}"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--model", str(a.model), "--port", str(port),
         "--worker-bind", worker_bind, "--tokens-bind", tokens_bind],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    name = a.model.name.removesuffix(".gguf")
    worker = mp.get_context("spawn").Process(
        target=stand_in_worker, args=(worker_bind, tokens_bind, a.step_ms / 1e3, name), daemon=True
    )
    worker.start()
    try:
        _wait_ready(url, 60)
        vocab = "32000"  # prompt ids well inside any tokenizer's vocabulary
        if a.w3:
            done = subprocess.run(
                [sys.executable, "-m", "tools.bench_serving", url, "w3", "--vocab", "6000",
                 "--label", f"stand-in worker, {a.step_ms} ms steps",
                 *(["--long-text"] if a.long_text else [])],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({**result, "cpu_count": os.cpu_count()}), flush=True)
            return 0
        for c in a.concurrency:
            done = subprocess.run(
                [sys.executable, "-m", "tools.bench_serving", url, "w2", "--concurrency", str(c),
                 "--vocab", vocab, "--label", f"stand-in worker, {a.step_ms} ms steps"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["ideal_tok_s"] = round(c / a.step_ms * 1e3, 1)
            result["cpu_count"] = os.cpu_count()
            print(json.dumps(result), flush=True)
    finally:
        worker.kill()
        gateway.terminate()
        gateway.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
