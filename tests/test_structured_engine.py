"""Structured output in the engine (shared/grammar, the runner's masks, the engine's stops): on
a synthetic Llama with random weights, so every token the grammar allows is as likely as any
other and only the masks keep the output in shape.

Greedy and sampled sequences under varied JSON schemas (nested objects, enums, arrays, required
fields, bounded numbers), a regex, a choice and a GBNF grammar answer text that matches (JSON
parses and validates with jsonschema) and stop by themselves ("stop", not "length"); a
constrained sequence beside unconstrained ones leaves their greedy tokens as they are; overlapped
steps (which fall back to synchronous ones while a grammar runs) give what synchronous ones give;
a resumed request's constraint picks up after the tokens it had."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import llguidance
import pytest
import torch

from services.gateway.structured import grammar_of
from shared.engine import LLMEngine, Sequence, TokenEvent
from shared.engine.model_runner import ModelRunner
from shared.kv import BlockManager, KVPool
from shared.loader import GGUFFile
from shared.model import load_model
from shared.sampling import SamplingParams, make_generator
from shared.tokenizer import load_tokenizer
from shared.worker.constraints import Constraints
from tests.test_engine import SPECS, prompt
from tools.synthetic_gguf import write_synthetic_gguf

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "boolean"}, "y": {"enum": [1, 2, 3]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "kind": {"enum": ["circle", "square"]},
        },
        "required": ["point", "kind"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(
        tmp_path_factory.mktemp("structured") / "llama.gguf", SPECS["llama"]
    )


@pytest.fixture(scope="module")
def parts(llama_path: Path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    f = GGUFFile(llama_path, cache_dir=llama_path.parent / "cache")
    model = load_model(f, "cpu")
    tok = load_tokenizer(f.metadata)
    yield model, tok, Constraints(tok, model.cfg.vocab_size)
    torch.set_num_threads(threads)


def _engine(model, overlap: bool = False) -> LLMEngine:
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 256, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
    return LLMEngine(ModelRunner(model, kv, "cpu"), BlockManager(256, 4), 256, 64, overlap=overlap)


def _seq(
    i: int, constraints: Constraints | None, grammar: str, seed: int | None, stops
) -> Sequence:
    params = SamplingParams(temperature=0 if seed is None else 1.0, seed=seed).validate()
    seq = Sequence(i, prompt(6 + i, seed=i), params, MAX_TOKENS, stops, make_generator(seed, "cpu"))
    if grammar:
        seq.constraint = constraints.compile(grammar, [])
    return seq


def _run(eng: LLMEngine, seqs: list[Sequence]) -> dict[int, tuple[list[int], str]]:
    for s in seqs:
        eng.add(s)
    out: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
    reasons: dict[int, str] = {}
    while eng.has_work():
        ev: TokenEvent
        for ev in eng.step():
            out[ev.seq_id].append(ev.token_id)
            if ev.finish_reason:
                reasons[ev.seq_id] = ev.finish_reason
    eng.check_integrity()
    return {i: (ids, reasons[i]) for i, ids in out.items()}


def _bytes(tok, text: bytes) -> list[int]:
    """The synthetic vocabulary's byte tokens of text (its SPM encoding would add a space)."""
    return [tok.token_to_id(f"<0x{b:02X}>") for b in text]


def _text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t not in tok.stop_ids])


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "sampled"])
def test_json_schemas_parse_and_validate(parts, seed: int | None) -> None:
    model, tok, constraints = parts
    grammars = [grammar_of({"guided_json": s}) for s in SCHEMAS]
    seqs = [
        _seq(i, constraints, g, seed and seed + i, tok.stop_ids) for i, g in enumerate(grammars)
    ]
    eng = _engine(model)
    got = _run(eng, seqs)
    for i, schema in enumerate(SCHEMAS):
        ids, reason = got[i]
        assert reason == "stop", (reason, _text(tok, ids))
        value = json.loads(_text(tok, ids))
        jsonschema.validate(value, schema)
        # one line, separators as json.dumps writes them
        assert _text(tok, ids) == json.dumps(value, ensure_ascii=False)
    # the prompts run in one step, then every step samples a token of each sequence left, each
    # under its mask: a masked step per token of the longest, a row per token
    stats = eng.runner.grammar_stats
    assert stats["steps"] == max(len(ids) for ids, _ in got.values())
    assert stats["rows"] == sum(len(ids) for ids, _ in got.values()) > stats["steps"]
    assert stats["fill_us"] > 0 and stats["apply_us"] > 0 and stats["catch_up_us"] == 0


def test_regex_choice_and_gbnf_are_matched(parts) -> None:
    model, tok, constraints = parts
    cases = [
        ({"guided_regex": r"[a-c]{2,5}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= "(" ("x" | "y")+ ")"'}, lambda t: re.fullmatch(r"\([xy]+\)", t)),
    ]
    seqs = [
        _seq(i, constraints, grammar_of(b), 3 + i, tok.stop_ids) for i, (b, _) in enumerate(cases)
    ]
    got = _run(_engine(model), seqs)
    for i, (_, matches) in enumerate(cases):
        ids, reason = got[i]
        assert reason == "stop" and matches(_text(tok, ids)), (reason, _text(tok, ids))


def test_a_constrained_sequence_leaves_the_others_greedy_tokens(parts) -> None:
    """The same batch shapes with the last sequence constrained or not: the other sequences'
    tokens are the same."""
    model, tok, constraints = parts
    grammar = grammar_of({"guided_json": SCHEMAS[1]})
    runs = []
    for constrained in (False, True):
        seqs = [_seq(i, constraints, "", None, frozenset()) for i in range(7)]
        seqs.append(_seq(7, constraints, grammar if constrained else "", None, frozenset()))
        runs.append(_run(_engine(model), seqs))
    for i in range(7):
        assert runs[0][i] == runs[1][i]
    assert runs[0][7] != runs[1][7]


def test_overlapped_steps_equal_synchronous_ones(parts) -> None:
    """Constrained sequences keep the steps overlapped: a step is launched while the one before
    it is in flight, and its masks wait for that step's tokens only after its forward."""
    model, tok, constraints = parts
    grammar = grammar_of({"guided_json": SCHEMAS[0]})
    runs, overlapped = [], []
    for overlap in (False, True):
        eng = _engine(model, overlap)
        real = eng.runner.run

        def run(work, prev=None, ids=None, catch_up=None, real=real):
            if prev is not None and any(s.constraint for s, _ in work):
                overlapped.append(len(work))
            return real(work, prev, ids, catch_up)

        eng.runner.run = run
        seqs = [
            _seq(i, constraints, grammar if i % 2 else "", None, tok.stop_ids) for i in range(4)
        ]
        runs.append(_run(eng, seqs))
    assert runs[0] == runs[1]
    assert len(overlapped) > 20  # the steps with constrained sequences overlapped
    assert eng.runner.grammar_stats["catch_up_us"] > 0  # the overlapped engine's (the last)
    json.loads(_text(tok, runs[1][1][0]))


def test_a_resumed_constraint_continues_after_its_tokens(parts) -> None:
    """What a decode worker does with a request a prefill worker began: the grammar is advanced
    over the tokens given, and a token the grammar refuses there is an error (a 400)."""
    model, tok, constraints = parts
    grammar = grammar_of({"guided_choice": ["alpha", "beta"]})
    head = _bytes(tok, b"al")
    constraint = constraints.compile(grammar, head)
    masks = constraint.matcher.compute_bitmask()
    allowed = [t for t in range(tok.vocab_size) if masks[t // 8] >> (t % 8) & 1]
    assert allowed and all("alpha".startswith("al" + tok.decode([t])) for t in allowed)
    with pytest.raises(ValueError, match="refused"):
        constraints.compile(grammar, _bytes(tok, b"x"))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
