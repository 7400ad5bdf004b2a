"""What a worker's roles share: the prefill role's hand-off as the loop calls it, and the
generator of a request that a decode worker resumes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from shared.engine import Sequence
from shared.engine.engine import LLMEngine
from shared.kv.tier_client import TierClient
from shared.protocol import Generate
from shared.sampling import make_generator


class HandOffRole(Protocol):
    """The prefill role's hand-off (services/prefill/handoff.py), as the loop calls it."""

    def admit(self, req: Generate, seq: Sequence) -> None: ...
    def hands_on(self, seq_id: int, finish_reason: str | None) -> bool: ...
    def forget(self, seq_id: int, request_id: str) -> None: ...
    def poll(self) -> None: ...
    @property
    def waiting(self) -> bool: ...


# (the engine, the kvcache client if any, a send to the gateway) -> the role
HandOffFactory = Callable[[LLMEngine, TierClient | None, Callable[[object], None]], HandOffRole]


def resumed_generator(req: Generate, device: str) -> torch.Generator | None:
    """The request's seeded generator: as a prefill worker left it (its state, when it was a
    generator of this device's type), else seeded afresh (offset by the tokens already drawn,
    so that a resumed request does not repeat its first draws)."""
    seed = req.sampling.seed
    if seed is None:
        return None
    gen = make_generator(seed + len(req.output_ids), device)
    if req.rng_state and req.rng_device == gen.device.type:
        try:
            gen.set_state(torch.frombuffer(bytearray(req.rng_state), dtype=torch.uint8))
        except RuntimeError:  # a state of another build: the fresh seed stands
            gen = make_generator(seed + len(req.output_ids), device)
    return gen
