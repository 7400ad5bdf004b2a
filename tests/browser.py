"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol with aiohttp's
websocket client: open a page, run JavaScript in it, wait for a condition, take a screenshot.
For the chat page's test; no browser-automation package needed."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from tests.cluster import free_port


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, binary: str) -> None:
        self.port = free_port()
        self.profile = tempfile.TemporaryDirectory()
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--remote-debugging-port={self.port}", f"--user-data-dir={self.profile.name}",
             "--window-size=1000,800", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.ws_url = self._page_socket()

    def _page_socket(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json", timeout=2) as r:
                    pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("chromium's DevTools endpoint did not answer")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.profile.cleanup()

    def run(self, script) -> Any:
        """`script(session)`: an async function given a Session on the page."""

        async def main() -> Any:
            async with aiohttp.ClientSession() as http, http.ws_connect(self.ws_url) as ws:
                return await script(Session(ws, self))

        return asyncio.run(main())


class Session:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse, browser: Browser) -> None:
        self.ws, self.browser = ws, browser
        self._ids = 0  # the protocol's message ids on this socket

    async def call(self, method: str, **params: Any) -> dict:
        self._ids += 1
        mine = self._ids
        await self.ws.send_json({"id": mine, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == mine:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def eval(self, expression: str) -> Any:
        out = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                              awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    async def wait_for(self, expression: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.eval(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        raise TimeoutError(f"waited {timeout} s for {expression}")

    async def screenshot(self, path: Path) -> None:
        out = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(out["data"]))
