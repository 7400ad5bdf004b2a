"""`skiff bench` (shared/bench/): percentiles, dataset loading, the Poisson arrival schedule, the
summary, and whole runs of the command against a fake OpenAI-compatible streaming server started
here (aiohttp.web on a free port), whose delays bound the measured times from below."""

from __future__ import annotations

import asyncio
import io
import json
import math
import socket
import statistics
import threading

import numpy as np
import pytest
from aiohttp import web

from shared.bench.client import RequestResult
from shared.bench.progress import ProgressBar
from shared.bench.report import format_table, percentile, summarize
from shared.bench.workload import arrival_times, load_dataset, random_prompts
from shared.cli import main

FIRST_S = 0.05  # the fake server's wait before a request's first token
GAP_S = 0.01  # and between its tokens


class FakeServer:
    """Streams max_tokens one-token chunks (FIRST_S, then GAP_S apart) and a usage chunk.
    Under /flaky, prompts holding FAIL get a 500; under /nousage, no usage chunk is sent."""

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        for mode in ("", "flaky", "nousage"):
            prefix = f"/{mode}" if mode else ""
            app.router.add_get(f"{prefix}/v1/models", self.models)
            for path in ("/v1/completions", "/v1/chat/completions"):
                app.router.add_post(prefix + path, self._handler(mode))
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    def _handler(self, mode: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.complete(request, mode)

        return handle

    async def complete(self, request: web.Request, mode: str) -> web.StreamResponse:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if mode == "flaky" and "FAIL" in prompt:
            return web.json_response({"error": {"message": "fake failure"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(event: dict) -> None:
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())

            if chat:  # a role-only chunk at once: no token, so no first token yet
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(FIRST_S)
            n = body["max_tokens"]
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP_S)
                choice = {"delta": {"content": "tok "}} if chat else {"text": "tok "}
                await send({"choices": [{"index": 0, **choice, "finish_reason": None}]})
            if mode != "nousage":
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
                await send({"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


def _serve(fake: FakeServer):
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(fake.app())
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        fake.port = runner.addresses[0][1]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10), "the fake server did not start"
    return loop, thread


@pytest.fixture
def server():
    fake = FakeServer(api_key="secret")
    loop, thread = _serve(fake)
    yield fake
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


# -- pure parts ----------------------------------------------------------------------------------


def test_percentile_matches_numpy_linear_interpolation():
    rng = np.random.default_rng(0)
    xs = rng.exponential(size=37).tolist()
    for p in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p), rel=1e-12)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_load_dataset_jsonl_list_and_sharegpt(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "one"}\n\n{"prompt": "two", "x": 1}\n{"no": "prompt"}\n')
    assert load_dataset(jsonl, 5) == ["one", "two", "one", "two", "one"]  # cycled
    strings = tmp_path / "s.json"
    strings.write_text(json.dumps(["a", "b", "c"]))
    assert load_dataset(strings, 2) == ["a", "b"]
    share = tmp_path / "sharegpt.json"
    turns = [[("human", "hi"), ("gpt", "yo")], [("gpt", "1st"), ("human", "q2")], [("gpt", "x")]]
    conversations = [
        {"id": str(i), "conversations": [{"from": who, "value": v} for who, v in convo]}
        for i, convo in enumerate(turns)
    ]
    share.write_text(json.dumps(conversations))
    assert load_dataset(share, 3) == ["hi", "q2", "hi"]


def test_load_dataset_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a JSON line"):
        load_dataset(bad, 1)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([{"text": "no prompt field"}, 3]))
    with pytest.raises(ValueError, match=r"no prompt found in 2 items"):
        load_dataset(empty, 1)
    with pytest.raises(ValueError, match="cannot read"):
        load_dataset(tmp_path / "missing.json", 1)


def test_random_prompts_are_seeded_and_sized():
    a = random_prompts(4, 30, seed=1)
    assert a == random_prompts(4, 30, seed=1)
    assert a != random_prompts(4, 30, seed=2)
    assert all(len(p.split()) == 30 for p in a)
    assert len({tuple(p.split()[:5]) for p in a}) == 4  # no two share their first words


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    rate, n = 50.0, 20000
    times = arrival_times(n, rate, seed=3)
    assert times == arrival_times(n, rate, seed=3)
    assert times != arrival_times(n, rate, seed=4)
    assert times[0] == 0.0
    gaps = np.diff(times)
    assert (gaps >= 0).all()
    # exponential gaps: mean 1/rate (the mean of 20,000 is within 0.7 % per sigma) and a
    # standard deviation equal to the mean (evenly spaced arrivals would have none)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)
    assert arrival_times(5, math.inf, seed=3) == [0.0] * 5


def test_summary_counts_failures_and_uses_usage_tokens():
    ok = RequestResult(ok=True, ttft=0.1, latency=0.5, itl=[0.1] * 4, output_tokens=5)
    ok2 = RequestResult(ok=True, ttft=0.3, latency=0.3, itl=[], output_tokens=1, prompt_tokens=9)
    bad = RequestResult(error="HTTP 500: no")
    s = summarize([ok, ok2, bad], duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 9
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0
    assert s["total_token_throughput"] == 7.5
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["p99_ttft_ms"] == pytest.approx(298.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; one token has no TPOT
    assert s["median_e2el_ms"] == pytest.approx(400.0)
    table = format_table(s, None, math.inf)
    assert "Failed requests:                         1" in table
    assert "Mean TPOT (ms):                          100.00" in table
    assert "Request rate configured (RPS):           inf" in table
    empty = summarize([bad], duration=1.0)
    assert empty["mean_itl_ms"] is None and empty["total_input_tokens"] is None
    assert "Mean ITL (ms):                           n/a" in format_table(empty, 4, 2.0)


def test_progress_bar_draws_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    bar = ProgressBar(4, out=out)
    bar.update(True)
    bar.update(False)
    bar.close()
    assert "[###############...............] 2/4, 1 failed" in out.getvalue()
    assert out.getvalue().endswith("\n")
    plain = io.StringIO()
    ProgressBar(4, out=plain).update(True)
    assert plain.getvalue() == ""


# -- whole runs against the fake server ----------------------------------------------------------


def test_bench_against_fake_server(server, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run.json"
    monkeypatch.setenv("OPENAI_API_KEY", "secret")  # the key from the environment
    argv = ["bench", f"http://127.0.0.1:{server.port}/v1", "--num-prompts", "8"]
    argv += ["--concurrency", "4", "--input-len", "7", "--output-len", "5", "--ignore-eos"]
    argv += ["--json", str(out), "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    print(table)
    assert "Successful requests:                     8" in table
    assert "Total generated tokens:                  40" in table
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"], doc["model"]) == (8, 0, "fake-model")
    assert doc["total_output_tokens"] == 40 and doc["total_input_tokens"] == 8 * 7
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert doc[key] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert doc[f"{stat}_{metric}_ms"] is not None
    assert min(doc["ttfts"]) >= FIRST_S
    assert min(doc["e2els"]) >= FIRST_S + 4 * GAP_S
    assert all(len(itl) == 4 for itl in doc["itls"])  # 5 token chunks: 4 gaps each
    assert 0.8 * GAP_S <= statistics.fmean(g for itl in doc["itls"] for g in itl) < 5 * GAP_S
    assert 0.8 * GAP_S <= doc["mean_tpot_ms"] / 1000 < 5 * GAP_S
    assert doc["output_lens"] == [5] * 8 and doc["errors"] == [""] * 8
    # one short test request, then the 8; at most 4 in flight, and 4 were
    assert len(server.bodies) == 9 and server.bodies[0]["max_tokens"] == 4
    body = server.bodies[1]
    assert body["model"] == "fake-model" and body["max_tokens"] == 5 and body["ignore_eos"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert server.max_in_flight == 4


def test_failed_requests_are_counted_and_the_run_goes_on(server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    prompts = ["fine one", "FAIL a", "fine two", "FAIL b", "fine three", "FAIL c"]
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "flaky.json"
    argv = ["bench", f"http://127.0.0.1:{server.port}/flaky", "--endpoint", "chat"]
    argv += ["--dataset", str(data), "--num-prompts", "8", "--output-len", "3"]
    argv += ["--api-key", "secret", "--json", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Failed requests:                         4" in captured.out
    assert "4 failed with: HTTP 500" in captured.err
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (4, 4)
    failed = [i for i, e in enumerate(doc["errors"]) if e]
    assert failed == [1, 3, 5, 7] and doc["errors"][1].startswith("HTTP 500")  # 6, 7: cycled
    assert doc["ttfts"][1] is None and doc["output_lens"][1] == 0
    # the role-only chat chunk sent at once is no first token
    assert min(t for t in doc["ttfts"] if t is not None) >= FIRST_S
    assert doc["total_output_tokens"] == 4 * 3
    assert server.bodies[1]["messages"] == [{"role": "user", "content": "fine one"}]


def test_without_usage_tokens_are_counted_and_arrivals_follow_the_rate(server, tmp_path, capsys):
    out = tmp_path / "rate.json"
    argv = ["bench", f"http://127.0.0.1:{server.port}/nousage", "--num-prompts", "6"]
    argv += ["--request-rate", "40", "--seed", "5", "--output-len", "3", "--input-len", "4"]
    argv += ["--api-key", "secret", "--json", str(out)]
    assert main(argv) == 0
    assert "Total input tokens:                      n/a" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["output_lens"] == [3] * 6 and doc["total_input_tokens"] is None
    assert doc["request_rate"] == 40.0 and doc["max_concurrency"] is None
    last = arrival_times(6, 40.0, seed=5)[-1]
    assert doc["duration"] >= last + FIRST_S + 2 * GAP_S


def test_a_bad_key_or_server_fails_at_once(server, capsys):
    url = f"http://127.0.0.1:{server.port}"
    assert main(["bench", url, "--api-key", "wrong", "--num-prompts", "2"]) == 1
    assert "the test request failed: HTTP 401" in capsys.readouterr().err
    assert len(server.bodies) == 0
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", f"http://127.0.0.1:{port}", "--num-prompts", "2"]) == 1
    assert f"GET http://127.0.0.1:{port}/v1/models failed" in capsys.readouterr().err
