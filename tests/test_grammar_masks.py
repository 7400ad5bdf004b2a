"""The token masks of structured output (shared/grammar/masks.py) and an engine that uses them on
CUDA (`pytest -m gpu` for the latter).

``apply_masks`` against a reference that unpacks every bit with numpy: random logits (float32,
bfloat16), random masks (all-zero and all-one rows among them), a random subset of rows in any
order, vocabularies that are not a multiple of 32 (the last word's extra bits ignored); the rows
not masked and the input stay bit for bit as they were. On CUDA the same cases equal the CPU's
result. An engine on CUDA with graphs and overlapped steps (and one on the CPU, without graphs)
runs 8 sequences, 3 under JSON schemas: their outputs parse and validate, the others' greedy
tokens are those of the same sequences run without any grammar, and the runner's grammar
counters count a masked step per constrained token of the longest output and a row per token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.grammar import apply_masks

CASES = [(1, 1), (31, 3), (33, 4), (320, 8), (1000, 16), (4099, 5)]  # (vocab, batch)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _case(vocab: int, batch: int, seed: int, dtype: torch.dtype):
    """(logits [batch, vocab], the masked rows, their int32 masks [rows, ceil(vocab / 32)])."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((batch, vocab), dtype=np.float32)).to(dtype)
    rows = random.Random(seed).sample(range(batch), random.Random(seed + 1).randint(1, batch))
    words = rng.integers(0, 2**32, (len(rows), (vocab + 31) // 32), dtype=np.uint64)
    masks = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    if len(rows) > 2:
        masks[0] = -1  # every token allowed
        masks[-1] = 0  # none (never asked for: a grammar always allows something)
    return logits, rows, masks


def _reference(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """Bit t of word t // 32 of a row's mask, read one at a time: 0 puts token t at -inf."""
    vocab = logits.shape[1]
    words = masks.numpy().view(np.uint32)
    bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].astype(bool)
    assert all(
        allowed[k, t] == bool(int(words[k, t // 32]) >> (t % 32) & 1)
        for k in range(len(rows))
        for t in (0, vocab // 2, vocab - 1)
    )  # the unpacking reads bit t % 32, least significant first
    out = logits.clone()
    for k, row in enumerate(rows):
        out[row, torch.from_numpy(~allowed[k])] = float("-inf")
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("vocab, batch", CASES)
def test_apply_masks_matches_the_bits(vocab: int, batch: int, dtype: torch.dtype) -> None:
    for seed in range(3):
        logits, rows, masks = _case(vocab, batch, seed, dtype)
        before = logits.clone()
        got = apply_masks(logits, rows, masks)
        want = _reference(logits, rows, masks)
        assert _same_bits(got, want), (vocab, batch, seed)
        assert _same_bits(logits, before)  # a new tensor: the input is left as it was
        for row in set(range(batch)) - set(rows):
            assert _same_bits(got[row], before[row])
        if len(rows) > 2:  # the all-one and all-zero masks
            assert _same_bits(got[rows[0]], before[rows[0]]) and torch.isinf(got[rows[-1]]).all()


@pytest.fixture(scope="module")
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("vocab, batch", CASES)
def test_apply_masks_on_cuda_equals_the_cpu(
    cuda: str, vocab: int, batch: int, dtype: torch.dtype
) -> None:
    for seed in range(3):
        logits, rows, masks = _case(vocab, batch, seed, dtype)
        want = apply_masks(logits, rows, masks)
        # pinned, as fill_masks leaves them for a GPU's logits
        got = apply_masks(logits.to(cuda), rows, masks.pin_memory())
        assert got.device.type == "cuda"
        assert _same_bits(got.cpu(), want), (vocab, batch, seed)


# -- an engine on CUDA: graphs, overlapped steps, masks ------------------------------------------

# tests/test_gpu_model.py's gemma3 (through graphs and overlapped steps there too)
GEMMA3 = dict(arch="gemma3", n_layers=6, n_heads=4, n_kv_heads=1, head_dim=128, sliding_window=64)
CONSTRAINED = {1: 0, 4: 1, 6: 2}  # sequence -> its schema (tests/test_structured_engine.SCHEMAS)
FREE_TOKENS = 32  # the unconstrained sequences' length (each to the end: no stop ids)
MAX_MODEL_LEN = 256  # < 512: one decode graph a bucket, whatever the batch's context


def _parts(d: Path, device: str, graphs: bool) -> tuple:
    """The model, its KV pool and captured graphs (None without; shared by the runs), the
    tokenizer and the worker's grammar compiler."""
    from shared.engine.cuda_graphs import StepGraphs
    from shared.kv import KVPool
    from shared.loader import GGUFFile
    from shared.model import load_model
    from shared.tokenizer import load_tokenizer
    from shared.worker.constraints import Constraints
    from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

    path = write_synthetic_gguf(d / "gemma3.gguf", SynthSpec(**GEMMA3))
    f = GGUFFile(path, cache_dir=d / "cache")
    model = load_model(f, device)
    tok = load_tokenizer(f.metadata)
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 256, 16, cfg.n_kv_heads, cfg.head_dim, torch.float32, device)
    g = None
    if graphs:
        g = StepGraphs(model, kv, max_seqs=16, max_model_len=MAX_MODEL_LEN, max_batch_tokens=96)
        g.capture()
    return model, kv, g, tok, Constraints(tok, cfg.vocab_size)


def _generate(parts, device: str, constrained: bool) -> tuple[dict, object, list[int]]:
    """8 sequences through an overlapped engine (the parts' graphs, when any): {seq: (tokens,
    finish reason)}, the runner, and the batch sizes of the steps launched with a step in flight
    and a constrained sequence in them."""
    from services.gateway.structured import grammar_of
    from shared.engine import LLMEngine, Sequence
    from shared.engine.model_runner import ModelRunner
    from shared.kv import BlockManager
    from shared.sampling import SamplingParams, make_generator
    from tests.test_engine import prompt
    from tests.test_structured_engine import MAX_TOKENS, SCHEMAS

    model, kv, graphs, tok, constraints = parts
    runner = ModelRunner(model, kv, device, graphs)
    engine = LLMEngine(runner, BlockManager(kv.num_blocks, kv.block_size), MAX_MODEL_LEN, 96, 16,
                       overlap=True)  # fmt: skip
    for i in range(8):  # prompts of 6-13 tokens: 76 in all, one mixed step of 96
        seed = 11 if i == 6 else None  # one constrained sequence sampled, the rest greedy
        params = SamplingParams(temperature=0 if seed is None else 1.0, seed=seed).validate()
        schema = CONSTRAINED.get(i)
        if constrained and schema is not None:
            seq = Sequence(i, prompt(6 + i, seed=i), params, MAX_TOKENS, tok.stop_ids,
                           make_generator(seed, device))  # fmt: skip
            seq.constraint = constraints.compile(grammar_of({"guided_json": SCHEMAS[schema]}), [])
        else:
            seq = Sequence(i, prompt(6 + i, seed=i), params, FREE_TOKENS, frozenset(),
                           make_generator(seed, device))  # fmt: skip
        engine.add(seq)
    overlapped: list[int] = []
    real = runner.run

    def run(work, prev=None, ids=None, catch_up=None):
        if prev is not None and any(s.constraint for s, _ in work):
            overlapped.append(len(work))
        return real(work, prev, ids, catch_up)

    runner.run = run
    out: dict[int, list[int]] = {i: [] for i in range(8)}
    reasons: dict[int, str] = {}
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
            if ev.finish_reason:
                reasons[ev.seq_id] = ev.finish_reason
    engine.check_integrity()
    return {i: (ids, reasons[i]) for i, ids in out.items()}, runner, overlapped


def check_constrained_run(parts, device: str) -> None:
    """8 sequences, 3 under JSON schemas, against the same 8 without grammars: the batches
    keep their shapes (decode bucket 8 while the free sequences run), so a free sequence's
    rows go through the same graphs and kernels in both runs, and only a mask could change
    its tokens."""
    import jsonschema

    from tests.test_structured_engine import SCHEMAS

    tok = parts[3]
    got, runner, overlapped = _generate(parts, device, constrained=True)
    free, _, _ = _generate(parts, device, constrained=False)
    for i, schema in CONSTRAINED.items():
        ids, reason = got[i]
        text = tok.decode([t for t in ids if t not in tok.stop_ids])
        assert reason == "stop", (i, reason, text)
        jsonschema.validate(json.loads(text), SCHEMAS[schema])
    for i in set(range(8)) - set(CONSTRAINED):
        assert got[i] == free[i] and len(got[i][0]) == FREE_TOKENS, i
    stats = runner.grammar_stats
    longest = max(len(got[i][0]) for i in CONSTRAINED)
    # a masked step per constrained token of the longest, a row per constrained token (the
    # overlapped step after a sequence's last token finds its grammar complete: no mask)
    assert stats["steps"] == longest, (dict(stats), longest)
    assert stats["rows"] == sum(len(got[i][0]) for i in CONSTRAINED) > stats["steps"]
    assert stats["fill_us"] > 0 and stats["apply_us"] > 0 and stats["catch_up_us"] > 0
    assert len(overlapped) > 20  # the constrained steps ran with a step in flight


def test_structured_output_overlapped_on_the_cpu(tmp_path: Path) -> None:
    """The CUDA test's engine and checks without graphs, on the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_constrained_run(_parts(tmp_path, "cpu", graphs=False), "cpu")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.gpu
def test_structured_output_on_cuda_graphs_overlapped(cuda: str, tmp_path: Path) -> None:
    parts = _parts(tmp_path, cuda, graphs=True)
    graphs = parts[2]
    before = dict(graphs.replays)
    check_constrained_run(parts, cuda)
    assert graphs.replays["decode"] - before["decode"] > 40
    assert graphs.replays["mixed"] - before["mixed"] >= 2  # the prompts' step, in each run
