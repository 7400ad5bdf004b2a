"""A chat request's `messages`, validated into what chat templates render.

Kept per message: `role` ("developer" becomes "system", the name templates know), `content`
(text parts joined; null becomes ""), `name`; an assistant's `tool_calls`, each one's
`function.arguments` turned from OpenAI's JSON string into the mapping templates expect; a
tool message's `tool_call_id`. Each check raises a 400 naming the message's field.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import invalid, shown

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list", "messages")
    return [_message(msg, f"messages[{i}]") for i, msg in enumerate(value)]


def _message(msg: Any, where: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise invalid(f"{where} must be an object", where)
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise invalid(
            f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {shown(role)}",
            f"{where}.role",
        )
    entry: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _content(msg.get("content"), f"{where}.content"),
    }
    if isinstance(msg.get("name"), str):
        entry["name"] = msg["name"]
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            why = f"{where}.tool_calls: only assistant messages carry tool calls"
            raise invalid(why, f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        if calls:  # an empty list is no calls
            entry["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)
            ]
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            raise invalid(
                f"{where}.tool_call_id: a tool message needs the id of the call it answers "
                f"(a string), got {shown(call_id)}",
                f"{where}.tool_call_id",
            )
        entry["tool_call_id"] = call_id
    return entry


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise invalid(f"{where} must be an object of type 'function'", where)
    if not isinstance(call.get("id"), str):
        raise invalid(f"{where}.id must be a string", f"{where}.id")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid(f"{where}.function must be an object with a 'name'", f"{where}.function")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise invalid(
                f"{where}.function.arguments is not JSON: {exc}", f"{where}.function.arguments"
            ) from None
    if not isinstance(args, dict):
        raise invalid(
            f"{where}.function.arguments must be a JSON object, got {shown(args)}",
            f"{where}.function.arguments",
        )
    function = {"name": fn["name"], "arguments": args}
    return {"id": call["id"], "type": "function", "function": function}


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""  # assistant turns that only carried tool calls
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"{where} must be a string or a list of content parts", where)
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}: only text content parts are supported, got {kind!r}", where)
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}: a text part needs a string 'text'", where)
        texts.append(part["text"])
    return "\n".join(texts)
