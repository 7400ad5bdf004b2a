"""A step's token masks: one row of 32-bit words per sampled row (bit t of the row: token t
allowed), filled on the CPU by llguidance (in parallel over the constrained rows), applied to
the logits on their device before sampling."""

from __future__ import annotations

import llguidance
import llguidance.torch as lltorch
import torch

from shared.grammar.constraint import Constraint
from shared.staging import to_device


def fill_masks(
    constraints: list[Constraint | None], n_vocab: int, executor: llguidance.LLExecutor
) -> torch.Tensor | None:
    """[B, ceil(n_vocab / 32)] int32 on the host: the constrained rows' masks, every bit set in
    the others (and in a complete grammar's: an overlapped step's row of a sequence that ended
    the step before, dropped after it); None when no row is constrained."""
    rows = [(c.matcher, i) for i, c in enumerate(constraints) if c is not None and not c.finished]
    if not rows:
        return None
    masks = torch.full(
        ((len(constraints)), (n_vocab + 31) // 32), -1, dtype=torch.int32,
        pin_memory=torch.cuda.is_available(),
    )  # fmt: skip
    lltorch.fill_next_token_bitmask_par(executor, rows, masks)
    return masks


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The logits with every token a row's mask does not allow at -inf (a new tensor)."""
    batch, vocab = logits.shape
    words = to_device(masks, logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(batch, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
