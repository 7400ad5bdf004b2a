"""A step's token masks: one row of 32-bit words per constrained row (bit t of the row: token t
allowed), filled on the CPU by llguidance (in parallel over the rows), applied to those rows of
the logits on their device before sampling. Rows without a grammar are left as they are."""

from __future__ import annotations

import llguidance
import llguidance.torch as lltorch
import torch

from shared.grammar.constraint import Constraint
from shared.staging import to_device


def fill_masks(
    constraints: list[Constraint | None],
    n_vocab: int,
    executor: llguidance.LLExecutor,
    pinned: bool = False,
) -> tuple[list[int], torch.Tensor] | None:
    """(the constrained rows, their [R, ceil(n_vocab / 32)] int32 masks on the host, pinned
    for a copy to a GPU); None when no row needs one. A complete grammar's row needs none (an
    overlapped step's row of a sequence that ended the step before, dropped after it)."""
    live = [(i, c) for i, c in enumerate(constraints) if c is not None and not c.finished]
    if not live:
        return None
    masks = torch.empty((len(live), (n_vocab + 31) // 32), dtype=torch.int32, pin_memory=pinned)
    lltorch.fill_next_token_bitmask_par(
        executor, [(c.matcher, k) for k, (_, c) in enumerate(live)], masks
    )
    return [i for i, _ in live], masks


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """The logits with every token a row's mask does not allow at -inf (a new tensor); only the
    masked rows are unpacked."""
    vocab = logits.shape[1]
    idx = to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
    words = to_device(masks, logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :vocab].bool()
    masked = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    return logits.index_put((idx,), masked)
