"""The kernel tests' two tiers.

CPU CI runs the representative tier under Triton's interpreter: every kernel with every weight
type at one shape (and one split, one tile). The rest of a sweep is the exhaustive tier, marked
``exhaustive``: the GPU suite (tools/gpu_suite.sh) runs it natively, where it takes seconds.

A test module names what its CPU tier keeps, by parameter: ``CPU_TIER = {"split": {1},
"shape": {(32, 256)}}``. A parametrized case whose value of a named parameter is outside its
set is marked ``exhaustive``; parameters the dict does not name (the weight type) are kept
whole. A key naming a test function instead holds a predicate over that function's parameter
values, for tiers that couple parameters: ``{"test_rows": lambda p: p["m"] == 5 or p["qtype"]
== T.Q4_K}`` keeps one config for every type and the other for one type. A test function whose
every case would leave the CPU tier is an error: no kernel path loses its CPU test.
"""

from __future__ import annotations

from collections import defaultdict

import pytest


def cpu_tier_case(params: dict, tier: dict, test: str = "") -> bool:
    """Whether a case of the function `test` with these parameter values belongs to the CPU
    tier of `tier`."""
    own = tier.get(test)
    if own is not None and not own(params):
        return False
    return all(
        params[name] in keep
        for name, keep in tier.items()
        if name in params and not name.startswith("test_")
    )


def mark_exhaustive(items: list[pytest.Item]) -> None:
    """Mark the cases outside their module's CPU_TIER exhaustive (collection hook)."""
    kept: dict[tuple, bool] = defaultdict(bool)
    for item in items:
        tier = getattr(item.module, "CPU_TIER", None) if hasattr(item, "module") else None
        params = getattr(getattr(item, "callspec", None), "params", None)
        if not tier or params is None:
            continue
        key = (item.module.__name__, item.originalname)
        if cpu_tier_case(params, tier, item.originalname):
            kept[key] = True
        else:
            item.add_marker(pytest.mark.exhaustive)
            kept.setdefault(key, False)
    lost = sorted(f"{m}::{f}" for (m, f), k in kept.items() if not k)
    if lost:
        raise pytest.UsageError(f"CPU_TIER leaves these tests no CPU case: {', '.join(lost)}")
