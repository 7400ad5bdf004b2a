"""Compiles the packed quantized-matmul kernels for an NVIDIA target on a machine without a GPU
and counts the instructions of their main loop (Triton's own ptxas and cuobjdump).

    python -m tools.kernel_sass [--arch 90] [--types Q4_K Q6_K Q8_0] [--check]

Per type and kernel it prints the SASS instructions of the chunk loop per thread, per weight
(the issue rate, not the bandwidth, bounds a kernel whose loop needs many per weight) and the
commonest opcodes. --check only compiles every kernel for every packed type and exits non-zero
on the first failure (tests/test_kernel_compile.py runs it: a kernel that does not compile for
the GPU is caught on the CPU). Run it without TRITON_INTERPRET: the interpreter replaces the
kernels. Shapes are Llama-3-8B's 4096 x 4096 with bf16 activations.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from gguf import GGMLQuantizationType as T
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shared.kernels.qmatmul.layout import CHUNK, INT8_TYPES, PACKED_TYPES, WORDS
from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_chunk import MAGIC
from shared.kernels.qmatmul.packed_gemm16 import F16_TYPES
from shared.quant import block_geometry
from tools.compile_launches import (
    compile_argmax,
    compile_attention,
    compile_host_copy,
    compile_norm,
    compile_pair,
    compile_rope_kv,
    compile_stage,
)

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
          torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.int64: "i64"}  # fmt: skip


def _weight(qtype: T, n: int, k: int):
    block, size = block_geometry(qtype)
    return pack(torch.zeros(n, k // block * size, dtype=torch.uint8), qtype, (n, k))


def _planes(pw) -> list[torch.Tensor]:
    return [t if t is not None else pw.q for t in (pw.q, pw.hi, pw.sc, pw.mn, pw.d, pw.dmin)]


def _launch_args(kind: str, pw, m: int) -> tuple[object, list, dict]:
    """(kernel, its runtime arguments in order, constexprs) as packed_matmul launches them."""
    import importlib

    mm = importlib.import_module("shared.kernels.qmatmul.packed_matmul")
    gm = importlib.import_module("shared.kernels.qmatmul.packed_gemm")
    dq = importlib.import_module("shared.kernels.qmatmul.packed_dequant")
    policy = importlib.import_module("shared.kernels.qmatmul.packed_int8_rows_policy")
    n, k = pw.shape
    x = torch.empty(m, k, dtype=torch.bfloat16)
    sc = pw.sc if pw.sc is not None else pw.d
    strides = [pw.q.stride(0), sc.stride(0), pw.d.stride(0)]
    fields = {"QTYPE": int(pw.qtype), "HI": pw.hi is not None, "W": WORDS[pw.qtype],
              "G": CHUNK[pw.qtype] // WORDS[pw.qtype], "INTERPRETED": False}  # fmt: skip
    chunks = k // CHUNK[pw.qtype]
    out = torch.empty(m, n, dtype=torch.float32)
    # a GEMV's final output, its split-K partials (two splits) and tickets
    split = [out, torch.empty(2, n, dtype=torch.float32), pw.tickets]
    act = int(kind.endswith("-act"))  # the gated SiLU epilogue
    kind = kind.removesuffix("-act")
    r32 = kind.endswith("-r32")  # over row-interleaved planes (packed_rows)
    kind = kind.removesuffix("-r32")
    if kind == "gemv":  # the plain float GEMV (packed_gemv_plain)
        gp = importlib.import_module("shared.kernels.qmatmul.packed_gemv_plain")
        args = [x, *_planes(pw), *split, n, chunks, chunks // 2, *strides, MAGIC]
        consts = {**fields, "BLOCK_N": 16, "SPLITS": 2, "UNROLL": 0, "ACT": act}
        return gp.gemv_kernel, args, consts
    if kind == "gemv-f":  # the factored GEMV (packed_gemv), float32 activations and V-sums
        gv = importlib.import_module("shared.kernels.qmatmul.packed_gemv")
        xf, xs = torch.empty(k, dtype=torch.float32), torch.empty(k // 4, dtype=torch.float32)
        args = [xf, xs, *_planes(pw), *split, n, chunks, chunks // 2, *strides, MAGIC]
        consts = {**fields, "BLOCK_N": 64, "SPLITS": 2, "V": 4, "ACT": act}
        return gv.gemv_factored_kernel, args, consts
    if kind in ("gemv-i8", "gemv-i8q"):  # the int8-activation GEMV (packed_int8); q: with QX
        i8 = importlib.import_module("shared.kernels.qmatmul.packed_int8")
        g = fields["G"]
        xq = torch.empty(k // 4, dtype=torch.int32)
        xd, xs = torch.empty(chunks * g), torch.empty(chunks * g)
        args = [x, xq, xd, xs, *_planes(pw), *split, n, chunks, chunks // 2, *strides]
        consts = {**fields, "BLOCK_N": 128, "SPLITS": 2, "TPR": 1, "PREFETCH": True, "ACT": act}
        return i8.gemv_int8_kernel, args, {**consts, "QX": kind == "gemv-i8q"}
    if kind == "gemv-i8t":  # the int8-activation GEMV over one coalesced tile (packed_int8_tile)
        it = importlib.import_module("shared.kernels.qmatmul.packed_int8_tile")
        g = fields["G"]
        xq = torch.empty(k // 4, dtype=torch.int32)
        xd, xs = torch.empty(chunks * g), torch.empty(chunks * g)
        args = [xq, xd, xs, *_planes(pw), *split, n, chunks, chunks // 2, *strides]
        consts = {**fields, "BLOCK_N": 16, "CH": chunks // 2, "SPLITS": 2, "ACT": act}
        return it.gemv_int8_tile_kernel, args, consts
    if kind.startswith("gemv-r8"):  # over row-interleaved planes (packed_int8_rows)
        ir = importlib.import_module("shared.kernels.qmatmul.packed_int8_rows")
        g = fields["G"]
        xq = torch.empty(k // 4, dtype=torch.int32)
        xd, xs = torch.empty(chunks * g), torch.empty(chunks * g)
        qr = importlib.import_module("shared.kernels.qmatmul.qkv_rope")
        rope = qr.no_rope_args(x)
        consts = {"ROPE": False, "HEAD_DIM": 128, "ROPE_DIM": 128, "HAS_FF": False}
        if kind == "gemv-r8r":  # with RoPE and the KV write in its epilogue (bf16 cache)
            pos, cache = torch.zeros(1, dtype=torch.int64), torch.empty(8, dtype=torch.bfloat16)
            rope = (pos, pos, cache, cache, torch.empty(64), 0, 4096, 1024, 1.0, -0.3)
            consts |= {"ROPE": True, "HAS_FF": True}
        consts["LATE_NEXT"] = policy.late_next(kind == "gemv-r8r", pw.qtype)
        # r8n: its output plus the residual normed and rounded for two layouts (Q4_K's and
        # Q6_K's); r8p: its activations awaiting that norm's scale (norm_ahead)
        h = torch.empty(n, dtype=torch.bfloat16)
        res = [h, torch.empty_like(h), torch.empty(n), torch.empty(n // 32)]
        ends = [xq, xd, xs, xq, xd, xs, *res, torch.empty(k // 32), k, 1e-5]
        args = [x, xq, xd, xs, *_planes(pw), *split, *ends, *rope, n, chunks, chunks // 2]
        args += strides
        consts |= {**fields, "KW": 4, "SPLITS": 2, "PREFETCH": True, "ACT": act, "PDL": True}
        # with the activation: its outputs also rounded for the next GEMV (round_gated)
        consts |= {"OUT_W": 32 if act or kind == "gemv-r8n" else 0, "OUT_G": 8}
        norm_out = kind == "gemv-r8n"
        consts |= {"NORM_OUT": norm_out, "OUT_W2": 16 if norm_out else 0, "OUT_G2": 16}
        consts["NORM_BLOCK"] = k // 32 if kind == "gemv-r8p" else 0
        consts["CM"], consts["EP"], consts["SEP"] = policy.WEIGHT_HINTS
        return ir.gemv_int8_rows_kernel, args, {**consts, "QX": kind == "gemv-r8q"}
    if kind == "gemv-rb":  # M activation rows in one program (packed_int8_rows_batch)
        rb = importlib.import_module("shared.kernels.qmatmul.packed_int8_rows_batch")
        xq = torch.empty(m, k // 4, dtype=torch.int32)
        xd = torch.empty(m, k // fields["W"])
        part = torch.empty(m, 2, n, dtype=torch.float32)
        args = [xq, xd, xd, *_planes(pw), out, part, pw.tickets, m, n, chunks, chunks // 2]
        args += [*strides, xq.stride(0), xd.stride(0), out.stride(0)]
        consts = {**fields, "KW": 4, "SPLITS": 2, "MR": m, "ACT": act, "PDL": True}
        consts["CM"], consts["EP"], consts["SEP"] = policy.WEIGHT_HINTS
        return rb.gemv_int8_rows_batch_kernel, args, consts
    if kind == "gemm-16":  # Q4_K / Q6_K weights formed in fp16 (packed_gemm16)
        g16 = importlib.import_module("shared.kernels.qmatmul.packed_gemm16")
        xh = torch.empty(m, k, dtype=torch.float16)
        args = [xh, *_planes(pw), out, m, n, chunks, chunks // 2, k, n, m * n, *strides]
        tiles = {"QTYPE": int(pw.qtype), "W": WORDS[pw.qtype], "BLOCK_M": min(m, 64)}
        tiles |= {"BLOCK_N": 32, "ACT": act, "R32": False, "SWAP": False}
        return g16._gemm16_kernel, args, {**tiles, "INTERPRETED": False}
    if kind == "gemm-first":  # the weights as the dot's first operand (packed_gemm_first)
        gf = importlib.import_module("shared.kernels.qmatmul.packed_gemm_first")
        args = [x, *_planes(pw), out, m, n, chunks, chunks // 2, k, n, m * n, *strides]
        tiles = {"BLOCK_M": min(m, 64), "BLOCK_N": 64, "ACT": act, "R32": r32}
        # fields a dot as first_config joins them for 64-row tiles (4096 rows)
        tiles["FJ"] = mm.first_config(m, 4096, torch.device("cpu"), pw.qtype)["FJ"]
        return gf._gemm_first_kernel, args, {**fields, **tiles}
    if kind == "x16":  # packed_gemm16's activation conversion (one row-chunk a program)
        g16 = importlib.import_module("shared.kernels.qmatmul.packed_gemm16")
        xh = torch.empty(m, k, dtype=torch.float16)
        consts = {"W": WORDS[pw.qtype]}
        return g16._x16_kernel, [x, xh, k, k], consts
    if kind == "dequant":
        dense = torch.empty(n, k, dtype=torch.bfloat16)
        args = [*_planes(pw), dense, dense, n, *strides, k, MAGIC]
        return dq._dequant_kernel, args, {**fields, "BLOCK_N": 32, "R32": r32, "GATHER": False}
    args = [x, *_planes(pw), out, m, n, chunks, chunks // 2, k, n, m * n, *strides]
    tiles = {"BLOCK_M": min(m, 64), "BLOCK_N": 32, "WIDE": kind == "gemm-w", "ACT": act, "R32": r32}
    return gm._gemm_kernel, args, {**fields, **tiles}


def compile_kernel(kind: str, qtype: T, m: int = 16, arch: int = 90, num_warps: int = 4):
    """kind: gemv, gemv-f (factored), gemv-i8 (int8 activations; gemv-i8q: rounding them in
    its prologue), gemv-i8t (its one-tile variant: no loop, so its count is the whole kernel),
    gemm or gemm-w (one dot a chunk; M rows, BLOCK_M = min(M, 64)), gemm-first (the weights as
    the dot's first operand, 64-row tiles), gemm-16 (fp16 weights,
    Q4_K / Q6_K) and x16 (its activation conversion) or dequant; "-act" adds the gated SiLU
    epilogue."""
    pw = _weight(qtype, 4096, 4096)
    fn, args, consts = _launch_args(kind, pw, m)
    names = fn.arg_names
    runtime = [a for a in names if a not in consts]
    if len(runtime) != len(args):
        raise RuntimeError(f"{kind}: {len(args)} arguments for {runtime}")
    sig, attrs = {}, {}
    for name, value in zip(runtime, args, strict=True):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if value % 16 == 0:  # what the launcher specializes on
                attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    sig.update({name: "constexpr" for name in consts})
    sig = {name: sig[name] for name in names}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": 2}
    if kind.startswith("gemv-r8"):  # as launch_int8_rows launches it
        from shared.kernels.qmatmul.packed_int8_rows_policy import maxnreg

        options["maxnreg"] = maxnreg(qtype)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _report(what: str, compile_fn, check: bool, arch: int, stats) -> bool:
    """Compile one kernel and print its line (with --check only that it compiled); False when
    it did not compile. stats: loop_stats or whole_stats."""
    try:
        compiled = compile_fn()
    except Exception as exc:  # noqa: BLE001 - report which kernel and why
        print(f"{what}: FAILED: {type(exc).__name__}: {exc}")
        return False
    count, ops = stats(compiled.asm["cubin"])
    top = ", ".join(f"{op} {c}" for op, c in ops.most_common(6))
    regs = registers(compiled.asm["cubin"])
    print(f"{what}: " + (f"compiled for sm_{arch}" if check else f"{count} | {regs} | {top}"))
    return True


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's own cuobjdump on a cubin: -sass (the instructions) or -res-usage."""
    tool = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def registers(cubin: bytes) -> str:
    """'REG:n ... LOCAL:n' of cuobjdump's resource usage (LOCAL > 0: spills to local memory)."""
    words = _cuobjdump(cubin, "-res-usage").split()
    return " ".join(w for w in words if w.startswith(("REG:", "LOCAL:")))


def loop_stats(cubin: bytes) -> tuple[int, Counter]:
    """Instructions of the longest loop (the longest backward branch) and its opcode counts."""
    sass = _cuobjdump(cubin, "-sass")
    inst = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)(.*)")
    rows = [
        (int(m.group(1), 16), m.group(2), m.group(3))
        for m in map(inst.search, sass.splitlines())
        if m
    ]
    loops = [
        (at, int(rest.split(";")[0].strip().split()[-1], 16))
        for at, op, rest in rows
        if op == "BRA"
    ]
    back = [(at, to) for at, to in loops if to < at]
    if not back:
        return 0, Counter()
    end, start = max(back, key=lambda p: p[0] - p[1])
    body = [op for at, op, _ in rows if start <= at <= end]
    return len(body), Counter(body)


def whole_stats(cubin: bytes) -> tuple[int, Counter]:
    """Instructions of the whole kernel and its opcode counts."""
    sass = _cuobjdump(cubin, "-sass")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass)
    return len(ops), Counter(ops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--types", nargs="+", default=None)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_sass: unset TRITON_INTERPRET (the interpreter replaces the kernels)")
        return 2
    for kv in ("bf16", "fp8", "fp8-head"):
        # decode at batch 16 and 1 (a grid of at most two programs an SM: other tiles), prefill
        for query_len, device_splits, b in ((1, False, 16), (1, False, 1), (64, False, 16),
                                            (64, True, 16)):  # fmt: skip
            what = f"attention {kv} KV, {b} x {query_len} queries"
            what += ", split count on the device" if device_splits else ""
            build = functools.partial(compile_attention, kv, query_len, args.arch, device_splits, b)
            if not _report(what, build, args.check, args.arch, loop_stats):
                return 1
    for layouts, rows in (((), 1), (((32, 8),), 1), (((16, 8), (32, 8)), 1), (((32, 4),), 1),
                          (((16, 8), (32, 8)), 4)):  # fmt: skip
        build = functools.partial(compile_norm, layouts, args.arch, rows)
        what = f"add + RMSNorm of {rows} row(s), rounded for {list(layouts)}"
        if not _report(what, build, args.check, args.arch, whole_stats):
            return 1
    for kv in ("bf16", "fp8", "fp8-head"):
        build = functools.partial(compile_rope_kv, kv, args.arch)
        if not _report(f"RoPE + KV write, {kv}", build, args.check, args.arch, whole_stats):
            return 1
    for host in (False, True):
        what = "argmax _slice_kernel, counted (one launch)"
        what += ", picks stored to the host too" if host else ""
        build = lambda h=host: compile_argmax(args.arch, h)["_slice_kernel"]  # noqa: E731
        if not _report(what, build, args.check, args.arch, whole_stats):
            return 1
    build = lambda: compile_host_copy(args.arch)["_copy_kernel"]  # noqa: E731
    if not _report("ids copied to the host", build, args.check, args.arch, whole_stats):
        return 1
    for fill in (False, True):
        build = lambda f=fill: compile_stage(f, args.arch)["_stage_kernel"]  # noqa: E731
        what = "a graph step's inputs staged" + (", tokens in flight filled in" if fill else "")
        if not _report(what, build, args.check, args.arch, whole_stats):
            return 1
    for pair in ((T.Q4_K, T.Q6_K), (T.Q8_0, T.Q4_K)):
        build = functools.partial(compile_pair, pair, args.arch)
        what = f"rows GEMV pair {pair[0].name} + {pair[1].name}"
        if not _report(what, build, args.check, args.arch, loop_stats):
            return 1
    types = [T[t] for t in args.types] if args.types else sorted(PACKED_TYPES)
    kinds = (("gemv", 1, 4), ("gemv-f", 1, 2), ("gemv-i8", 1, 4), ("gemm", 16, 4),
             ("gemm-w", 16, 4), ("gemm", 64, 4), ("gemm-w", 64, 4), ("dequant", 1, 4),
             ("gemv-act", 1, 4), ("gemv-f-act", 1, 2), ("gemm-w-act", 64, 4),
             ("gemm-16", 64, 4), ("gemm-16-act", 64, 4), ("x16", 64, 1),
             ("gemv-i8t", 1, 4), ("gemv-i8q", 1, 4), ("gemv-r8", 1, 4),
             ("gemv-r8q", 1, 4), ("gemv-r8-act", 1, 4), ("gemv-r8r", 1, 4), ("gemv-r8n", 1, 4),
             ("gemv-r8p", 1, 4),
             ("gemv-rb", 2, 4), ("gemv-rb", 4, 4),
             ("gemm-w-r32", 64, 4),
             ("dequant-r32", 1, 4),
             ("gemm-first", 16, 4), ("gemm-first-r32", 64, 4),
             ("gemm-first-act", 64, 4))  # fmt: skip
    for qtype in types:
        for kind, m, warps in kinds:
            if kind.startswith(("gemv-i8", "gemv-r8", "gemv-rb")) and (qtype not in INT8_TYPES):
                continue
            if kind in ("gemm-16", "gemm-16-act", "x16") and qtype not in F16_TYPES:
                continue
            try:
                compiled = compile_kernel(kind, qtype, m, args.arch, warps)
            except Exception as exc:  # noqa: BLE001 - report which kernel and why
                print(f"{qtype.name} {kind} M={m}: FAILED: {type(exc).__name__}: {exc}")
                return 1
            if args.check:
                print(f"{qtype.name} {kind} M={m}: compiled for sm_{args.arch}")
                continue
            count, ops = loop_stats(compiled.asm["cubin"])
            rows = {
                "gemv": 16,
                "gemv-f": 64,
                "gemv-i8": 128,
                "gemv-i8q": 128,
                "gemv-r8": 128,
                "gemv-r8q": 128,
                "gemv-r8r": 128,
                "gemv-r8n": 128,
                "gemv-r8p": 128,
                "gemv-rb": 128,
                "gemm-first": 64,
                "gemm-first-r32": 64,
            }.get(kind.removesuffix("-act"), 32)
            weights = rows * CHUNK[qtype] / (warps * 32)
            if kind == "gemv-i8t":  # no chunk loop: the whole kernel, 16 rows x half of K
                count, ops = whole_stats(compiled.asm["cubin"])
                weights = 16 * 4096 / 2 / (warps * 32)
            top = ", ".join(f"{op} {c}" for op, c in ops.most_common(6))
            print(f"{qtype.name:5} {kind:7} M={m:<3} loop {count:5} per thread per chunk, "
                  f"{count / weights:5.1f} per weight, {registers(compiled.asm['cubin'])} "
                  f"| {top}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
