"""Benchmark the Triton paged attention kernel on a CUDA device (not a test).

Decode: batch 1/16/64 x context 1k/8k/32k, one query per sequence; reports the KV bytes the kernel
must read and the achieved GB/s, with the automatic split-K and with split-K off. Prefill: one
chunk over a cached prefix; reports TFLOP/s over the causal (and windowed) query-key pairs.
`--splits 1 2 4 8 16`: instead, small decode batches at short contexts with each split count,
timed as a decode step runs them (replayed from a CUDA graph: no Python launch cost), to choose
`default_num_splits`' rule from (W1 at batch 1 spent 0.56 ms a token in attention, 8 programs).
`--batches` and `--contexts` change its grid: `--splits 16 32 64 128 --batches 1
--contexts 8192 32768` asks whether long single streams want more than `_MAX_SPLITS` slices
(BENCHMARKS.md (v): about 97 us a layer at 32k, latency-bound).

`--decode-tiles`: instead, decode batches (`--batches`, `--contexts`) by decode tile shape (keys
a tile, warps, pipeline stages) and split count (`--splits`), graph-replayed: where batch-1
attention over long contexts spends its time (BENCHMARKS.md (w): 59 us a layer at 32k for bf16
and FP8 alike, about 2.7 us a key tile a program whatever the dtype).

`--chunks`: instead, W3's steps: a prompt chunk of 256/384/512 tokens over a 4k-28k prefix beside
7 decodes at 2k keys, graph-replayed, by split count (auto: chunk_num_splits) and prefill tiles.

    python -m tools.bench_attention [--dtype bf16|fp16|fp8|fp8-head] [--heads 32 --kv-heads 8
                                    --head-dim 128]
"""

from __future__ import annotations

import argparse
import sys

import torch

from shared.kernels.paged_attention import paged_attention
from shared.kv.calibrate import head_scales
from shared.ops.paged_attention_fp8 import FP8, quantize_kv_fp8

# fp8: a scale per token and KV head; fp8-head: one per KV head (KVPool(scales="head"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8, "fp8-head": FP8}


def make_cache(args: argparse.Namespace, seq_lens: list[int]) -> dict:
    """Shuffled blocks holding every sequence's keys; FP8 caches get per-token scales, or one
    per KV head (fp8-head)."""
    dev, bs = "cuda", args.block_size
    n_blocks = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(n_blocks)
    perm = torch.randperm(num_blocks, device=dev).int()
    tables = torch.zeros(len(seq_lens), max(n_blocks), dtype=torch.int32, device=dev)
    start = 0
    for b, nb in enumerate(n_blocks):
        tables[b, :nb] = perm[start : start + nb]
        start += nb
    shape = (num_blocks, bs, args.kv_heads, args.head_dim)
    compute = _compute_dtype(args)
    kv = {"block_tables": tables}
    for name in ("k", "v"):
        x = torch.randn(shape, device=dev, dtype=compute)
        if args.dtype == "fp8":
            values, scales = quantize_kv_fp8(x.flatten(0, 1))
            kv[f"{name}_cache"] = values.view(shape)
            kv[f"{name}_scale"] = scales.view(shape[:3])
        elif args.dtype == "fp8-head":
            per_head = head_scales(x.flatten(0, 1), headroom=1.0)
            kv[f"{name}_cache"] = (x.float() / per_head[:, None]).to(FP8)
            kv[f"{name}_scale"] = per_head.expand(shape[:3])
        else:
            kv[f"{name}_cache"] = x
    return kv


def _compute_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if DTYPES[args.dtype] == FP8 else DTYPES[args.dtype]


def kv_bytes(args: argparse.Namespace, keys: int) -> int:
    per_key = args.kv_heads * args.head_dim * DTYPES[args.dtype].itemsize
    if args.dtype == "fp8":
        per_key += args.kv_heads * 4  # float32 scale per token and head
    return 2 * keys * per_key


def run(
    args: argparse.Namespace, q_lens: list[int], seq_lens: list[int], graph: bool = False, **kw
) -> float:
    """Milliseconds per call (triton.testing.do_bench; with `graph`, replays of 20 calls
    captured in a CUDA graph, as a decode step runs them)."""
    import triton.testing

    kv = make_cache(args, seq_lens)
    compute = _compute_dtype(args)
    q = torch.randn(sum(q_lens), args.heads, args.head_dim, device="cuda", dtype=compute)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def step() -> None:
        paged_attention(
            q, kv["k_cache"], kv["v_cache"], kv["block_tables"], qsl, lens,
            args.head_dim**-0.5, args.window, max_query_len=max(q_lens),
            k_scale=kv.get("k_scale"), v_scale=kv.get("v_scale"),
            max_seq_len=max(seq_lens), out=out, **kw,
        )  # fmt: skip

    if not graph:
        return triton.testing.do_bench(step, warmup=25, rep=100)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            step()
    return triton.testing.do_bench(g.replay, warmup=5, rep=50) / 20


def visible_pairs(ctx: int, n: int, window: int) -> int:
    total = 0
    for p in range(ctx, ctx + n):
        total += min(p + 1, window) if window else p + 1
    return total


def chunk_steps(args: argparse.Namespace) -> None:
    """W3's attention: a chunk over a long prefix beside 7 decodes, graph-replayed, in TFLOP/s
    over the visible query-key pairs, by split count and by prefill tile shape."""
    import shared.kernels.attention_plan as plan
    import shared.kernels.paged_attention as pa

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_tiles = pa._pick_tiles
    variants = {"default": None, "m128x64 w8 s2": (128, 64, 8, 2), "m64x64 w4 s3": (64, 64, 4, 3),
                "m64x32 w4 s2": (64, 32, 4, 2), "m64x128 w8 s2": (64, 128, 8, 2)}  # fmt: skip
    print("chunk + 7 decodes at 2k keys, graph-replayed: us per call (TFLOP/s) by split count")
    for name, tiles in variants.items():

        def pick(q_len: int, group: int, head_dim: int, *rest, tiles=tiles) -> pa._Tiles:
            if tiles is None or q_len <= 1:
                return default_tiles(q_len, group, head_dim, *rest)
            return pa._Tiles(max(tiles[0], group), *tiles[1:])

        pa._pick_tiles = plan.pick_tiles = pick  # the launches and chunk_num_splits
        for chunk in (256, 384, 512):
            for prefix in (4096, 16384, 28672):
                q_lens, seq_lens = [chunk] + [1] * 7, [prefix + chunk] + [2048] * 7
                pairs = visible_pairs(prefix, chunk, args.window) + 7 * 2048
                flops = 4 * args.heads * args.head_dim * pairs
                auto = pa.chunk_num_splits(
                    q_lens, seq_lens, args.heads, args.kv_heads, args.head_dim, sms,
                    pa.chunk_split_limit(chunk + 7),
                )  # fmt: skip
                cells = []
                for s in sorted({1, 2, 4, 8, auto}):
                    try:
                        ms = run(args, q_lens, seq_lens, graph=True, num_splits=s)
                    except Exception as e:  # a tile shape the compiler refuses: say so
                        cells.append(f"{s}: {type(e).__name__}")
                        continue
                    mark = "*" if s == auto else ""
                    cells.append(f"{s}{mark}: {ms * 1e3:7.1f} ({flops / ms / 1e9:4.0f})")
                print(f"  {name:14s} chunk={chunk} prefix={prefix:5d}  " + "  ".join(cells))
    pa._pick_tiles = plan.pick_tiles = default_tiles


DECODE_TILES = {
    "n64 w4 s3": (64, 4, 3), "n64 w2 s3": (64, 2, 3), "n64 w8 s3": (64, 8, 3),
    "n128 w4 s2": (128, 4, 2), "n128 w4 s3": (128, 4, 3), "n128 w8 s2": (128, 8, 2),
    "n128 w8 s3": (128, 8, 3), "n256 w8 s2": (256, 8, 2),
}  # fmt: skip


def decode_tiles(args: argparse.Namespace) -> None:
    """Decode batches by tile shape (DECODE_TILES; the first was the default before (y)) and
    split count, graph-replayed, in us per call and GB/s of KV read."""
    import shared.kernels.paged_attention as pa

    default_tiles = pa._pick_tiles
    splits = args.splits or [16, 32, 64, 128]
    print("decode by tile (keys a tile, warps, stages), graph-replayed: us per call (GB/s)")
    for name, (tile_n, warps, stages) in DECODE_TILES.items():

        def pick(q_len: int, group: int, head_dim: int, *rest, t=(tile_n, warps, stages)):
            tiles = default_tiles(q_len, group, head_dim, *rest)
            return pa._Tiles(tiles.block_m, *t) if q_len <= 1 else tiles

        pa._pick_tiles = pick
        for batch in args.batches:
            for ctx in args.contexts:
                nbytes = kv_bytes(args, batch * ctx)
                cells = []
                for s in splits:
                    try:
                        ms = run(args, [1] * batch, [ctx] * batch, graph=True, num_splits=s)
                    except Exception as e:  # a tile shape the compiler refuses: say so
                        cells.append(f"{s}: {type(e).__name__}")
                        continue
                    cells.append(f"{s}: {ms * 1e3:6.1f} ({nbytes / ms / 1e6:4.0f})")
                print(f"  {args.dtype} {name:11s} B={batch} ctx={ctx:5d}  " + "  ".join(cells),
                      flush=True)  # fmt: skip
    pa._pick_tiles = default_tiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="KV cache dtype")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=0, help="sliding window (0: full attention)")
    p.add_argument("--splits", type=int, nargs="*", help="sweep these split counts (see above)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8], help="with --splits")
    p.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="with --splits"
    )
    p.add_argument("--chunks", action="store_true", help="W3's chunk steps (see above)")
    p.add_argument("--decode-tiles", action="store_true", help="decode tile shapes (see above)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}  {vars(args)}")
    if args.chunks:
        chunk_steps(args)
        return
    if args.decode_tiles:
        decode_tiles(args)
        return
    if args.splits:
        print("decode, graph-replayed: us per call by split count (auto: default_num_splits)")
        for batch in args.batches:
            for ctx in args.contexts:
                q_lens, seq_lens = [1] * batch, [ctx] * batch
                times = {
                    s: run(args, q_lens, seq_lens, graph=True, num_splits=s) for s in args.splits
                }
                auto = run(args, q_lens, seq_lens, graph=True)
                cells = "  ".join(f"{s}: {t * 1e3:6.1f}" for s, t in times.items())
                print(f"  B={batch} ctx={ctx:5d}  {cells}  auto: {auto * 1e3:6.1f}")
        return

    print("decode: KV read at the automatic split-K and with split-K off")
    for batch in (1, 16, 64):
        for ctx in (1024, 8192, 32768):
            q_lens, seq_lens = [1] * batch, [ctx] * batch
            keys = batch * (min(ctx, args.window) if args.window else ctx)
            nbytes = kv_bytes(args, keys)
            auto = run(args, q_lens, seq_lens)
            one = run(args, q_lens, seq_lens, num_splits=1)
            print(
                f"  B={batch:3d} ctx={ctx:6d}  KV {nbytes / 1e6:9.1f} MB  "
                f"auto {auto * 1e3:8.1f} us {nbytes / auto / 1e6:7.0f} GB/s  "
                f"no-split {one * 1e3:8.1f} us {nbytes / one / 1e6:7.0f} GB/s"
            )

    print("prefill: one chunk over a cached prefix")
    for ctx, n in ((0, 2048), (6144, 2048), (0, 8192), (16384, 512)):
        ms = run(args, [n], [ctx + n])
        flops = 4 * args.heads * args.head_dim * visible_pairs(ctx, n, args.window)
        print(f"  chunk={n:5d} prefix={ctx:6d}  {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
