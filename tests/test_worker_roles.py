"""A request resumed on a decode worker: its seeded generator goes on where the prefill
worker's left off (same device type), or starts afresh from the seed and the tokens drawn."""

from __future__ import annotations

import torch

from shared.protocol import Generate, Sampling
from shared.sampling import make_generator
from shared.worker.roles import resumed_generator


def test_generator_state_moves_with_the_request() -> None:
    gen = make_generator(1234, "cpu")
    torch.rand(7, generator=gen)  # the prefill worker's first draw
    state = bytes(gen.get_state().numpy())
    want = torch.rand(5, generator=gen)
    req = Generate("r", [1, 2], 8, Sampling(seed=1234), output_ids=[9], rng_state=state,
                   rng_device="cpu")  # fmt: skip
    assert torch.equal(torch.rand(5, generator=resumed_generator(req, "cpu")), want)


def test_another_device_type_or_no_state_seeds_afresh() -> None:
    base = Generate("r", [1, 2], 8, Sampling(seed=5), output_ids=[9, 10])
    fresh = torch.rand(4, generator=make_generator(5 + 2, "cpu"))
    for req in (base, Generate("r", [1], 8, Sampling(seed=5), output_ids=[9, 10],
                               rng_state=b"\x01" * 16, rng_device="cuda")):  # fmt: skip
        assert torch.equal(torch.rand(4, generator=resumed_generator(req, "cpu")), fresh)
    assert resumed_generator(Generate("r", [1], 8), "cpu") is None  # unseeded


def test_a_state_that_does_not_load_seeds_afresh() -> None:
    req = Generate("r", [1], 8, Sampling(seed=5), output_ids=[3], rng_state=b"\x00" * 3,
                   rng_device="cpu")  # fmt: skip
    fresh = torch.rand(4, generator=make_generator(6, "cpu"))
    assert torch.equal(torch.rand(4, generator=resumed_generator(req, "cpu")), fresh)
