"""Structured output: a request's grammar field, as llguidance's grammar (the worker compiles it
over the model's vocabulary: shared/grammar), or a 400 naming the field.

One of, per request:
- `response_format` (OpenAI): `{"type": "text"}` (no grammar), `{"type": "json_object"}` (any
  JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- `grammar` (llama-server): GBNF or Lark text; `json_schema` (llama-server): a schema;
- vLLM's `guided_json` (a schema), `guided_regex`, `guided_choice` (strings), `guided_grammar`
  (GBNF or Lark).

JSON comes out in one line, `", "` between items and `": "` after keys, as `json.dumps` writes it
(free whitespace would let a small model pad with newlines until its length limit). A schema is
honoured whole: with `strict` false (or absent) a keyword the grammar compiler lacks is skipped,
with `strict` true it is a 400.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from services.gateway.errors import invalid

FIELDS = ("response_format", "grammar", "json_schema") + tuple(
    f"guided_{kind}" for kind in ("json", "regex", "choice", "grammar")
)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(body: dict[str, Any]) -> str:
    """llguidance's grammar for the request's structured-output field ("" for none)."""
    asked = [name for name in FIELDS if body.get(name) is not None]
    if len(asked) > 1:
        raise invalid(f"structured output takes one field; got {', '.join(asked)}", asked[1])
    if not asked:
        return ""
    name = asked[0]
    value = body[name]
    try:
        grammar = _grammar(name, value)
    except ValueError as exc:
        raise invalid(f"'{name}': {exc}", name) from None
    if not grammar:
        return ""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid(f"'{name}' does not compile: {error}", name)
    return grammar


def _grammar(name: str, value: Any) -> str:
    if name == "response_format":
        return _response_format(value)
    if name in ("json_schema", "guided_json"):
        return _schema(value, strict=False)
    if name == "guided_choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise ValueError("must be a non-empty list of strings")
        return llguidance.grammar_from("choice", json.dumps(value))
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    if name == "guided_regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    return llguidance.grammar_from("grammar", value)  # GBNF or Lark


def _response_format(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return _schema({"type": "object"}, strict=False)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("json_schema must be an object whose 'schema' is an object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError("json_schema.strict must be a boolean")
        return _schema(spec.get("schema", {}), strict=bool(strict))
    raise ValueError("'type' must be text, json_object or json_schema")


def _schema(schema: Any, strict: bool) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    options = {**JSON_LAYOUT, "lenient": not strict}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
