"""The kernel tests' tiers (tests/tiers.py): which cases CPU CI keeps, and the refusal to leave a
test without a CPU case."""

from __future__ import annotations

import types

import pytest

from tests.tiers import cpu_tier_case, mark_exhaustive


class _Item:
    def __init__(self, module, name: str, params: dict) -> None:
        self.module, self.originalname = module, name
        self.callspec = types.SimpleNamespace(params=params)
        self.marks: list[str] = []

    def add_marker(self, mark) -> None:
        self.marks.append(mark.name)


def test_a_case_stays_on_the_cpu_when_every_named_value_is_kept() -> None:
    tier = {"split": {1}, "shape": {(32, 256)}}
    assert cpu_tier_case({"qtype": 12, "split": 1, "shape": (32, 256)}, tier)
    assert not cpu_tier_case({"qtype": 12, "split": 4, "shape": (32, 256)}, tier)
    assert cpu_tier_case({"qtype": 14}, tier)  # parameters the tier does not name: all kept


def test_a_function_of_its_own_couples_parameters() -> None:
    tier = {"split": {1, 2}, "test_a": lambda p: p["m"] == 5 or p["qtype"] == 12}
    assert cpu_tier_case({"qtype": 14, "m": 5, "split": 2}, tier, "test_a")
    assert not cpu_tier_case({"qtype": 14, "m": 3, "split": 1}, tier, "test_a")
    assert cpu_tier_case({"qtype": 12, "m": 3, "split": 1}, tier, "test_a")
    assert not cpu_tier_case({"qtype": 12, "m": 3, "split": 4}, tier, "test_a")  # and the sets
    assert cpu_tier_case({"qtype": 14, "m": 3, "split": 1}, tier, "test_b")  # not its function


def test_cases_outside_the_tier_are_marked_exhaustive() -> None:
    mod = types.SimpleNamespace(__name__="m", CPU_TIER={"split": {1}})
    items = [_Item(mod, "test_a", {"qtype": q, "split": s}) for q in (12, 14) for s in (1, 4)]
    mark_exhaustive(items)
    assert [i.marks for i in items] == [[], ["exhaustive"], [], ["exhaustive"]]


def test_a_test_left_without_a_cpu_case_is_an_error() -> None:
    mod = types.SimpleNamespace(__name__="m", CPU_TIER={"split": {2}})
    items = [_Item(mod, "test_b", {"split": s}) for s in (1, 4)]
    with pytest.raises(pytest.UsageError, match="m::test_b"):
        mark_exhaustive(items)
