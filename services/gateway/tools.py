"""Tool calling for a chat request: the `tools`, `tool_choice` and `parallel_tool_calls`
fields, checked against the model's chat template, and what follows from them: the variables
the template renders, the grammar that forces a call, the parser of the output's calls.

`tool_choice`:
- `auto` (the default with tools): tools rendered, the output's calls parsed;
- `none`: tools rendered (a conversation that used them still reads as it did; vLLM does the
  same), the output never parsed: it is content, whatever it holds;
- `required`: the output is constrained to calls of the offered functions, one or more (one with
  `parallel_tool_calls` false), each one's arguments to its function's JSON schema;
- `{"type": "function", "function": {"name": ...}}`: constrained to one call of that function.

A template supports tools when its text reads the `tools` variable and writes calls in a format
Skiff parses (tool_calls.py); any other template gets a 400 naming 'tools'. In auto mode,
`parallel_tool_calls` false does not cut the output: every call the model wrote is returned.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from services.gateway.errors import invalid
from services.gateway.structured import FIELDS as STRUCTURED
from services.gateway.structured import JSON_LAYOUT
from services.gateway.tool_calls import CallParser, ToolFormat, format_of
from shared.tokenizer import ChatTemplate

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolRequest:
    """The tool fields of a request that offers tools."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, as the template gets them
    choice: str  # auto, none, required, or function (then `function` names it)
    function: str = ""
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


def tools_of(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools (None when it offers none), or a 400 naming the field at fault."""
    tools = _tools(body.get("tools"))
    choice, function = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools:
        return None
    if choice in ("required", "function"):
        other = next((name for name in STRUCTURED if body.get(name) is not None), None)
        if other is not None:
            raise invalid(
                f"tool_choice {choice!r} constrains the output to a tool call; it cannot be "
                f"combined with '{other}'",
                other,
            )
    return ToolRequest(tools, choice, function, parallel is not False)


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("'tools' must be a list of tools", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{where} must be an object of type 'function'", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(
                f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'",
                f"{where}.function.name",
            )
        if name in seen:
            raise invalid(f"{where}: function {name!r} is offered twice", f"{where}.function.name")
        seen.add(name)
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise invalid(
                    f"{where}.function.{key} must be a {'JSON object' if kind is dict else kind}",
                    f"{where}.function.{key}",
                )
    return value


def _choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str]:
    if value is None:
        return ("auto" if tools else "none"), ""
    if value in ("none", "auto"):
        return value, ""
    if value == "required":
        name = ""
    elif (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
    ):
        name = value["function"]["name"]
    else:
        raise invalid(
            "'tool_choice' must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not tools:
        raise invalid("'tool_choice' asks for a tool call, but 'tools' offers none", "tool_choice")
    if name and name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"'tool_choice' names {name!r}, which 'tools' does not offer", "tool_choice")
    return ("function" if name else "required"), name


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for one model: template variables, grammar, parser."""

    template_vars: dict[str, Any]
    grammar: str  # "" unless tool_choice forces a call
    fmt: ToolFormat | None  # None: the output is never parsed for calls
    names: frozenset[str] = frozenset()

    @property
    def parser(self) -> Callable[[], CallParser] | None:
        """A maker of each choice's parser; None: the output is content only."""
        return None if self.fmt is None else functools.partial(self.fmt.parser, self.names)


def plan_tools(
    req: ToolRequest | None, template: ChatTemplate, messages: list[dict[str, Any]]
) -> ToolPlan:
    """The request's plan on this model's template, or a 400: tools (or earlier calls in
    `messages`) for a template that cannot render them."""
    source = template.source or ""
    who = f"the chat template of {template.model_name}"
    for i, msg in enumerate(messages):
        if "tool_calls" in msg and source and "tool_calls" not in source:
            raise invalid(
                f"messages[{i}].tool_calls: {who} cannot render tool calls",
                f"messages[{i}].tool_calls",
            )
    if req is None:
        return ToolPlan({}, "", None)
    if not source:
        raise invalid(f"'tools': {template.model_name} has no chat template", "tools")
    if not re.search(r"\btools\b", source):
        raise invalid(
            f"'tools': {who} has no tool support (it never reads `tools`); "
            "use a model whose template renders tools",
            "tools",
        )
    fmt = format_of(source)
    if fmt is None:
        raise invalid(
            f"'tools': {who} renders tools, but writes calls in a format Skiff does not parse "
            "(it parses Hermes <tool_call> and Llama 3 JSON calls)",
            "tools",
        )
    grammar = call_grammar(fmt, req) if req.forced else ""
    parsed = None if req.choice == "none" else fmt
    return ToolPlan({"tools": req.tools}, grammar, parsed, req.names)


def call_grammar(fmt: ToolFormat, req: ToolRequest) -> str:
    """llguidance's grammar for the calls `req.choice` forces, in the model's format."""
    chosen = [
        t["function"]
        for t in req.tools
        if req.choice != "function" or t["function"]["name"] == req.function
    ]
    rules = [f"fn_{i}: {_call_rule(fmt, fn)}" for i, fn in enumerate(chosen)]
    call = " | ".join(f"fn_{i}" for i in range(len(chosen)))
    if req.choice == "function" or not req.parallel:
        start = "start: call"
    else:
        start = f"start: call ({json.dumps(fmt.separator)} call)*"
    grammar = llguidance.grammar_from("lark", "\n".join([start, f"call: {call}", *rules]))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid(f"'tools': a function's parameters do not compile: {error}", "tools")
    return grammar


def _call_rule(fmt: ToolFormat, fn: dict[str, Any]) -> str:
    # no parameters: OpenAI's "empty parameter list"
    params = dict(
        fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    )
    # definitions move to the call's root, where the parameters' "#/$defs/..." refs look
    defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    schema = {
        "x-guidance": {**JSON_LAYOUT, "lenient": not fn.get("strict", False)},
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, fmt.args_key: params},
        "required": ["name", fmt.args_key],
        "additionalProperties": False,
        **defs,
    }
    parts = [json.dumps(fmt.prefix) if fmt.prefix else "", f"%json {json.dumps(schema)}"]
    parts.append(json.dumps(fmt.suffix) if fmt.suffix else "")
    return " ".join(p for p in parts if p)
