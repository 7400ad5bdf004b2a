"""The model and engine on a CUDA device agree with the CPU reference (run with `pytest -m gpu`).

The CPU path itself is checked against llama.cpp in test_logits.py; here the same models (the
synthetic ones quantized by llama.cpp, carried in SKIFF_MODELS_DIR/synthetic, plus fresh F32
qwen2/qwen3/gemma3 ones, and the real models when present) run on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shared.loader import GGUFFile
from tests.oracle import compare, skiff_logits
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

pytestmark = pytest.mark.gpu

ARCH_SPECS = [
    SynthSpec(arch="qwen2", n_layers=2),
    SynthSpec(arch="qwen3", n_layers=2),
    SynthSpec(arch="gemma3", n_layers=6, n_heads=4, n_kv_heads=1, head_dim=128, sliding_window=64),
]


def gpu_models(synthetic_dir: Path) -> list[Path]:
    for spec in ARCH_SPECS:
        path = synthetic_dir / f"{spec.name}.f32.gguf"
        if not path.exists():
            write_synthetic_gguf(path, spec)
    found = sorted(p for p in synthetic_dir.glob("*.gguf") if "dequant" not in p.name)
    return found


@pytest.fixture(scope="module")
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return "cuda"


def _ids(n: int, vocab: int = 512, seed: int = 0) -> list[int]:
    return [1] + np.random.default_rng(seed).integers(3, vocab, n - 1).tolist()


def test_gpu_logits_match_cpu(cuda: str, synthetic_dir: Path) -> None:
    models = gpu_models(synthetic_dir)
    assert len(models) >= 3
    for path in models:
        ids = _ids(300, vocab=len(GGUFFile(path).metadata["tokenizer.ggml.tokens"]))
        cpu = skiff_logits(path, ids, "cpu")
        gpu = skiff_logits(path, ids, cuda)
        got = compare(gpu, cpu)
        print(f"\n{path.name} cuda fp32 vs cpu: {got}")
        assert got.top1 >= 0.99 and got.mean_abs_diff < 0.01, path.name


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_gpu_real_model_matches_cpu(cuda: str, which: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{which}_path")
    ids = _ids(300, vocab=40000, seed=2)
    cpu = skiff_logits(path, ids, "cpu")
    got = compare(skiff_logits(path, ids, cuda), cpu)
    print(f"\n{which} cuda fp32 vs cpu: {got}, cpu logit std {cpu.std():.2f}")
    # fp32 summation order differs between the devices: allow 0.3 % of the logits' spread
    assert got.top1 >= 0.99 and got.mean_abs_diff < 0.003 * cpu.std()


def test_gpu_engine_greedy_matches_cpu(cuda: str, synthetic_dir: Path) -> None:
    """Four sequences decoded together (the batch rows GEMV's rows), greedy, as on the CPU;
    their rows rounded to int8 by the RMSNorm (linear.ROUND_AHEAD_ROWS)."""
    from shared.engine import Sequence
    from shared.engine.engine import LLMEngine
    from shared.engine.model_runner import ModelRunner
    from shared.kv import BlockManager, KVPool
    from shared.loader import GGUFFile
    from shared.model import load_model
    from shared.sampling import SamplingParams

    path = next(p for p in gpu_models(synthetic_dir) if "Q4_K_M" in p.name or "gemma3" in p.name)

    def generate(device: str) -> list[list[int]]:
        model = load_model(GGUFFile(path), device)
        cfg = model.cfg
        kv = KVPool(cfg.n_layers, 64, 16, cfg.n_kv_heads, cfg.head_dim, torch.float32, device)
        engine = LLMEngine(ModelRunner(model, kv, device), BlockManager(64, 16), 1024, 64)
        for i, n in enumerate((5, 17, 40, 90)):
            engine.add(Sequence(i, _ids(n, seed=i), SamplingParams(temperature=0), 16))
        out: dict[int, list[int]] = {i: [] for i in range(4)}
        while engine.has_work():
            for ev in engine.step():
                out[ev.seq_id].append(ev.token_id)
        assert engine.blocks.num_free == 64
        return [out[i] for i in range(4)]

    assert generate(cuda) == generate("cpu")


def _generate_gemma3(
    cuda: str, synthetic_dir: Path, graphs: bool, budget: int, overlap: bool = False
) -> tuple:
    """20 sequences (prompts of 5-138 tokens, greedy and sampled) through the engine on the
    synthetic gemma3 model with a `budget`-token step: (their tokens, the graphs' replay counts,
    or None without graphs). With budget 512 every prompt fits one step (decode graphs only);
    with 96 the longer prompts are chunked beside decodes (mixed-step graphs too)."""
    from shared.engine import Sequence
    from shared.engine.cuda_graphs import StepGraphs
    from shared.engine.engine import LLMEngine
    from shared.engine.model_runner import ModelRunner
    from shared.kv import BlockManager, KVPool
    from shared.loader import GGUFFile
    from shared.model import load_model
    from shared.sampling import SamplingParams, make_generator

    path = next(p for p in gpu_models(synthetic_dir) if "gemma3" in p.name)
    model = load_model(GGUFFile(path), cuda)
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 512, 16, cfg.n_kv_heads, cfg.head_dim, torch.float32, cuda)
    g = None
    if graphs:
        mixed = budget if budget < 512 else 0
        g = StepGraphs(model, kv, max_seqs=32, max_model_len=1024, max_batch_tokens=mixed)
        g.capture()
    engine = LLMEngine(
        ModelRunner(model, kv, cuda, g), BlockManager(512, 16), 1024, budget, 32, overlap=overlap
    )
    for i in range(20):  # 20 sequences: buckets 24 and below, with padding
        params = SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i)
        engine.add(
            Sequence(i, _ids(5 + 7 * i, seed=i), params, 24, generator=make_generator(i, cuda))
        )
    out: dict[int, list[int]] = {i: [] for i in range(20)}
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    engine.check_integrity()
    return [out[i] for i in range(20)], (dict(g.replays) if g is not None else None)


def test_cuda_graph_decode_matches_eager(cuda: str, synthetic_dir: Path) -> None:
    graphs, replays = _generate_gemma3(cuda, synthetic_dir, graphs=True, budget=512)
    assert graphs == _generate_gemma3(cuda, synthetic_dir, graphs=False, budget=512)[0]
    assert replays["decode"] > 5 and replays["mixed"] == 0


def test_cuda_graph_overlapped_steps_match_eager(cuda: str, synthetic_dir: Path) -> None:
    """Overlapped steps (the tokens in flight filled in on the device by the graph's staged
    inputs) through decode and mixed graphs give the tokens of eager steps one at a time; the
    steps' inputs are built into pinned memory (read there by the staging kernel) and the
    sampled ids stored into pinned memory by a kernel."""
    graphs, replays = _generate_gemma3(cuda, synthetic_dir, graphs=True, budget=96, overlap=True)
    assert replays["mixed"] > 5 and replays["decode"] > 5
    assert graphs == _generate_gemma3(cuda, synthetic_dir, graphs=False, budget=96)[0]


def test_cuda_graph_decode_split_count_follows_the_context(
    cuda: str, synthetic_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode buckets are captured at several attention slice counts (at batch 1: those of 512
    and 1024 keys, one key tile a slice) and a step replays the graph of the fewest slices not
    below its own rule's: up to 192 keys (at most one slice a key tile, the last partial) the
    bucket's fewest; the tokens are eager's (test_cuda_graph_decode_matches_eager)."""
    import shared.engine.cuda_graphs as cg

    seen: list[tuple[list, int, object]] = []
    real = cg.pick_decode_graph

    def spy(graphs: list, want: int, tile_keys: int):
        seen.append((list(graphs), want, real(graphs, want, tile_keys), tile_keys))
        return seen[-1][2]

    monkeypatch.setattr(cg, "pick_decode_graph", spy)
    _, replays = _generate_gemma3(cuda, synthetic_dir, graphs=True, budget=512)
    assert len(seen) == replays["decode"] > 5
    fewest = lambda gs, keys: min([g for g in gs if g.tile_keys == keys] or gs)  # noqa: E731
    assert all(
        want <= -(-192 // keys) and got == fewest(graphs, keys) for graphs, want, got, keys in seen
    )
    assert any(len(graphs) > 1 for graphs, _, _, _ in seen)


def test_cuda_graph_mixed_steps_match_eager(cuda: str, synthetic_dir: Path) -> None:
    """Prompt chunks beside decodes (a 96-token budget chunks the longer prompts) replayed from
    the mixed-step graphs give the same tokens as eager steps."""
    graphs, replays = _generate_gemma3(cuda, synthetic_dir, graphs=True, budget=96)
    assert graphs == _generate_gemma3(cuda, synthetic_dir, graphs=False, budget=96)[0]
    assert replays["mixed"] > 5 and replays["decode"] > 5


def test_cuda_graph_mixed_steps_split_k_match_eager(
    cuda: str, synthetic_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above with attention split-K in the chunks' steps (thresholds lowered so that
    prefixes of 16 keys count as long): graphs read the slice count on the device."""
    import shared.engine.cuda_graphs as cg
    import shared.kernels.attention_plan as plan
    import shared.kernels.paged_attention as pa
    from tests.spies import record_results

    chosen = record_results(monkeypatch, cg, "chunk_num_splits")
    for module in (pa, plan):  # the wrapper's windowed-layer test reads pa's
        monkeypatch.setattr(module, "CHUNK_SPLIT_MIN_CONTEXT", 16)
    monkeypatch.setattr(plan, "_CHUNK_SPLIT_MIN_KEYS", 16)
    graphs, replays = _generate_gemma3(cuda, synthetic_dir, graphs=True, budget=96)
    assert max(chosen) > 1 and replays["mixed"] > 5
    assert graphs == _generate_gemma3(cuda, synthetic_dir, graphs=False, budget=96)[0]


def test_mixed_graph_logits_match_eager_q4_k_m(cuda: str, synthetic_dir: Path) -> None:
    """A quantized model's mixed step through a graph (bf16, padded to 64 tokens: other matmul
    paths than the 35 real rows take eagerly) gives the eager logits up to summation order."""
    from shared.engine.cuda_graphs import StepGraphs
    from shared.kv import KVPool
    from shared.loader import GGUFFile
    from shared.model import ForwardBatch, SeqChunk, load_model

    path = next((p for p in sorted(synthetic_dir.glob("*Q4_K_M.gguf"))), None)
    if path is None:
        pytest.skip("no synthetic Q4_K_M model in SKIFF_MODELS_DIR/synthetic")
    model = load_model(GGUFFile(path), cuda, torch.bfloat16)
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 64, 16, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16, cuda)
    g = StepGraphs(model, kv, max_seqs=8, max_model_len=256, max_batch_tokens=64)
    g.capture()
    chunks = [
        SeqChunk(_ids(n, seed=n), 0, list(range(8 * i, 8 * i + 8)), "last")
        for i, n in enumerate((10, 20, 5))
    ]
    batch = ForwardBatch.build(chunks, 16, cuda)
    want = model(batch, kv)
    got = g.run(batch)
    assert g.replays["mixed"] == 1 and got.shape == want.shape == (3, cfg.vocab_size)
    err = (got - want).abs().max().item()
    assert err <= 0.02 * want.abs().max().item(), err
