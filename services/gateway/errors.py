"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Handlers raise `ApiError`; the app's middleware turns it into the response, so a check deep in
request parsing can name the offending field without knowing about HTTP.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

# OpenAI's `type` for each status family; clients (the openai SDK) map the status, not the type.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A request that ends in an error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "api_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """The common case: a 400 naming the field at fault."""
    return ApiError(400, message, param=param, code=code)


def shown(value: object) -> str:
    """A value as an error message quotes it: its type and the start of its JSON."""
    text = msgspec.json.encode(value).decode()
    return f"{type(value).__name__} {text[:40]}"
