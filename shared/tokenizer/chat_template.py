"""Chat templates (GGUF `tokenizer.chat_template`) rendered the way Hugging Face renders them.

Same Jinja environment as transformers' `chat_template_utils` (and llama-cpp-python's
Jinja2ChatFormatter): sandboxed and immutable (templates come with downloaded models and are
untrusted), trim_blocks + lstrip_blocks, loop controls, a pass-through `{% generation %}` tag,
a `tojson` that keeps non-ASCII text, and the `raise_exception` / `strftime_now` helpers.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError


class NoChatTemplate(ValueError):
    """Chat was requested from a model whose GGUF carries no chat template."""


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` marks assistant text for
    training masks; for rendering it is a no-op block."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' which would corrupt prompts
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox answers a forbidden attribute with an Undefined that only fails when
    used further, so `{{ ''.__class__ }}` would print "". Fail at the access itself."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A model's chat template; `render` turns OpenAI-style messages into the prompt text."""

    def __init__(
        self,
        source: str | None,
        bos_token: str = "",
        eos_token: str = "",
        model_name: str = "this model",
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.model_name = model_name
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], name: str | None = None) -> ChatTemplate:
        """The template stored in GGUF metadata; `name` picks `tokenizer.chat_template.<name>`
        (e.g. "tool_use"). A model without one still loads: `render` raises NoChatTemplate."""
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token_text(id_key: str) -> str:
            tid = metadata.get(f"tokenizer.ggml.{id_key}")
            return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else ""

        model_name = (
            metadata.get("general.name") or metadata.get("general.basename") or "this model"
        )
        return cls(
            metadata.get(key) or None,
            bos_token=token_text("bos_token_id"),
            eos_token=token_text("eos_token_id"),
            model_name=str(model_name),
        )

    @property
    def available(self) -> bool:
        return self.source is not None

    def _template(self) -> jinja2.Template:
        if self.source is None:
            raise NoChatTemplate(
                f"{self.model_name} has no chat template (no tokenizer.chat_template in its "
                "GGUF metadata); use plain completions or supply a template"
            )
        if self._compiled is None:  # compiled on first use: a broken template must not
            try:  # stop the model from serving plain completions
                self._compiled = _environment().from_string(self.source)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"chat template of {self.model_name}: {exc}") from exc
        return self._compiled

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt for `messages`; `extra` (tools, documents, ...) reaches the template as
        variables. Sandbox violations raise jinja2.sandbox.SecurityError."""
        return self._template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
