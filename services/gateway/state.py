"""What every handler of one gateway app shares, stored on the app under `GATEWAY`."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.router import Router
from services.gateway.served_model import ServedModel


@dataclass(frozen=True)
class Gateway:
    config: GatewayConfig
    model: ServedModel
    router: Router
    metrics: GatewayMetrics
    prompts: PromptEncoder  # text -> ids off the event loop for long texts

    def max_model_len(self) -> int:
        """The longest sequence a request may have: what the ready workers take, or before
        any is ready, the model's own context length."""
        return self.router.registry.max_model_len() or self.model.context_length


GATEWAY = web.AppKey("skiff_gateway", Gateway)
# The status a streamed response really ended with (its HTTP status is 200 once started).
FINAL_STATUS = web.RequestKey("skiff_final_status", int)
CLIENT_CLOSED = 499  # nginx's status for "client closed request": metrics only, never sent
