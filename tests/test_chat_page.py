"""The chat web page at `/` (services/gateway/static) in headless Chromium, against the real
processes (a gateway with an API key and a CPU worker serving SmolLM2): the page loads with no
key, asks for one, shows the model's name once the key is typed, sends a message and shows the
streamed answer, which is the API's own greedy answer to the same conversation, with its
tokens/s; a second turn carries the first; Stop ends a long answer early. A screenshot of the
conversation is saved under the test's tmp_path. Chromium is Debian's package (`make test`
installs it where apt can); without it the browser tests skip, the page's serving test runs."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from tests.browser import Browser, chromium
from tests.cluster import Cluster, http_json

openai = pytest.importorskip("openai")

KEY = "page-key"
BY_ID = "document.getElementById"
MODEL, INPUT, SEND = (f"{BY_ID}('{i}')" for i in ("model", "input", "send"))
MODEL = f"{MODEL}.textContent"
WORKER_ARGS = ("--max-model-len", "2048")


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path):
    c = Cluster(smollm2_path, 1, worker_args=WORKER_ARGS, gateway_args=("--api-key", KEY)).start()
    yield c
    c.stop()


def test_the_page_and_its_files_need_no_key(cluster: Cluster) -> None:
    for path, kind in (
        ("/", "text/html"),
        ("/static/chat.js", "javascript"),
        ("/static/chat.css", "text/css"),
    ):
        with urllib.request.urlopen(cluster.url + path, timeout=10) as r:
            assert r.status == 200 and kind in r.headers["Content-Type"]
    assert http_json(cluster.url + "/v1/models")[0] == 401  # the API still needs it


@pytest.fixture(scope="module")
def browser():
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    b = Browser(binary)
    yield b
    b.close()


def test_a_conversation_streams_in_the_page(
    cluster: Cluster, browser: Browser, smollm2_path: Path, tmp_path: Path
) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0)
    first = "What is the capital of France?"
    want = (
        client.chat.completions.create(
            model=smollm2_path.stem,
            messages=[{"role": "user", "content": first}],
            temperature=0,
            max_tokens=48,
        )
        .choices[0]
        .message.content
    )

    async def script(page):
        await page.call("Page.enable")
        await page.call("Page.navigate", url=cluster.url + "/")
        await page.wait_for(
            "document.readyState === 'complete' && !!document.getElementById('status')", 30
        )
        # no key yet: the page says what the server answered
        await page.wait_for("document.getElementById('status').dataset.state === 'error'", 30)
        status = await page.eval("document.getElementById('status').textContent")
        await page.eval(
            f"""(() => {{
              const set = (id, v) => {{ const e = document.getElementById(id); e.value = v;
                e.dispatchEvent(new Event('change')); }};
              set('api_key', '{KEY}'); set('temperature', '0'); set('max_tokens', '48');
            }})()"""
        )
        model = await page.wait_for(f"{MODEL}.includes('SmolLM2') && {MODEL}", 30)
        await page.eval(f"{INPUT}.value = {first!r}; {SEND}.click()")
        await page.wait_for("document.getElementById('status').dataset.state === 'done'", 120)
        answer = await page.eval(
            "[...document.querySelectorAll('.msg.assistant')].pop().textContent"
        )
        rate = await page.eval("document.getElementById('status').textContent")
        await page.screenshot(tmp_path / "chat.png")
        # a long answer, stopped after its first tokens
        long = "Write a long story about a ship."
        await page.eval(
            f"{BY_ID}('max_tokens').value = '1500'; {INPUT}.value = {long!r}; {SEND}.click()"
        )
        await page.wait_for(
            "[...document.querySelectorAll('.msg.assistant')].pop().textContent.length > 20", 120
        )
        await page.eval("document.getElementById('stop').click()")
        await page.wait_for("document.getElementById('status').textContent === 'stopped'", 30)
        stopped = await page.eval(
            "[...document.querySelectorAll('.msg.assistant')].pop().textContent"
        )
        turns = await page.eval("document.querySelectorAll('.msg').length")
        return status, model, answer, rate, stopped, turns

    status, model, answer, rate, stopped, turns = browser.run(script)
    assert "API key" in status
    assert model == smollm2_path.stem
    assert answer == want and answer
    assert "tok/s" in rate and "tokens" in rate
    assert len(stopped) > 20 and turns == 4
    assert (tmp_path / "chat.png").stat().st_size > 5000
    print(f"\nscreenshot: {tmp_path / 'chat.png'}; {rate}")
