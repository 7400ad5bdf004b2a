"""The gateway's aiohttp application: routes, the middleware (auth, errors, request metrics),
/health and /metrics, and the router's lifetime (sockets bound on startup, closed on cleanup).

Run it with `handler_cancellation=True` (as __main__ does) so that a client that disconnects
cancels its handler at once; handlers also poll for a closed connection, so it works without.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from services.gateway import chat_page, openai_api, tokenize_api
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.router import Router
from services.gateway.served_model import ServedModel
from services.gateway.state import CLIENT_CLOSED, FINAL_STATUS, GATEWAY, Gateway

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20  # long prompts as token-id lists run to megabytes
OPEN_PATHS = frozenset({"/health"})  # reachable without an API key (load balancer probes)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(config: GatewayConfig, model: ServedModel | None = None) -> web.Application:
    """The app for `config`; `model` skips reading the GGUF header again (tests)."""
    model = model or ServedModel.load(config.model, config.served_model_name)
    gw = Gateway(
        config=config,
        model=model,
        router=Router(config.worker_bind, config.tokens_bind, config.heartbeat_timeout_s),
        metrics=GatewayMetrics(),
        prompts=PromptEncoder(model.tokenizer),
    )
    app = web.Application(middlewares=[_middleware(gw)], client_max_size=MAX_BODY_BYTES)
    app[GATEWAY] = gw
    app.cleanup_ctx.append(_router_lifetime)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_get("/v1/models", openai_api.list_models)
    app.router.add_get("/v1/models/{model}", openai_api.get_model)
    app.router.add_post("/tokenize", tokenize_api.tokenize)
    app.router.add_post("/detokenize", tokenize_api.detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    chat_page.add_routes(app)
    return app


async def _router_lifetime(app: web.Application) -> AsyncIterator[None]:
    router = app[GATEWAY].router
    await router.start()
    log.info("workers connect to %s, push tokens to %s", router.worker_bind, router.tokens_bind)
    yield
    await router.close()


def _middleware(gw: Gateway) -> Callable:
    keys = [k.encode() for k in gw.config.api_keys]

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if keys and request.path not in OPEN_PATHS and not chat_page.is_open(request.path):
                _authenticate(request, keys)
            response = await handler(request)
            status = request.get(FINAL_STATUS, response.status)
        except ApiError as exc:
            response, status = exc.response(), exc.status
        except web.HTTPException as exc:  # aiohttp's own: unknown path, wrong method, too large
            if exc.status < 400:
                raise
            err = ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}")
            response, status = err.response(), exc.status
        except asyncio.CancelledError:  # the client left and aiohttp cancelled the handler
            _count(gw, request, CLIENT_CLOSED)
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            err = ApiError(500, "internal server error (see the gateway log)")
            response, status = err.response(), 500
        _count(gw, request, status)
        return response

    return middleware


def _count(gw: Gateway, request: web.Request, status: int) -> None:
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    gw.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


def _authenticate(request: web.Request, keys: list[bytes]) -> None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            type_="invalid_request_error",
        )
    given = token.strip().encode()
    # Compare against every key without stopping early, so timing does not reveal which matched.
    if not any([hmac.compare_digest(given, k) for k in keys]):  # noqa: C419
        raise ApiError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            type_="invalid_request_error",
        )


async def health(request: web.Request) -> web.Response:
    ready = len(request.app[GATEWAY].router.registry.ready_workers())
    if ready == 0:
        return web.json_response({"status": "no workers ready"}, status=503)
    return web.json_response({"status": "ok", "workers": ready})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = gw.metrics.render(gw.router.registry, gw.router.moves)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
