"""A step's inputs into a CUDA graph's static buffers in one launch (``StepGraphs.run``).

A replayed step reads its token ids, positions, KV slots, block tables, sequence starts and
lengths (and a mixed step's logits rows and split count) from the buffers its graph was
captured on. Copying each in, padding each tail and filling in the tokens still in flight
took 8-12 small launches a step, each a kernel boundary on the stream between two graphs
(about 2 µs apiece in a batch-1 step of the H200, BENCHMARKS.md 2026-12-03 (ar)). Here one
program a (buffer, block of elements) does all of it: the real values from the step's packed
inputs (``ForwardBatch.build``: read in place from pinned host memory, or from their device
copy), the padding values past them, and a token whose id the previous step sampled
(overlapped steps) read from that step's output on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.gdc import launch_kw, pdl, wait_prev

__all__ = ["stage_inputs"]

_BLOCK = 256
_SEGMENTS = 8  # token ids, positions, slots, logits rows, block tables, starts, lengths, splits


@triton.jit(do_not_specialize=["n", "b", "rows", "rows_pad", "seqs", "s_pad", "w", "stride",
                               "splits"])  # fmt: skip
def _stage_kernel(
    tok_src, pos_src, slot_src, rows_src, table_src, starts_src, lens_src,
    fill_src,  # [n] int64: the row of prev whose token the token takes, -1 for its own (FILL)
    prev_ptr,  # [*] int64: the previous step's sampled tokens (FILL)
    tok_dst, pos_dst, slot_dst, rows_dst, table_dst, starts_dst, lens_dst, splits_dst,
    n, b, rows, rows_pad, seqs, s_pad, w, stride, splits,
    FILL: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # PDL: the step's own inputs (host memory, or a copy no kernel writes) are read while the
    # kernel before ends; the previous step's tokens and every store wait for it (wait_prev)
    seg = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if seg == 0:  # token ids: padding tokens are token 0
        v = tl.load(tok_src + i, mask=i < n, other=0)
        if FILL:
            f = tl.load(fill_src + i, mask=i < n, other=-1)
        wait_prev(PDL)
        if FILL:
            v = tl.where(f >= 0, tl.load(prev_ptr + f, mask=f >= 0, other=0), v)
        tl.store(tok_dst + i, v, mask=i < b)
    elif seg == 1:  # positions: padding at position 0
        v1 = tl.load(pos_src + i, mask=i < n, other=0)
        wait_prev(PDL)
        tl.store(pos_dst + i, v1, mask=i < b)
    elif seg == 2:  # KV slots: padding writes nothing
        v2 = tl.load(slot_src + i, mask=i < n, other=-1)
        wait_prev(PDL)
        tl.store(slot_dst + i, v2, mask=i < b)
    elif seg == 3:  # a mixed step's logits rows: padding repeats row 0
        v3 = tl.load(rows_src + i, mask=i < rows, other=0)
        wait_prev(PDL)
        tl.store(rows_dst + i, v3, mask=i < rows_pad)
    elif seg == 4:  # block tables: the step's seqs rows of w blocks (the rest is never read)
        ok = i < seqs * w
        r = i // w
        c = i % w
        v4 = tl.load(table_src + i, mask=ok)
        wait_prev(PDL)
        tl.store(table_dst + r.to(tl.int64) * stride + c, v4, mask=ok)
    elif seg == 5:  # sequence starts: padding sequences start (and end) at the token count
        v5 = tl.load(starts_src + i, mask=i <= seqs, other=0)
        wait_prev(PDL)
        tl.store(starts_dst + i, tl.where(i <= seqs, v5, n), mask=i <= s_pad)
    elif seg == 6:  # sequence lengths: padding sequences are empty
        v6 = tl.load(lens_src + i, mask=i < seqs, other=0)
        wait_prev(PDL)
        tl.store(lens_dst + i, v6, mask=i < s_pad)
    else:
        wait_prev(PDL)
        if SPLITS:  # a mixed step's attention slices, read by its graph on the device
            tl.store(splits_dst + i, tl.zeros_like(i) + splits, mask=i < 1)


def stage_inputs(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    b: int,
    s_pad: int,
    rows_pad: int = 0,
    splits: int = 0,
    fill: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Copy one step's inputs `src` (token_ids, positions, slot_mapping, block_tables,
    query_start_loc, seq_lens and, with rows_pad, logits_rows) into a graph's static buffers
    `dst` (the same names, and attn_splits), padded to b tokens, s_pad sequences and rows_pad
    logits rows; with splits > 0 also set dst["attn_splits"]. fill: (per-token source rows,
    -1 for none; the previous step's tokens): tokens in flight take their id from those."""
    n, seqs = src["token_ids"].shape[0], src["seq_lens"].shape[0]
    rows = src["logits_rows"].shape[0] if rows_pad else 0
    table, w = src["block_tables"], src["block_tables"].shape[1]
    dt = dst["block_tables"]
    if n > b or seqs > s_pad or rows > rows_pad:
        raise ValueError(f"stage_inputs: {n} tokens, {seqs} sequences, {rows} rows do not fit")
    if w > dt.shape[1] or seqs > dt.shape[0] or dt.stride(1) != 1 or not table.is_contiguous():
        raise ValueError(f"stage_inputs: block tables {tuple(table.shape)} into {tuple(dt.shape)}")
    fill_src, prev = fill if fill is not None else (src["token_ids"], src["token_ids"])
    longest = max(b, rows_pad, seqs * w, s_pad + 1, 1)
    grid = (_SEGMENTS, triton.cdiv(longest, _BLOCK))
    # launched early where the device has PDL: the step's inputs read while the kernel before
    # it (the last step's greedy argmax, which lets it in first thing) ends, the rest after its
    # wait. Against launching after it, H200, W1 (BENCHMARKS.md 2026-12-03 (at)): Q4_K_M +0.7 /
    # +0.4 % (call 3) and +0.5 / +0.2 / +0.3 % (call 7), Q8_0 +0.4 / +0.4 / +0.3 % (call 7),
    # but Q6_K -0.8 / -1.3 % (call 6; why is not known)
    early = pdl(dt.device, _stage_kernel)
    _stage_kernel[grid](
        src["token_ids"], src["positions"], src["slot_mapping"],
        src["logits_rows"] if rows_pad else src["token_ids"], table,
        src["query_start_loc"], src["seq_lens"], fill_src, prev,
        dst["token_ids"], dst["positions"], dst["slot_mapping"],
        dst["logits_rows"] if rows_pad else dst["token_ids"], dt,
        dst["query_start_loc"], dst["seq_lens"], dst["attn_splits"],
        n, b, rows, rows_pad, seqs, s_pad, w, dt.stride(0), splits,
        FILL=fill is not None, SPLITS=splits > 0, BLOCK=_BLOCK, PDL=early, **launch_kw(early),
    )  # fmt: skip
