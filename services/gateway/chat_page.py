"""The chat web page at `/`: the static files of services/gateway/static (no build step, nothing
from a CDN). The page and its files need no API key; its API calls send the key typed into it."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
STATIC_PREFIX = "/static/"


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_static(STATIC_PREFIX, STATIC)


def is_open(path: str) -> bool:
    """Whether a path is the page or one of its files (served without an API key)."""
    return path == "/" or path.startswith(STATIC_PREFIX)
