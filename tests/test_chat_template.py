"""Chat templates: SmolLM2's real template, a model without one, and the sandbox.

SmolLM2 / Gemma 3 come from SKIFF_SMOLLM2 / SKIFF_GEMMA3; those tests skip when unset. The
sandbox and helper tests need no model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jinja2.sandbox import SecurityError

from shared.loader import GGUFFile
from shared.tokenizer import ChatTemplate, ChatTemplateError, NoChatTemplate, load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
]
EXPECTED_CHATML = (
    "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _metadata(env: str) -> dict:
    path = os.environ.get(env)
    if not path or not Path(path).is_file():
        pytest.skip(f"{env} is not set to a GGUF file")
    return GGUFFile(path).metadata


@pytest.fixture(scope="module")
def smollm2() -> dict:
    return _metadata("SKIFF_SMOLLM2")


def test_smollm2_renders_chatml(smollm2):
    template = ChatTemplate.from_metadata(smollm2)
    assert template.available
    assert template.render(CONVERSATION) == EXPECTED_CHATML
    without_prompt = template.render(CONVERSATION, add_generation_prompt=False)
    assert without_prompt == EXPECTED_CHATML.removesuffix("<|im_start|>assistant\n")


def test_smollm2_matches_llama_cpp_python_formatter(smollm2):
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    template = ChatTemplate.from_metadata(smollm2)
    reference = chat_format.Jinja2ChatFormatter(
        template=template.source, eos_token=template.eos_token, bos_token=template.bos_token
    )
    for messages in (CONVERSATION, CONVERSATION[1:]):
        assert template.render(messages) == reference(messages=messages).prompt


def test_smollm2_default_system_prompt_and_tokens(smollm2):
    template = ChatTemplate.from_metadata(smollm2)
    text = template.render([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    tok = load_tokenizer(smollm2)
    ids = tok.encode(text, add_special=True, special=True)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids.count(tok.token_to_id("<|im_end|>")) == 2
    assert template.bos_token == "<|im_start|>" and template.eos_token == "<|im_end|>"


def test_gemma_has_no_template():
    template = ChatTemplate.from_metadata(_metadata("SKIFF_GEMMA3"))
    assert not template.available
    with pytest.raises(NoChatTemplate, match="Gemma 3 270m"):
        template.render(CONVERSATION)
    assert issubclass(NoChatTemplate, ValueError)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages|attr('__class__') }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ range.__call__ }}",
        "{% set _ = messages.append({'role': 'user'}) %}",
        "{{ messages[0].update({'content': 'pwned'}) }}",
    ],
)
def test_sandbox_refuses_escapes(source):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(SecurityError):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_helpers_and_hf_environment():
    assert ChatTemplate("{{ {'k': 'é<&>'}|tojson }}").render([]) == '{"k": "é<&>"}'
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])
    assert len(ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])) == 10
    # trim_blocks/lstrip_blocks, loop controls and the {% generation %} tag, as in transformers
    source = (
        "{% for m in messages %}\n    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{{ bos_token }}{{ tools }}"
    )
    template = ChatTemplate(source, bos_token="<s>")
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert template.render(msgs) == "a><s>"  # no stray newlines or indentation
    assert template.render(msgs, add_generation_prompt=False, tools="T") == "a<s>T"


def test_broken_template_fails_on_render_only():
    template = ChatTemplate("{% for %}", model_name="Broken")
    with pytest.raises(ChatTemplateError, match="Broken"):
        template.render([])
