"""Split-K of the Triton paged attention: the split result equals a single pass (also with more
slices than key tiles, and with the count read on the device as CUDA graphs do), and the split
counts follow their rules (shared.kernels.paged_attention: default_num_splits for decode
batches, chunk_num_splits for steps with prompt chunks). Helpers and the interpreter /
GPU selection: tests/test_kernel_paged_attention.py."""

from __future__ import annotations

import pytest
import torch

from tests.spies import record_results
from tests.test_kernel_paged_attention import (
    DEVICE,
    F32,
    TOL,
    assert_close,
    make_batch,
    pa,
    reference,
    run_kernel,
    scenario,
    small_tiles,  # noqa: F401 - the fixture (usefixtures)
)


@pytest.mark.usefixtures("small_tiles")
def test_split_k_matches_single_pass() -> None:
    batch = make_batch(*scenario("mixed"), n_heads=4, n_kv_heads=1, head_dim=64, block_size=8)
    one = run_kernel(batch, 0.125, num_splits=1)
    for splits in (2, 5, 16):  # 16: more slices than some sequences have key tiles
        many = run_kernel(batch, 0.125, num_splits=splits)
        assert ((many - one).norm() / one.norm()).item() < 1e-6


def test_auto_split_for_long_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = record_results(monkeypatch, pa, "default_num_splits")
    monkeypatch.setattr(pa, "_num_sms", lambda device: 16)
    decode = make_batch([1, 1], [70, 33], n_heads=4, n_kv_heads=1, head_dim=64)
    out = run_kernel(decode, 0.125, max_seq_len=16384)  # a 16k-key hint: worth splitting
    assert chosen == [16]
    assert_close(out, reference(decode, 0.125), TOL[F32])
    run_kernel(decode, 0.125, max_seq_len=64)  # one key tile: no split
    assert chosen[-1] == 1
    run_kernel(decode, 0.125, max_seq_len=100)  # two tiles, the second partial: one a slice
    assert chosen[-1] == 2
    prefill = make_batch([3, 1], [70, 33], n_heads=4, n_kv_heads=1, head_dim=64)
    run_kernel(prefill, 0.125, max_seq_len=4096)  # not a decode batch: no heuristic
    assert len(chosen) == 3


def test_default_num_splits() -> None:
    assert pa.default_num_splits(1, 8, 32768, 132) == 32  # capped
    assert pa.default_num_splits(1, 8, 1 << 20, 132) == 32
    assert pa.default_num_splits(16, 8, 8192, 132) == 3  # 128 programs -> 384
    assert pa.default_num_splits(64, 8, 4096, 132) == 1  # 512 programs fill the GPU already
    assert pa.default_num_splits(16, 8, 1024, 132) == 1  # measured: splitting 1k lost 2x
    # batches of under num_sms / 2 programs: the H200's graph-replayed best at 512-4096 keys
    assert pa.default_num_splits(1, 8, 656, 132) == 11  # one 64-key tile a slice, 11 of them
    assert pa.default_num_splits(1, 8, 513, 132) == 9  # the ninth tile holds one key
    assert pa.default_num_splits(2, 8, 4096, 132) == 16
    assert pa.default_num_splits(4, 8, 4096, 132) == 8
    assert pa.default_num_splits(8, 8, 34000, 132) == 4
    assert pa.default_num_splits(1, 8, 100, 132) == 2
    assert pa.default_num_splits(1, 8, 64, 132) == 1
    assert pa.default_num_splits(1, 8, 656, 132, tile_keys=128) == 6  # one 128-key tile a slice
    assert pa.default_num_splits(1, 8, 32768, 132, tile_keys=128) == 32


def test_decode_tiles_follow_the_context_cache_dtype_and_grid() -> None:
    bf16, fp8, long = torch.bfloat16, pa.FP8, pa.LONG_DECODE_KEYS
    assert pa.decode_tile_keys(128, bf16, long) == pa.decode_tile_keys(64, fp8, long) == 128
    assert pa.decode_tile_keys(128, bf16, long - 1) == 64  # short contexts: W1 lost with 128
    assert pa.decode_tile_keys(128, torch.float32, long) == 64  # shared memory: smaller tiles
    assert pa.decode_tile_keys(256, bf16, long) == 32
    shape = lambda t: (t.block_m, t.tile_n, t.num_warps, t.num_stages)  # noqa: E731
    assert shape(pa._pick_tiles(1, 4, 128, bf16, True, long)) == (16, 128, 8, 2)
    assert shape(pa._pick_tiles(1, 4, 128, bf16, False, long)) == (16, 128, 4, 2)
    assert shape(pa._pick_tiles(1, 4, 128, fp8, True, long)) == (16, 128, 4, 3)
    assert shape(pa._pick_tiles(1, 4, 128, bf16, True, 1024)) == (16, 64, 4, 3)
    # one sequence over a short context: 32-key tiles (W1 on the H200, (am)); batches keep 64
    assert shape(pa._pick_tiles(1, 4, 128, bf16, True, 1024, seqs=1)) == (16, 32, 4, 3)
    assert pa.decode_tile_keys(128, torch.float16, 640, seqs=1) == 32
    assert pa.decode_tile_keys(128, bf16, 1025, seqs=1) == 64
    assert pa.decode_tile_keys(128, bf16, 640, seqs=2) == 64
    assert pa.decode_tile_keys(128, fp8, 640, seqs=1) == 64  # not measured: as before
    assert pa.decode_tile_keys(128, torch.float32, 640, seqs=1) == 64
    assert pa.decode_tile_keys(256, bf16, 640, seqs=1) == 32
    assert pa.decode_tile_keys(128, bf16, long, seqs=1) == 128
    assert shape(pa._pick_tiles(1, 4, 128, torch.float32, True, long)) == (16, 64, 4, 3)
    assert shape(pa._pick_tiles(1, 32, 256, bf16, True, long)) == (32, 32, 4, 3)
    assert pa._pick_tiles(64, 4, 128, fp8) == pa._pick_tiles(64, 4, 128)  # prefill: no change


def test_long_tiles_need_the_shared_memory() -> None:
    """A device that gives a program 64 KB of shared memory (sm_75) keeps 64-key tiles."""
    assert pa.decode_tile_keys(128, torch.bfloat16, pa.LONG_DECODE_KEYS, 64 * 1024) == 64
    # sm_86, sm_89
    assert pa.decode_tile_keys(128, torch.bfloat16, pa.LONG_DECODE_KEYS, 99 * 1024) == 128


def test_decode_tile_follows_the_context_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch takes 128-key tiles only for a long max_seq_len hint (a graph's context)."""
    seen = record_results(monkeypatch, pa, "_pick_tiles")
    f16 = torch.float16
    decode = make_batch([1, 1], [200, 33], n_heads=4, n_kv_heads=1, head_dim=64, dtype=f16)
    for hint in (1024, pa.LONG_DECODE_KEYS):
        out = run_kernel(decode, 0.125, max_seq_len=hint, num_splits=2)
        assert_close(out, reference(decode, 0.125), TOL[f16])
    assert [t.tile_n for t in seen] == [64, 128]


@pytest.mark.usefixtures("small_tiles")
def test_device_split_count_matches_single_pass() -> None:
    """Launches sized for 8 slices, the count read from a device tensor: 1 writes out directly
    (the combine pass returns at once), 3 and 8 combine; all equal one pass."""
    batch = make_batch(*scenario("mixed"), n_heads=4, n_kv_heads=1, head_dim=64, block_size=8)
    one = run_kernel(batch, 0.125, num_splits=1)
    for count in (1, 3, 8):
        t = torch.tensor([count], dtype=torch.int32, device=DEVICE)
        many = run_kernel(batch, 0.125, num_splits=8, num_splits_t=t)
        assert not many.isnan().any()
        assert ((many - one).norm() / one.norm()).item() < 1e-6


def test_device_split_count_needs_a_launch_size() -> None:
    batch = make_batch(*scenario("chunk"), n_heads=4, n_kv_heads=1, head_dim=64)
    t = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits_t needs num_splits > 1"):
        run_kernel(batch, 0.125, num_splits_t=t)
    with pytest.raises(ValueError, match="num_splits_t must be a \\[1\\] int32"):
        run_kernel(batch, 0.125, num_splits=4, num_splits_t=t.long())


def test_chunk_num_splits() -> None:
    """Llama-3-8B shapes (32 / 8 heads, head_dim 128: chunks of up to 512 tokens in 16-token
    query tiles, two programs an SM), 132 SMs: 264 program slots."""

    def splits(chunk: int, prefix: int, decodes: int = 7, limit: int = 8) -> int:
        q_lens = [chunk] + [1] * decodes
        seq_lens = [prefix + chunk] + [2000] * decodes
        return pa.chunk_num_splits(q_lens, seq_lens, 32, 8, 128, 132, limit)

    assert splits(256, 16384) == 2  # 128 programs: 2 slices fill the slots (H200: 20 % faster)
    assert splits(128, 16384) == 4
    assert splits(128, 16384, limit=3) == 3
    assert splits(384, 16384) == 1  # 192 programs: more than half the slots already
    assert splits(512, 16384) == 1
    assert splits(2048, 16384) == 1  # 128-row tiles: 512 programs
    assert splits(256, 8191) == 1  # a short prefix: not worth a workspace round trip
    assert splits(256, 8192) == 2
    assert splits(256, 1500) == 1
    assert splits(16, 8192, limit=16) == 8  # one slice per 1024 keys of the longest: 8 of 8208
    # the longest prefix bounds the slices (a shorter one just gets shorter or empty slices)
    assert pa.chunk_num_splits([16, 16], [12304, 8208], 32, 8, 128, 132, 16) == 12
    assert pa.chunk_num_splits([16, 1], [8208, 9000], 32, 8, 128, 132, 16) == 8  # 16 programs
    assert pa.chunk_num_splits([1] * 8, [40000] * 8, 32, 8, 128, 132, 8) == 1  # decode batch
    assert pa.chunk_num_splits([], [], 32, 8, 128, 132, 8) == 1
    assert [pa.chunk_split_limit(n) for n in (64, 512, 640, 1024, 2048, 8192)] == [8, 8, 6, 4, 2, 2]


def test_decode_split_arguments() -> None:
    """A decode graph's batch names its slice count, which every layer but a windowed one
    passes on; eager decode steps pass nothing (the kernel's rule at their longest context);
    mixed-step graphs pass their device-held count."""
    from shared.model.batch import ForwardBatch
    from shared.model.ops_backend import TritonOps

    def batch(splits: int, query_len: int = 1, splits_t: torch.Tensor | None = None):
        z = torch.zeros(1, dtype=torch.int64)
        return ForwardBatch(z, z, z, z.view(1, 1).int(), [], [], z, z.int(), z.int(), query_len,
                            40, attn_splits=splits, attn_splits_t=splits_t,
                            max_attn_splits=8)  # fmt: skip

    ops, q = TritonOps(), torch.zeros(1, 32, 128)
    assert ops._splits(q, 8, batch(16), 0) == {"num_splits": 16}
    assert ops._splits(q, 8, batch(16), 1024) == {}  # a window: the kernel's own rule
    assert ops._splits(q, 8, batch(0), 0) == {}  # eager
    count = torch.ones(1, dtype=torch.int32)
    mixed = ops._splits(q, 8, batch(0, query_len=64, splits_t=count), 0)
    assert mixed == {"num_splits": 8, "num_splits_t": count}


@pytest.mark.parametrize("layout", [(32, 8), (16, 16)])
def test_combine_rounds_one_token_for_the_next_gemv(layout: tuple[int, int]) -> None:
    """One decode token over static slices: the combine pass also rounds its output row to int8
    in the weight layout asked for, equal to the separate rounding launch of that row; steps it
    cannot round (one slice, the count read on the device, two tokens) give {}."""
    from shared.kernels.qmatmul.int8_activations import int8_buffers_for, quantize_x_kernel

    batch = make_batch([1], [300], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    out, rounded = run_kernel_int8(batch, layout, num_splits=4)
    assert set(rounded) == {layout}
    w, g = layout
    row = out.reshape(-1)
    want = int8_buffers_for(row.numel(), w, g, row.device)
    quantize_x_kernel[(row.numel() // (w * g),)](row, *want, 0, 0, 0, W=w, G=g, PDL=False)
    xq, xd, xs = rounded[layout]
    assert torch.equal(xq, want[0]) and torch.equal(xd, want[1])
    torch.testing.assert_close(xs, want[2], rtol=1e-6, atol=1e-6)  # summation order
    assert torch.equal(out, run_kernel(batch, 0.125, num_splits=4))
    assert run_kernel_int8(batch, layout, num_splits=1)[1] == {}
    t = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    assert run_kernel_int8(batch, layout, num_splits=4, num_splits_t=t)[1] == {}
    two = make_batch([1, 1], [300, 40], n_heads=8, n_kv_heads=2, head_dim=64, block_size=8)
    assert run_kernel_int8(two, layout, num_splits=4)[1] == {}


def run_kernel_int8(batch, layout, **kw) -> tuple[torch.Tensor, dict]:
    i32 = {"dtype": torch.int32, "device": batch.q.device}
    return pa.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
        torch.tensor(batch.query_start_loc, **i32), torch.tensor(batch.seq_lens, **i32), 0.125,
        max_query_len=1, int8_layout=layout, **kw,
    )  # fmt: skip
