"""ForwardBatch: the flat token layout one model step runs on (prefill chunks and decodes mixed)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from shared.staging import pack, to_device_packed, views


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step: `token_ids` at positions start_pos.. into its blocks."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    want_logits: str = "last"  # "last", "all" (teacher forcing) or "none" (a non-final chunk)


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: list[int]  # B + 1
    seq_lens: list[int]  # B: keys per sequence after this step
    logits_rows: torch.Tensor  # [N] int64 rows of T whose logits are returned
    query_start_loc_t: torch.Tensor  # [B + 1] int32 on the device (for kernels)
    seq_lens_t: torch.Tensor  # [B] int32 on the device
    max_query_len: int
    max_seq_len: int
    # per-forward memo of RoPE tables (key: rope parameters), so layers sharing them compute once
    rope_tables: dict = field(default_factory=dict)
    # split-K slices of the attention: a decode graph's count (0: the kernel's rule); for an
    # eager step with prompt chunks chosen once a forward from the host lengths (0: not yet);
    # mixed-step graphs read it on the device from attn_splits_t, launches sized for
    # max_attn_splits
    attn_splits: int = 0
    attn_splits_t: torch.Tensor | None = None
    max_attn_splits: int = 0
    # build's `extra` values on the device (int64)
    extra: torch.Tensor | None = None
    # logits_rows is every token in order (decode steps): the final norm reads x whole, no
    # gather launch
    all_rows: bool = False
    # built into pinned host memory (build's `pinned`): (that buffer, its staging.pack layout),
    # and the tensors above are its views until on_device copies it
    packed: tuple | None = None

    @property
    def query_lens(self) -> list[int]:
        """Tokens each sequence computes in this step (host lists; empty for graph batches)."""
        starts = self.query_start_loc
        return [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]

    @staticmethod
    def build(
        chunks: list[SeqChunk],
        block_size: int,
        device: torch.device | str,
        extra: list[int] | tuple[int, ...] = (),
        pinned: Callable[[int], torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """The batch of `chunks` on `device`; `extra`: more int64 values the caller wants there
        in the same copy (``ForwardBatch.extra``). pinned(nbytes) (a ``staging.PinnedRing``'s
        take): the tensors are views of that pinned host buffer instead, for a kernel to read
        in place (``stage_inputs``), or for ``on_device`` to copy."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            if -(-end // block_size) > len(c.block_table):
                raise ValueError(f"{end} positions need more than {len(c.block_table)} blocks")
            base = len(ids)
            ids.extend(c.token_ids)
            for p in range(c.start_pos, end):
                pos.append(p)
                slots.append(c.block_table[p // block_size] * block_size + p % block_size)
            if c.want_logits == "all":
                rows.extend(range(base, base + n))
            elif c.want_logits == "last" and n:
                rows.append(base + n - 1)
            starts.append(len(ids))
            seq_lens.append(end)
        width = max((len(c.block_table) for c in chunks), default=0)
        tables = [b for c in chunks for b in (*c.block_table, *[0] * (width - len(c.block_table)))]
        return ForwardBatch.from_lists(
            ids, pos, slots, rows, tables, width, starts, seq_lens, device, extra, pinned
        )

    @staticmethod
    def from_lists(
        ids: list[int],
        pos: list[int],
        slots: list[int],
        rows: list[int],
        tables: list[int],
        width: int,
        starts: list[int],
        seq_lens: list[int],
        device: torch.device | str,
        extra: list[int] | tuple[int, ...] = (),
        pinned: Callable[[int], torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """The batch from its host lists (build's, or a pipeline stage's copy of another
        stage's batch: ``to_lists``); tables: the [sequences, width] block tables flattened."""
        i64, i32 = torch.int64, torch.int32
        parts = [(ids, i64), (pos, i64), (slots, i64), (rows, i64), (list(extra), i64),
                 (tables, i32), (starts, i32), (seq_lens, i32)]  # fmt: skip
        packed = None
        if pinned is None:  # one host->device copy for the step (built while the last one runs)
            tensors = to_device_packed(parts, device)
        else:
            packed = pack(parts, pinned)
            tensors = views(*packed)
        return ForwardBatch(
            **_packed_fields(tensors, len(seq_lens), width),
            query_start_loc=starts,
            seq_lens=seq_lens,
            max_query_len=max((b - a for a, b in itertools.pairwise(starts)), default=0),
            max_seq_len=max(seq_lens, default=0),
            all_rows=len(rows) == len(ids),  # rows rise within range(len(ids)): all of them
            packed=packed,
        )

    def to_lists(self) -> tuple:
        """from_lists's arguments before `device` (the token ids as this step has them on the
        device: an overlapped step's tokens in flight filled in)."""
        width = self.block_tables.shape[1]
        return (
            self.token_ids.tolist(), self.positions.tolist(), self.slot_mapping.tolist(),
            self.logits_rows.tolist(), self.block_tables.flatten().tolist(), width,
            list(self.query_start_loc), list(self.seq_lens),
        )  # fmt: skip

    def on_device(self, device: torch.device | str) -> ForwardBatch:
        """A batch built into pinned memory, copied to `device` in one copy (else itself)."""
        if self.packed is None:
            return self
        buf, layout = self.packed
        tensors = views(buf.to(device, non_blocking=True), layout)
        return replace(self, **_packed_fields(tensors, *self.block_tables.shape), packed=None)


# the fields build packs into one buffer, in the order of its parts
_PACKED = ("token_ids", "positions", "slot_mapping", "logits_rows", "extra", "block_tables",
           "query_start_loc_t", "seq_lens_t")  # fmt: skip


def _packed_fields(tensors: list[torch.Tensor], seqs: int, width: int) -> dict:
    """The views of build's packed parts by field name, the block tables [seqs, width]."""
    fields = dict(zip(_PACKED, tensors, strict=True))
    fields["block_tables"] = fields["block_tables"].reshape(seqs, width)
    return fields
