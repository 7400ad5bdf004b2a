"""Tool calls in a model's output: the formats Skiff knows, and streaming parsers that split
generated text into content and OpenAI tool calls.

Two formats, told apart by the chat template's text:
- Hermes (Qwen 2.5/3, Hermes 2 Pro, ...): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, several in a row for parallel calls;
- Llama 3.1/3.2 JSON: the whole answer is `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), several separated by `;`.

A parser takes text as it is generated and returns what can be told apart so far: content
strings and complete `ToolCall`s. Text that may still turn into a call is held back; text
that turns out not to be a valid call (bad JSON, a function the request did not offer) comes
out as content. Whitespace between content and a call, or between calls, is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    index: int  # the call's place among its choice's calls (stream deltas carry it)
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=call_id)

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


Parsed = list[str | ToolCall]


class CallParser(Protocol):
    def push(self, text: str) -> Parsed: ...

    def flush(self) -> Parsed:
        """The output ended: what was held back, as calls or content."""
        ...


def _call(obj: Any, names: frozenset[str], index: int) -> ToolCall | None:
    """`{"name", "arguments" | "parameters"}` naming an offered function, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(index, obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls = 0
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace right after a call is dropped

    def push(self, text: str) -> Parsed:
        self._buf += text
        out: Parsed = []
        while self._step(out):
            pass
        return [p for p in out if p != ""]

    def _step(self, out: Parsed) -> bool:
        """Takes what the held text decides into `out`; False once it must wait for more."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        if self._in_call:
            end = self._buf.find(self.END)
            if end < 0:
                return False
            body, self._buf = self._buf[:end], self._buf[end + len(self.END) :]
            self._in_call = False
            out.append(self._close(body, self.END))
            return True
        start = self._buf.find(self.START)
        if start >= 0:
            out.append(self._buf[:start].rstrip())
            self._buf = self._buf[start + len(self.START) :]
            self._in_call = True
            return True
        # hold what may start a call: a part of the marker, and the whitespace before it
        keep = _partial_suffix(self._buf, self.START)
        shown = self._buf[: len(self._buf) - keep].rstrip()
        out.append(shown)
        self._buf = self._buf[len(shown) :]
        return False

    def flush(self) -> Parsed:
        out = self.push("")
        buf, self._buf = self._buf, ""
        if self._in_call:  # no end marker: a complete call still counts (models drop it)
            self._in_call = False
            out.append(self._close(buf, ""))
        elif not self._after_call:
            out.append(buf)
        return [p for p in out if p != ""]

    def _close(self, body: str, end: str) -> str | ToolCall:
        try:
            call = _call(json.loads(body), self.names, self.calls)
        except json.JSONDecodeError:
            call = None
        if call is None:
            return self.START + body + end
        self.calls += 1
        self._after_call = True
        return call


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls = 0
        self._buf = ""
        self._mode = "start"  # start: nothing seen yet; calls: JSON calls; text: content
        self._decoder = json.JSONDecoder()

    def push(self, text: str) -> Parsed:
        self._buf += text
        if self._mode == "start":
            rest = self._buf.lstrip()
            if rest.startswith(self.TAG):
                rest = rest[len(self.TAG) :].lstrip()
            if not rest or self.TAG.startswith(rest):
                return []
            self._mode = "calls" if rest.startswith("{") else "text"
            if self._mode == "calls":
                self._buf = rest
        if self._mode == "calls":
            return self._calls(closing="}" in text)
        buf, self._buf = self._buf, ""
        return [buf] if buf else []

    def flush(self) -> Parsed:
        out = self.push("")
        buf, self._buf = self._buf, ""
        return [*out, buf] if buf else out  # an unfinished call is content

    def _calls(self, closing: bool) -> Parsed:
        out: Parsed = []
        while True:
            if self.calls:  # between calls: whitespace and a ";"
                self._buf = self._buf.lstrip().removeprefix(";").lstrip()
            if not self._buf:
                return out
            if not self._buf.startswith("{"):  # text after the calls
                self._mode = "text"
                buf, self._buf = self._buf, ""
                return [*out, buf]
            if not closing:
                return out
            try:
                obj, end = self._decoder.raw_decode(self._buf)
            except json.JSONDecodeError:
                return out  # not complete yet (or never: flush shows it)
            call = _call(obj, self.names, self.calls)
            if call is None:  # JSON, but not a call: the answer is text
                self._mode = "text"
                buf, self._buf = self._buf, ""
                return [*out, buf]
            self.calls += 1
            out.append(call)
            self._buf = self._buf[end:]


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call format: its parser, and how one call is written, for the grammar that forces
    calls: `prefix`, then `{"name": ..., <args_key>: {...}}`, then `suffix`; `separator`
    between parallel calls."""

    name: str
    parser: type[HermesParser] | type[Llama3JsonParser]
    args_key: str
    prefix: str
    suffix: str
    separator: str


HERMES = ToolFormat("hermes", HermesParser, "arguments", "<tool_call>\n", "\n</tool_call>", "\n")
LLAMA3_JSON = ToolFormat("llama3_json", Llama3JsonParser, "parameters", "", "", "; ")


def format_of(template: str) -> ToolFormat | None:
    """The format a chat template's model writes its calls in, told by the template's text."""
    if HermesParser.START in template:
        return HERMES
    if Llama3JsonParser.TAG in template or '"parameters"' in template:
        return LLAMA3_JSON
    return None


def parse_whole(parser: CallParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output: its content (text outside the calls) and its calls."""
    parts = parser.push(text) + parser.flush()
    content = "".join(p for p in parts if isinstance(p, str))
    return content, [p for p in parts if isinstance(p, ToolCall)]
