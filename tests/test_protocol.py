"""Every wire message survives a round trip; the protocol module imports no runtime code."""

from __future__ import annotations

import ast
import inspect

import msgspec
import pytest

import shared.protocol as P

SAMPLES = [
    P.Generate("r1", [1, 2, 3], 16),
    P.Generate("r2", [5] * 300, 4096, P.Sampling(0.0, 40, 0.9, 0.05, 1.1, 0.5, -0.5, 7, 5), [2, 7]),
    P.Generate("r3", [1, 2], 8, prefill_only=True),
    P.Generate("r4", [1, 2], 8, output_ids=[9], rng_state=bytes(range(16)), rng_device="cuda"),
    P.Abort("r1"),
    P.WorkerReady(
        "w1", "cuda:0", "NVIDIA H200", ["prefill", "decode"], "m.gguf", 1000, 16, 8192, 1234
    ),
    P.Heartbeat("w1", 10, 990, 3, 1),
    P.Heartbeat("w1", 10, 990, 3, 1, {"stored": 5, "restored": 2}),
    P.Heartbeat("w1", 10, 990, 3, 1, spec={"steps": 4, "drafted:prompt": 9}),
    P.Heartbeat("w1", 10, 990, 3, 1, grammar={"steps": 7, "rows": 12, "fill_us": 840}),
    P.Rejected("r3", 400, "too long"),
    P.Prefilled("r4", [9], b"\x00\xff" * 8, "cpu", 12),
    P.StepTokens(
        "w1", [P.TokenOut("r1", 42), P.TokenOut("r2", 7, -0.25, [7, 8], [-0.25, -2.0], "length")]
    ),
    P.StepTokens("w1", []),
    P.StepTokens("w1", [P.TokenOut("r1", 42, cached_tokens=512)]),
    P.KVHello("w1", "ab" * 16, 737280, 64),
    P.KVPut("i1", [P.KVBlock(2**64 - 1, 3, list(range(16)))]),
    P.KVLookup("i1", 7, [1, 2**63, 2**64 - 1]),
    P.KVRelease("i1", [3, 4]),
    P.KVAlive("i1"),
    P.KVAttach("i1", "/dev/shm/skiff-kv-i1-ab", 1024, 737280, [0, 1, 2]),
    P.KVGrant("i1", [5]),
    P.KVGrant("i1", [5, 6], upto=40),
    P.KVPut("i1", [P.KVBlock(1, 3, [1] * 16)], upto=40),
    P.KVFound("i1", 7, [P.KVBlock(1, 3, [1] * 16)]),
    P.KVFound("i1", 8, []),
    P.KVStale("i2"),
    P.SpecAsk([P.SpecSeq(3, 0, [1, 2, 3], 4), P.SpecSeq(4, 17, [9], 0, "code")]),
    P.SpecEnd([3, 4]),
    P.SpecDrafts([P.SpecDraft(3, 3, [4, 5], "prompt")], unknown=[4]),
    P.SpecDrafts([]),
    P.StageStep(
        3,
        P.StageBatch([5, 6], [7, 8], [39, 40], [1], [2, 0], 1, [0, 2], [9]),
        ["bfloat16", "float32"],
    ),
    P.StageStop(),
    P.StageAssign(
        2,
        "/m/llama.gguf",
        4_920_000_000,
        [16, 32],
        900,
        16,
        "auto",
        "tcp://10.0.0.1:5602",
        "tcp://10.0.0.1:5603",
    ),  # fmt: skip
    P.StageReady(1, "cpu", "CPU", [15, 30], 728, "torch int4"),
    P.StageFailed(1, "out of memory"),
]


def direction(msg: object) -> object:
    if isinstance(msg, P.Generate | P.Abort):
        return P.GatewayToWorker
    if isinstance(msg, P.StepTokens):
        return P.WorkerTokens
    if isinstance(msg, P.KVHello | P.KVPut | P.KVLookup | P.KVRelease | P.KVAlive):
        return P.WorkerToKV
    if isinstance(msg, P.KVAttach | P.KVGrant | P.KVFound | P.KVStale):
        return P.KVToWorker
    if isinstance(msg, P.SpecAsk | P.SpecEnd):
        return P.WorkerToSpec
    if isinstance(msg, P.SpecDrafts):
        return P.SpecToWorker
    if isinstance(msg, P.StageStep | P.StageStop | P.StageAssign):
        return P.StageToStage
    if isinstance(msg, P.StageReady | P.StageFailed):
        return P.StageToLead
    return P.WorkerToGateway


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    frame = P.encoder().encode(msg)
    assert isinstance(frame, bytes)
    assert P.decoder(direction(msg)).decode(frame) == msg


def test_every_message_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(P.ALL_MESSAGES)


def test_tags_are_unique_and_directions_are_disjoint() -> None:
    tags = [m.__struct_config__.tag for m in P.ALL_MESSAGES]
    assert len(tags) == len(set(tags))
    frame = P.encoder().encode(P.Abort("x"))
    with pytest.raises(msgspec.ValidationError):
        P.decoder(P.WorkerToGateway).decode(frame)


def test_malformed_frames_raise_decode_errors() -> None:
    with pytest.raises(msgspec.DecodeError):
        P.decoder(P.GatewayToWorker).decode(b"\x00garbage")
    bad = P.encoder().encode(["gen", "r1", "not a list", 3])
    with pytest.raises(msgspec.ValidationError):
        P.decoder(P.GatewayToWorker).decode(bad)


def test_protocol_imports_no_runtime_code() -> None:
    tree = ast.parse(inspect.getsource(P))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "typing", "msgspec"}, imported


def test_no_pickle_anywhere_in_the_code() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    offenders = [
        str(p.relative_to(root))
        for folder in ("shared", "services")
        for p in (root / folder).rglob("*.py")
        if "import pickle" in p.read_text() or "send_pyobj" in p.read_text()
    ]
    assert offenders == []


def test_wire_sampling_has_the_runtime_fields() -> None:
    # the worker builds SamplingParams(**asdict(Sampling)) less the grammar (structured output,
    # compiled apart): the two must keep the same fields
    import dataclasses

    from shared.sampling import SamplingParams

    runtime = tuple(f.name for f in dataclasses.fields(SamplingParams))
    assert P.Sampling.__struct_fields__ == (*runtime, "grammar")
