"""Handlers of the OpenAI API: /v1/completions, /v1/chat/completions and /v1/models.

Each generation handler parses and validates the body, builds the prompt ids, checks the length
against the context, then runs the request's n choices (a `Generation` each) and writes them
whole or as server-sent events. A chat request's tools (tools.py) reach the template, may
constrain the sampling, and have each choice's calls parsed out of its text (tool_deltas.py).
Errors before the first event are ordinary JSON error responses; after it, a stream carries one
`data: {"error": ...}` event and ends.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import jinja2
import msgspec
from aiohttp import web

from services.gateway.choices import Choices
from services.gateway.errors import ApiError, invalid
from services.gateway.generation import ClientGone, Delta, Generation
from services.gateway.openai_format import ChatFormat, ChoiceOutput, CompletionFormat
from services.gateway.request_params import (
    GenerationParams,
    decode_body,
    parse_chat,
    parse_completion,
)
from services.gateway.state import CLIENT_CLOSED, FINAL_STATUS, GATEWAY, Gateway
from services.gateway.streaming import SseWriter
from services.gateway.tool_calls import CallParser
from services.gateway.tool_deltas import with_tool_calls
from services.gateway.tools import plan_tools
from shared.tokenizer import ChatTemplateError, NoChatTemplate

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    gw = request.app[GATEWAY]
    tok = gw.model.tokenizer
    req = parse_completion(decode_body(await request.read()), tok.vocab_size)
    _check_model(gw, req.model)
    if isinstance(req.prompt, str):
        # Special-token text in a raw prompt becomes those tokens, as in llama-server.
        prompt_ids = await gw.prompts.encode(req.prompt, add_special=True)
        echo = req.prompt if req.echo else ""
    else:
        prompt_ids = req.prompt
        # decoded only to echo it: 32k ids took the event loop ~25 ms, a stall every stream saw
        echo = tok.decode(prompt_ids) if req.echo else ""
    if not prompt_ids:
        raise invalid("'prompt' is empty", "prompt")
    want_logprobs = req.params.sampling.logprobs is not None
    fmt = CompletionFormat(gw.model.name, want_logprobs, req.params.include_usage)
    return await _generate(request, gw, prompt_ids, req.params, "prompt", fmt, arrived, echo)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    gw = request.app[GATEWAY]
    req = parse_chat(decode_body(await request.read()))
    _check_model(gw, req.model)
    tools = plan_tools(req.tools, gw.model.chat_template, req.messages)
    params = req.params
    if tools.grammar:
        sampling = msgspec.structs.replace(params.sampling, grammar=tools.grammar)
        params = dataclasses.replace(params, sampling=sampling)
    try:
        text = gw.model.chat_template.render(
            req.messages, add_generation_prompt=True, **tools.template_vars
        )
    except (NoChatTemplate, ChatTemplateError) as exc:
        raise invalid(str(exc), "messages") from None
    except jinja2.TemplateError as exc:  # a broken template is the model's fault, not the user's
        raise ApiError(500, f"the model's chat template failed: {exc}") from None
    prompt_ids = await gw.prompts.encode(text, add_special=False)
    want_logprobs = params.sampling.logprobs is not None
    fmt = ChatFormat(gw.model.name, want_logprobs, params.include_usage)
    return await _generate(
        request, gw, prompt_ids, params, "messages", fmt, arrived, parser=tools.parser
    )


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response({"object": "list", "data": [_model_card(gw)]})


async def get_model(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    _check_model(gw, request.match_info["model"])
    return web.json_response(_model_card(gw))


def _api_key(request: web.Request) -> str:
    """The bearer token the request came with ("" for none)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _model_card(gw: Gateway) -> dict:
    return {
        "id": gw.model.name,
        "object": "model",
        "created": gw.model.created,
        "owned_by": "skiff",
        "max_model_len": gw.max_model_len(),
    }


def _check_model(gw: Gateway, model: str | None) -> None:
    if model is not None and model != gw.model.name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{gw.model.name}`.",
            param="model",
            code="model_not_found",
        )


def _max_tokens(gw: Gateway, prompt_len: int, params: GenerationParams, prompt_param: str) -> int:
    """The request's max_tokens, checked against the context (defaults fill what is left)."""
    ctx = gw.max_model_len()
    if prompt_len >= ctx:
        raise invalid(
            f"This model's maximum context length is {ctx} tokens, but the prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion.",
            prompt_param,
            code="context_length_exceeded",
        )
    if params.max_tokens is None:
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if prompt_param == "prompt" else ctx
        return min(default, ctx - prompt_len)
    if prompt_len + params.max_tokens > ctx:
        raise invalid(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the {prompt_param}, "
            f"{params.max_tokens} for the completion). Please reduce the length of the "
            f"{prompt_param} or max_tokens.",
            "max_tokens",
            code="context_length_exceeded",
        )
    return params.max_tokens


async def _generate(
    request: web.Request,
    gw: Gateway,
    prompt_ids: list[int],
    params: GenerationParams,
    prompt_param: str,
    fmt: CompletionFormat | ChatFormat,
    arrived: float,
    echo: str = "",
    parser: Callable[[], CallParser] | None = None,
) -> web.StreamResponse:
    max_tokens = _max_tokens(gw, len(prompt_ids), params, prompt_param)
    stop_ids = [] if params.ignore_eos else sorted(gw.model.tokenizer.stop_ids)
    gens = [
        Generation(
            request,
            gw.router,
            gw.model.tokenizer,
            gw.metrics,
            params.stop,
            fmt.want_logprobs,
            arrived,
        )
        for _ in range(params.n)
    ]
    choices = Choices(gens, gw.metrics)
    try:
        domain = params.domain or gw.config.key_domains.get(_api_key(request), "")
        await choices.start(prompt_ids, max_tokens, params.sampling, stop_ids, domain)
        deltas = choices if parser is None else with_tool_calls(choices, parser)
        if params.stream:
            return await _stream(request, choices, deltas, fmt, params.include_usage, echo)
        return await _whole(choices, deltas, fmt, echo)
    except ClientGone:
        request[FINAL_STATUS] = CLIENT_CLOSED
        return web.Response(status=CLIENT_CLOSED)
    finally:
        await choices.close()  # aborts on the worker the choices that did not end there


Deltas = Choices | AsyncIterator[tuple[int, Delta]]


async def _whole(
    choices: Choices, deltas: Deltas, fmt: CompletionFormat | ChatFormat, echo: str
) -> web.Response:
    outputs = [ChoiceOutput(echo) for _ in choices.gens]
    async for index, delta in deltas:
        out = outputs[index]
        out.text += delta.text
        out.entries.extend(delta.logprobs)
        out.tool_calls.extend(delta.tool_calls)
        out.finish = delta.finish_reason or out.finish
    tokens = (choices.prompt_tokens, choices.completion_tokens, choices.cached_tokens)
    return web.json_response(fmt.response(outputs, *tokens))


async def _stream(
    request: web.Request,
    choices: Choices,
    deltas: Deltas,
    fmt: CompletionFormat | ChatFormat,
    include_usage: bool,
    echo: str,
) -> web.StreamResponse:
    sse = SseWriter(request)
    echoes = [echo] * len(choices.gens)  # each choice's first chunk carries the echo
    opened = [False] * len(choices.gens)
    try:
        async for index, delta in deltas:
            if not opened[index]:  # the SSE opens lazily: errors before any token stay JSON
                opened[index] = True
                first = fmt.first_chunk(index)
                if first is not None:
                    await sse.send(first)
            text, echoes[index] = echoes[index] + delta.text, ""
            chunk = fmt.chunk(index, text, delta.logprobs, delta.finish_reason, delta.tool_calls)
            await sse.send(chunk)
        if include_usage:
            tokens = (choices.prompt_tokens, choices.completion_tokens, choices.cached_tokens)
            await sse.send(fmt.usage_chunk(*tokens))
        await sse.done()
    except ApiError as exc:
        if not sse.started:
            raise
        request[FINAL_STATUS] = exc.status
        await sse.send(exc.body())
        await sse.end()
    except (ClientGone, ConnectionResetError):
        request[FINAL_STATUS] = CLIENT_CLOSED
    return sse.response
