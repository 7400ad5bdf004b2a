"""record_results: replace a function by one that records what the real one returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def record_results(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, real: Callable | None = None
) -> list[Any]:
    """Patches owner.name (for the test) to call `real` (default: owner.name itself) and
    append each result to the returned list."""
    real = real if real is not None else getattr(owner, name)
    seen: list[Any] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(owner, name, recorded)
    return seen
