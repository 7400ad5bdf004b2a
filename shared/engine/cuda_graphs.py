"""Decode steps replayed from CUDA graphs captured at padded batch-size buckets.

A decode batch (one new token per sequence) is padded to the next bucket: padding rows get no
query (query_start_loc stops at the real count), a zero sequence length and slot -1, which the
KV write skips. Inputs live in static buffers the graphs were captured on; a step copies the real
values in and replays. Sampling runs right after the replay, on the device.
"""

from __future__ import annotations

import torch

from shared.kv import KVPool
from shared.model import ForwardBatch
from shared.model.causal_lm import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVPool, max_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.kv = kv
        self.device = kv.k[0].device
        self.buckets = [b for b in BUCKETS if b <= max_seqs] or [1]
        self.max_bs = self.buckets[-1]
        self.max_model_len = max_model_len
        width = -(-max_model_len // kv.block_size)
        dev, n = self.device, self.max_bs
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            token_ids=self.token_ids[:b],
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            query_start_loc=[],
            seq_lens=[],
            logits_rows=self.rows[:b],
            query_start_loc_t=self.query_start_loc[: b + 1],
            seq_lens_t=self.seq_lens[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.slot_mapping.fill_(-1)
        for b in reversed(self.buckets):
            batch = self._batch(b)
            self.model(batch, self.kv)  # compiles the kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self.model(batch, self.kv)
            self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, n: int) -> bool:
        return 0 < n <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] for an eager-built decode batch of n sequences."""
        n = batch.token_ids.shape[0]
        b = next(x for x in self.buckets if x >= n)
        self.token_ids[:n].copy_(batch.token_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[n:b].fill_(-1)
        w = batch.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(batch.block_tables, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(batch.query_start_loc_t, non_blocking=True)
        self.query_start_loc[n + 1 : b + 1].fill_(n)
        self.seq_lens[:n].copy_(batch.seq_lens_t, non_blocking=True)
        self.seq_lens[n:b].zero_()
        self.graphs[b].replay()
        return self.outputs[b][:n]
