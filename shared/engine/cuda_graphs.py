"""Engine steps replayed from CUDA graphs captured at padded sizes: decode and mixed steps.

Launching a step's few hundred kernels from Python costs more than running them when the batch
is small, so steps replay graphs captured at startup (none is captured while serving):

- decode steps (one new token per sequence) at batch-size buckets: B sequences padded to the
  next bucket b, b tokens, b logits rows;
- mixed steps (prompt chunks beside decodes) at token buckets: T tokens padded to the next
  bucket t, up to ``max_seqs`` sequences, ``min(t, max_seqs)`` logits rows.

Padding costs nothing but idle rows: padding sequences get no query (query_start_loc stops at
the real token count) and a zero length; padding tokens get token 0, position 0 and slot -1,
which the KV write skips, and belong to no sequence, so attention never reads them and every
other op keeps rows apart; padding logits rows repeat row 0 and are cut off. Inputs live in
static buffers the graphs were captured on; a step copies the real values in and replays.
Every graph leaves its logits in one shared buffer, which sampling reads right after the
replay, on the device, before the next step's replay is queued on the same stream.

What is captured is any step of the model's call shape (``step(batch, kv, out=None)``): the
whole model (logits), or a pipeline stage's layers (shared.pipeline.span_step), whose output
rows are hidden states; a step names its output's width and dtype (``out_width``,
``out_dtype``) where they are not the vocabulary's float32 logits.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch

from shared.kernels.attention_plan import (
    chunk_num_splits,
    chunk_split_limit,
    decode_tile_keys,
    default_num_splits,
)
from shared.kernels.device import max_shared_memory, num_sms
from shared.kernels.stage_inputs import stage_inputs
from shared.kv import KVPool
from shared.model import ForwardBatch
from shared.model.causal_lm import CausalLM

if TYPE_CHECKING:
    from shared.pipeline.span_step import SpanStep

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# at most 50 % padding up to 128 tokens and 25 % from there (prefill is compute-bound above
# ~200 rows: padding costs in proportion)
MIXED_BUCKETS = (64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1280, 1536, 2048)
GRAPH_MODES = ("all", "decode", "off")  # which steps replay graphs (--cuda-graphs)


# Decode graphs bake attention's split-K count and key tile in at capture (default_num_splits,
# decode_tile_keys). At the longest context alone, short ones are cut too finely: empty slices
# cost (H200, batch 1 over 512 keys: 7.5 us with 8 slices, 9.5 with 16, BENCHMARKS.md
# 2026-11-30 (w)); reading the count on the device instead cost W1 2.8 % (w). So a bucket is
# also captured at these contexts where their count or tile differs, and a step replays, among
# the graphs of its own context's tile, the fewest slices that still give each at most its
# rule's share: replaying 8 for 9-10 key tiles (two tiles a slice) cost W1 Q8_0 3.3 % against
# 16 (w). 4,096 keeps 2k-8k contexts at the 64-key tile's 32 slices at batch 1 when the
# longest context takes 128-key tiles (y).
DECODE_SPLIT_CONTEXTS = (512, 1024, 4096)


class DecodeGraph(NamedTuple):
    """A decode bucket's graph: its attention slices and key tile, and the context it was
    captured at (the longest its tile is chosen for; the batch's max_seq_len)."""

    splits: int
    tile_keys: int
    context: int


def decode_rule(
    seqs: int,
    n_kv_heads: int,
    context: int,
    sms: int,
    head_dim: int = 128,
    cache_dtype: torch.dtype = torch.bfloat16,
    shared_memory: int = 1 << 30,
) -> tuple[int, int]:
    """(attention slices, key tile) the kernel's rules give a decode batch of seqs sequences
    over contexts of up to context keys (default_num_splits, decode_tile_keys)."""
    keys = decode_tile_keys(head_dim, cache_dtype, context, shared_memory, seqs)
    return default_num_splits(seqs, n_kv_heads, context, sms, keys), keys


def decode_graphs(
    b: int,
    n_kv_heads: int,
    max_model_len: int,
    sms: int,
    head_dim: int = 128,
    cache_dtype: torch.dtype = torch.bfloat16,
    shared_memory: int = 1 << 30,
) -> list[DecodeGraph]:
    """The graphs decode bucket b is captured as (ascending), one a distinct (slices, tile)."""
    contexts = [n for n in DECODE_SPLIT_CONTEXTS if n < max_model_len] + [max_model_len]
    out: dict[tuple[int, int], DecodeGraph] = {}
    for n in contexts:
        rule = decode_rule(b, n_kv_heads, n, sms, head_dim, cache_dtype, shared_memory)
        out.setdefault(rule, DecodeGraph(*rule, n))
    return sorted(out.values())


def pick_decode_graph(graphs: list[DecodeGraph], want: int, tile_keys: int) -> DecodeGraph:
    """Among a bucket's graphs of tile tile_keys (all of them if none has it), the fewest
    slices not below want, else the most."""
    same = [g for g in graphs if g.tile_keys == tile_keys] or graphs
    return min((g for g in same if g.splits >= want), default=same[-1])


def decode_buckets(max_seqs: int) -> list[int]:
    """Batch sizes decode steps are captured at: BUCKETS below max_seqs, and max_seqs itself
    (at most the largest of BUCKETS), so that every batch up to it replays a graph. Without
    it, a batch above the last bucket under max_seqs ran eagerly (max_seqs 3: W1 Q4_K_M on the
    H200 gave 516.9 tok/s at batch 3 against 680.8 at batch 2, BENCHMARKS.md (ah))."""
    top = min(max(max_seqs, 1), BUCKETS[-1])
    return sorted({b for b in BUCKETS if b < top} | {top})


def mixed_buckets(max_batch_tokens: int) -> list[int]:
    """Token counts mixed steps are captured at: MIXED_BUCKETS up to max_batch_tokens, and
    max_batch_tokens itself (rounded up to 64) when it lies between them or above."""
    if max_batch_tokens <= 0:
        return []
    top = -(-max_batch_tokens // 64) * 64
    return sorted({b for b in MIXED_BUCKETS if b < top} | {top})


class StepGraphs:
    def __init__(
        self,
        model: CausalLM | SpanStep,
        kv: KVPool,
        max_seqs: int,
        max_model_len: int,
        max_batch_tokens: int = 0,
    ) -> None:
        """max_batch_tokens > 0 also captures mixed steps of up to that many tokens."""
        self.model = model
        self.kv = kv
        self.device = kv.k[0].device
        self.buckets = decode_buckets(max_seqs)
        self.max_bs = self.buckets[-1]
        self.mixed = mixed_buckets(max_batch_tokens)
        self.max_seqs = max(max_seqs, 1)
        self.max_model_len = max_model_len
        width = -(-max_model_len // kv.block_size)
        dev = self.device
        n = max([self.max_bs, *self.mixed])  # tokens
        s = max(self.max_bs, self.max_seqs if self.mixed else 0)  # sequences
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((s, width), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)  # decode: row i is token i
        self.mixed_rows = torch.zeros(n, dtype=torch.int64, device=dev)
        self.attn_splits = torch.ones(1, dtype=torch.int32, device=dev)  # mixed steps' split-K
        self._staged = {  # stage_inputs' destinations
            "token_ids": self.token_ids, "positions": self.positions,
            "slot_mapping": self.slot_mapping, "block_tables": self.block_tables,
            "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
            "logits_rows": self.mixed_rows, "attn_splits": self.attn_splits,
        }  # fmt: skip
        self.sms = num_sms(dev)  # for the attention split rules, asked every step
        self.shared_memory = max_shared_memory(dev)  # for the decode tile (the same)
        # decode buckets' attention slices and tiles, one graph each (decode_graphs; capture)
        self.decode_graphs: dict[int, list[DecodeGraph]] = {}
        # by (kind, bucket, DecodeGraph; None for mixed steps, whose count is set on the device)
        self.graphs: dict[tuple[str, int, DecodeGraph | None], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int, DecodeGraph | None], torch.Tensor] = {}
        self.pool = None
        self.logits: torch.Tensor | None = None  # every graph's logits (capture)
        self.replays = {"decode": 0, "mixed": 0}  # steps replayed, by kind
        self.last_key: tuple[str, int] = ("", 0)  # the graph replayed last

    def _attention(self, context: int) -> tuple:
        """decode_rule's / decode_graphs' arguments after the batch size, for this model,
        cache and device at contexts of up to `context` keys."""
        cfg = self.model.cfg
        return (cfg.n_kv_heads, context, self.sms, cfg.head_dim, self.kv.k[0].dtype,
                self.shared_memory)  # fmt: skip

    def _rows(self, kind: str, b: int) -> int:
        """Logits rows of a graph: one a sequence (decode), at most max_seqs (mixed)."""
        return b if kind == "decode" else min(b, self.max_seqs)

    def _batch(self, kind: str, b: int, dg: DecodeGraph | None = None) -> ForwardBatch:
        """The static batch of a graph: decode bucket b with attention as dg says (slices, and
        the context that picks the key tile), or mixed bucket b (tokens)."""
        seqs = b if kind == "decode" else self.max_seqs
        rows = (self.rows if kind == "decode" else self.mixed_rows)[: self._rows(kind, b)]
        return ForwardBatch(
            token_ids=self.token_ids[:b],
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:seqs],
            query_start_loc=[],
            seq_lens=[],
            logits_rows=rows,
            all_rows=kind == "decode",  # row i is token i, padding included
            query_start_loc_t=self.query_start_loc[: seqs + 1],
            seq_lens_t=self.seq_lens[:seqs],
            max_query_len=1 if kind == "decode" else b,  # b > 1: prefill tiles
            max_seq_len=dg.context if dg else self.max_model_len,
            attn_splits=dg.splits if dg else 0,
            attn_splits_t=None if kind == "decode" else self.attn_splits,
            max_attn_splits=chunk_split_limit(b),
        )

    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool. Every
        graph copies its logits into one shared buffer (a step's logits are sampled before the
        next step replays), so the pool holds one step's logits, not one per bucket (over a GB
        for a 128k vocabulary and 256 rows a bucket)."""
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.slot_mapping.fill_(-1)
        self.decode_graphs = {
            b: decode_graphs(b, *self._attention(self.max_model_len)) for b in self.buckets
        }
        keys = [("mixed", b, None) for b in reversed(self.mixed)]
        keys += [("decode", b, g) for b in reversed(self.buckets) for g in self.decode_graphs[b]]
        rows = max(self._rows(kind, b) for kind, b, _ in keys)
        width = getattr(self.model, "out_width", self.model.cfg.vocab_size)
        dtype = getattr(self.model, "out_dtype", torch.float32)
        self.logits = torch.empty(rows, width, dtype=dtype, device=self.device)
        for key in keys:
            batch = self._batch(*key)  # (kind, bucket, DecodeGraph or None)
            self.model(batch, self.kv)  # compiles the kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            self.outputs[key] = self.logits[: self._rows(*key[:2])]
            with torch.cuda.graph(graph, pool=self.pool):
                self.model(batch, self.kv, out=self.outputs[key])
            self.pool = graph.pool()
            self.graphs[key] = graph
        # A graph's first replay uploads it to the device. Each graph is replayed once here so
        # that a bucket's first use while serving does not pay that. This alone did not remove
        # the 175-267 ms first mixed step of a fresh H200 server (BENCHMARKS.md 2026-11-30 (o));
        # the start-up generation (warm_up.py) did ((q)). The inputs still hold the capture's
        # padding (no query, no KV write), so these replays change nothing.
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize(self.device)

    def _key(self, batch: ForwardBatch) -> tuple[str, int] | None:
        n, seqs = batch.token_ids.shape[0], batch.seq_lens_t.shape[0]
        rows, width = batch.logits_rows.shape[0], batch.block_tables.shape[1]
        if n == 0 or width > self.block_tables.shape[1]:
            return None
        if batch.max_query_len == 1 and n == seqs == rows and n <= self.max_bs:
            return "decode", next(b for b in self.buckets if b >= n)
        if seqs > self.max_seqs:
            return None
        b = next((b for b in self.mixed if b >= n), 0)
        if not b or rows > self._rows("mixed", b):
            return None
        return "mixed", b

    def _chunk_splits(self, batch: ForwardBatch, b: int) -> int:
        """The split-K slices of a mixed step's attention (see chunk_num_splits)."""
        cfg = self.model.cfg
        return chunk_num_splits(
            batch.query_lens, batch.seq_lens, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            self.sms, chunk_split_limit(b),
        )  # fmt: skip

    def fits(self, batch: ForwardBatch) -> bool:
        return self._key(batch) is not None

    def run(
        self, batch: ForwardBatch, fill: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Logits [rows, vocab] for an eager-built batch, replayed from the graph that fits it;
        None when none does (the caller runs the step eagerly). fill (stage_inputs'): tokens
        in flight, taken from the previous step's output on the device (else the batch's own
        ids are final)."""
        key = self._key(batch)
        if key is None:
            return None
        kind, b = key
        seqs = batch.seq_lens_t.shape[0]
        rows = batch.logits_rows.shape[0]
        s_pad = b if kind == "decode" else self.max_seqs
        self._stage(batch, kind, b, s_pad, fill)
        graph = (kind, b, None)
        if kind == "decode":
            want, keys = decode_rule(seqs, *self._attention(batch.max_seq_len))
            graph = (kind, b, pick_decode_graph(self.decode_graphs[b], want, keys))
        self.graphs[graph].replay()
        self.replays[kind] += 1
        self.last_key = key
        return self.outputs[graph][:rows]

    def _stage(self, batch: ForwardBatch, kind: str, b: int, s_pad: int, fill) -> None:
        """The step's inputs into the graphs' buffers in one launch (stage_inputs)."""
        src = {
            "token_ids": batch.token_ids, "positions": batch.positions,
            "slot_mapping": batch.slot_mapping, "block_tables": batch.block_tables,
            "query_start_loc": batch.query_start_loc_t, "seq_lens": batch.seq_lens_t,
            "logits_rows": batch.logits_rows,
        }  # fmt: skip
        mixed = kind == "mixed"
        stage_inputs(
            src, self._staged, b, s_pad, rows_pad=self._rows(kind, b) if mixed else 0,
            splits=self._chunk_splits(batch, b) if mixed else 0, fill=fill,
        )  # fmt: skip


def capture_graphs(make, mixed_tokens: int):
    """``make(tokens).capture()`` with mixed steps up to mixed_tokens, else decode steps only,
    else none: a model whose steps cannot be captured runs eagerly (slower, with a warning)
    instead of failing to start."""
    for tokens in dict.fromkeys((mixed_tokens, 0)):
        graphs = make(tokens)
        try:
            graphs.capture()
            return graphs
        except Exception as exc:  # noqa: BLE001 - any capture failure: fall back, say why
            what = "mixed and decode" if tokens else "decode"
            log.warning("capturing CUDA graphs of %s steps failed: %s", what, exc)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    log.warning("running every step eagerly (no CUDA graphs)")
    return None
