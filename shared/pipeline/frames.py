"""Activations and batches between pipeline stages: a `StageStep` header and raw frames.

The tensors travel as their bytes (no pickle): x, then the residual stream when the stage has
one. A stage reads them in its own device and dtype, and rebuilds the step's ForwardBatch from
the header's host lists.
"""

from __future__ import annotations

import torch
import zmq

from shared.model.batch import ForwardBatch
from shared.protocol import StageBatch, StageStep


def stage_batch(batch: ForwardBatch) -> StageBatch:
    return StageBatch(*batch.to_lists())


def local_batch(b: StageBatch, device: torch.device | str) -> ForwardBatch:
    return ForwardBatch.from_lists(
        b.token_ids, b.positions, b.slot_mapping, b.logits_rows, b.block_tables, b.width,
        b.query_start_loc, b.seq_lens, device,
    )  # fmt: skip


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """t's bytes on the host, C order (a copy off the device; a view of a CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def tensor_of(frame: bytes | memoryview, dtype: str, width: int, device: torch.device,
              to: torch.dtype) -> torch.Tensor:  # fmt: skip
    """A frame's [rows, width] tensor of `dtype`, on `device` in `to`."""
    t = torch.frombuffer(bytearray(frame), dtype=getattr(torch, dtype)).view(-1, width)
    return t.to(device=device, dtype=to)


def _name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def send_step(
    sock: zmq.Socket,
    enc,
    step: int,
    batch: StageBatch,
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> None:
    """One StageStep and its frames, each tensor in its own dtype."""
    tensors = [x] if residual is None else [x, residual]
    head = StageStep(step, batch, [_name(t) for t in tensors])
    sock.send_multipart([enc.encode(head), *(tensor_bytes(t) for t in tensors)], copy=False)


def read_step(
    frames: list, msg: StageStep, device: torch.device, dtype: torch.dtype, width: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, residual or None) of a received StageStep's frames (frames[0] is the header), on
    `device` in this stage's activation `dtype`."""
    x = tensor_of(frames[1], msg.dtypes[0], width, device, dtype)
    if len(msg.dtypes) < 2:
        return x, None
    return x, tensor_of(frames[2], msg.dtypes[1], width, device, dtype)
