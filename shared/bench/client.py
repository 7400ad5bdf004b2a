"""One streamed request to an OpenAI-compatible server, timed chunk by chunk, and the lookup of
the served model's name."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

NO_TEXT = "the stream carried no text"


@dataclass
class RequestResult:
    """What one request measured; times in seconds from just before it was sent."""

    ok: bool = False
    error: str = ""
    ttft: float | None = None  # to the first chunk carrying text
    latency: float | None = None  # to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between chunks carrying text
    output_tokens: int = 0  # the server's usage when it reports one, else the chunks counted
    prompt_tokens: int | None = None  # the server's usage; None when it reports none
    chunks: int = 0

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def request_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool
) -> bytes:
    body: dict = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body |= {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension (Skiff's too); OpenAI itself refuses it
    return json.dumps(body).encode()


def headers(api_key: str | None) -> dict[str, str]:
    out = {"Content-Type": "application/json"}
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


async def first_model(session: aiohttp.ClientSession, url: str, api_key: str | None) -> str:
    """The id of the first model GET /v1/models lists."""
    try:
        async with session.get(f"{url}/v1/models", headers=headers(api_key)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"GET {url}/v1/models: HTTP {resp.status}: {text[:200]}")
            listing = json.loads(text)
            models = (listing.get("data") if isinstance(listing, dict) else None) or []
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        raise RuntimeError(f"GET {url}/v1/models failed: {e!r}; name one with --model") from e
    if not isinstance(models[0] if models else None, dict) or "id" not in models[0]:
        raise RuntimeError(f"GET {url}/v1/models lists no model; name one with --model")
    return models[0]["id"]


async def stream_request(
    session: aiohttp.ClientSession, url: str, body: bytes, api_key: str | None
) -> RequestResult:
    """Sends one streaming request (a request_body) and times every chunk that carries text.
    A failure (HTTP error, an error event, a broken connection) comes back as ok=False with its
    error, never as an exception."""
    out = RequestResult()
    t0 = time.perf_counter()
    last = t0
    usage_tokens = None
    try:
        async with session.post(url, data=body, headers=headers(api_key)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            buf = b""
            # iter_any and our own line split: a long line cannot overflow aiohttp's readline
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    event = _event(raw)
                    if event is None:
                        continue
                    if "error" in event:
                        out.error = f"error event: {str(event['error'])[:200]}"
                        return out
                    usage = event.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens", usage_tokens)
                        out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                    if _has_text(event):
                        if out.chunks == 0:
                            out.ttft = now - t0
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.chunks += 1
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
        return out
    out.latency = time.perf_counter() - t0
    if out.chunks == 0:
        out.error = NO_TEXT
        return out
    out.output_tokens = usage_tokens if usage_tokens is not None else out.chunks
    out.ok = True
    return out


def _event(raw: bytes) -> dict | None:
    line = raw.strip()
    if not line.startswith(b"data:"):
        return None  # blank separators, comments, `event:` lines
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return None
    event = json.loads(payload)
    return event if isinstance(event, dict) else None


def _has_text(event: dict) -> bool:
    choices = event.get("choices")
    if not choices:
        return False  # the usage chunk
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choice.get("text"))
