"""A prefill worker's hand-off: prompts it computes for a decode worker to go on with.

A `Generate` with `prefill_only` runs here as a request for one more token (the engine knows
nothing of roles): the prompt is computed in chunks like any other, its full KV blocks are
stored into the kvcache's RAM tier as they are named (`KVTiers`: on commit), and when the
sequence ends on its first token, its last, partial block is stored too (named by
`partial_hash`) before the engine frees it. That token leaves on the token socket as usual,
without a finish. The sequence then waits here until the kvcache has indexed every block stored
up to that point (the `KVGrant` echoing the put's count), so that the decode worker's lookup
finds them, and a `Prefilled` with the tokens and the seeded generator's state goes to the
gateway, which sends the request on to a decode worker.

The decode worker then computes the first token alone, as a decode step (the same rows as a
combined worker's: the same greedy text). What it does not find (a block the tier could not
take for want of a granted slot, a kvcache gone or slower than `FENCE_TIMEOUT_S`) it computes;
only the time differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine import Sequence
from shared.engine.engine import LLMEngine
from shared.kv.block_manager import ROOT_HASH, partial_hash
from shared.kv.tier_client import TierClient
from shared.protocol import Generate, Prefilled

FENCE_TIMEOUT_S = 0.5  # a kvcache that has not indexed the blocks by then: hand on anyway


@dataclass
class _Waiting:
    request_id: str
    seq: Sequence
    mark: int  # the tier client's fence when the first token was sampled
    deadline: float


class HandOff:
    def __init__(
        self, engine: LLMEngine, tiers: TierClient | None, send: Callable[[object], None]
    ) -> None:
        self.blocks = engine.blocks
        self.tiers = tiers  # None: the kvcache is not used (the decode worker computes it all)
        self.send = send  # to the gateway, on the control socket
        self._seqs: dict[int, str] = {}  # seq id -> request, until its first token
        self._waiting: list[_Waiting] = []
        self.stats = {"handed_on": 0, "fence_timeouts": 0}
        engine.on_finish = self._on_finish

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def admit(self, req: Generate, seq: Sequence) -> None:
        """Called for every request before it enters the engine: a `prefill_only` one (that
        wants more than its next token) is cut short to that token and remembered."""
        if req.prefill_only and req.max_tokens > len(req.output_ids) + 1:
            seq.max_tokens = len(req.output_ids) + 1
            self._seqs[seq.seq_id] = req.request_id

    def _on_finish(self, seq: Sequence, reason: str) -> None:
        """The engine ends a sequence (its blocks still held): a handed-on prompt's partial
        block goes to the tier, and the sequence waits for the kvcache's indexing."""
        rid = self._seqs.pop(seq.seq_id, None)
        if rid is None or reason != "length":
            return
        if self.tiers is not None:
            self._store_partial(seq)
        mark = self.tiers.fence() if self.tiers is not None else 0
        self._waiting.append(_Waiting(rid, seq, mark, time.monotonic() + FENCE_TIMEOUT_S))

    def _store_partial(self, seq: Sequence) -> None:
        bs = self.blocks.block_size
        computed = seq.all_ids[:-1]  # the last token (the one sampled) has no KV yet
        full = len(computed) // bs
        tail = computed[full * bs :]
        if not tail or len(seq.block_hashes) < full or len(seq.block_table) <= full:
            return
        parent = seq.block_hashes[full - 1] if full else ROOT_HASH
        h = partial_hash(parent, tail, self.blocks.extra_key)
        self.tiers.store(seq.block_table[full], h, tuple(tail))

    def hands_on(self, seq_id: int, finish_reason: str | None) -> bool:
        """For a token event: True when it is a handed-on prompt's first token, which ends the
        sequence here (a "length" finish) but not the request. A stop token ends both."""
        return finish_reason == "length" and any(w.seq.seq_id == seq_id for w in self._waiting)

    def forget(self, seq_id: int, request_id: str) -> None:
        """An aborted request: nothing is handed on."""
        self._seqs.pop(seq_id, None)
        self._waiting = [w for w in self._waiting if w.request_id != request_id]

    def poll(self) -> None:
        """Sends `Prefilled` for the prompts whose blocks the kvcache has indexed (or timed
        out waiting)."""
        if not self._waiting:
            return
        now, left = time.monotonic(), []
        for w in self._waiting:
            if self.tiers is None or self.tiers.indexed(w.mark):
                self._send(w)
            elif now > w.deadline:
                self.stats["fence_timeouts"] += 1
                self._send(w)
            else:
                left.append(w)
        self._waiting = left

    def _send(self, w: _Waiting) -> None:
        seq, gen = w.seq, w.seq.generator
        state = bytes(gen.get_state().numpy()) if gen is not None else b""
        device = gen.device.type if gen is not None else ""
        stored = 0
        if self.tiers is not None:
            ids = seq.all_ids[:-1]  # the tokens whose KV was computed here
            hashes = self.blocks.hashes(ids, len(ids) // self.blocks.block_size)
            stored = sum(self.tiers.stored(h) for h in hashes)
        self.send(Prefilled(w.request_id, list(seq.output_ids), state, device, stored))
        self.stats["handed_on"] += 1
