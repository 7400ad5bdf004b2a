"""The worker's side of the spec service: each step's new tokens of the speculating sequences
up, the proposals down, never a step held up for long.

After a step the worker sends one `SpecAsk` with the tokens each speculating sequence gained
(the service keeps a copy of every sequence: a sequence's tokens go up once) and how many to
propose; before the next step it takes the `SpecDrafts` that came back, waiting at most a short
grace for an answer still out: a fraction of a step (at most ``WAIT_MAX_S``) for the n-gram
proposers, which answer in microseconds; a set ``wait_s`` (`--spec-wait-ms`, which `skiff serve
--spec draft:PATH` sets) for a draft model, whose guesses take a forward each: every answer
still out is waited for, up to it. The worker's cores are idle meanwhile, which on a CPU is
what the draft model runs on. A draft that continues a
sequence's current length becomes its `Sequence.draft`; a late one (for an older length) is
dropped. When the service is gone (a send that cannot leave: the socket has no connected peer,
``IMMEDIATE``), or silent for ``DEAD_AFTER_S``, the worker decodes without proposals, asks again
once a second, and sends each sequence whole on the first answer (a new service holds no copies).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable

import zmq

from shared.engine import Sequence
from shared.protocol import (
    SpecAsk,
    SpecDraft,
    SpecDrafts,
    SpecEnd,
    SpecSeq,
    SpecToWorker,
    decoder,
    encoder,
)

DEAD_AFTER_S = 1.0  # an ask unanswered this long: the service is taken for gone
RETRY_S = 1.0  # then one ask a second probes for it
WAIT_MAX_S = 0.002  # the longest a step waits for proposals still out
WAIT_FRACTION = 0.1  # of the last step's time


class SpecClient:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        worker_id: str,
        log: Callable[[str], None],
        wait_s: float = 0.0,
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{worker_id}-{uuid.uuid4().hex[:8]}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no peer: a send fails at once, nothing queues
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.log = log
        self._enc, self._dec = encoder(), decoder(SpecToWorker)
        self._sent: dict[int, int] = {}  # seq id -> tokens of it the service holds
        self._out: list[float] = []  # when each unanswered ask left
        self._down = False
        self._last_try = 0.0
        self.stats: Counter[str] = Counter()
        # > 0: the grace is this, for every answer still out (a draft model's guesses take
        # forwards of their own: a step that went on without them would find them late)
        self.wait_s = wait_s

    @property
    def up(self) -> bool:
        return not self._down

    def ask(self, seqs: list[Sequence]) -> None:
        """Proposals for these sequences (those decoding, with a draft length > 0 now)."""
        now = time.monotonic()
        if self._out and now - self._out[0] > DEAD_AFTER_S:
            self._gone("no answer for a second")
        if self._down and now - self._last_try < RETRY_S:
            return
        items = []
        for seq in seqs:
            k = seq.spec.k if seq.spec is not None else 0
            if not k or seq.num_inflight:
                continue
            start = self._sent.get(seq.seq_id, 0)
            tokens = seq.token_slice(start, seq.num_tokens)
            items.append(SpecSeq(seq.seq_id, start, tokens, k, seq.domain))
        if not items:
            return
        self._last_try = now
        if not self._send(SpecAsk(items)):
            self._gone("it cannot be reached")
            return
        for item in items:
            self._sent[item.seq_id] = item.start + len(item.tokens)
        self._out.append(now)
        self.stats["asks"] += 1

    def introduce(self, seq: Sequence) -> None:
        """A new sequence's prompt, sent on arrival (k = 0: nothing proposed yet), so that the
        service indexes it (milliseconds for a long prompt) while the prompt prefills, not
        while a decode step waits for its first proposal."""
        if self._down or seq.seq_id in self._sent:
            return
        item = SpecSeq(seq.seq_id, 0, seq.token_slice(0, seq.num_tokens), 0, seq.domain)
        if self._send(SpecAsk([item])):
            self._sent[seq.seq_id] = len(item.tokens)
            self._out.append(time.monotonic())

    def end(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._sent.pop(sid, None)
        if seq_ids and not self._down:
            self._send(SpecEnd(seq_ids))

    def collect(self, seqs: dict[int, Sequence], last_step_s: float) -> None:
        """Takes the answers that came; waits up to a grace for one still out."""
        grace = self.wait_s or min(WAIT_MAX_S, WAIT_FRACTION * last_step_s)
        wait = grace if self._out and not self._down else 0
        deadline = time.monotonic() + wait
        if wait and not self.sock.poll(wait * 1000):
            self.stats["late"] += 1
            return
        self._drain(seqs)
        while self.wait_s and self._out and (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(left * 1000):
                self.stats["late"] += 1
                return
            self._drain(seqs)

    def _drain(self, seqs: dict[int, Sequence]) -> None:
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._dec.decode(frame)
            except Exception:  # noqa: BLE001 (a bad frame costs its proposals, nothing else)
                self.stats["bad_frames"] += 1
                continue
            self._take(msg, seqs)

    def _take(self, msg: SpecDrafts, seqs: dict[int, Sequence]) -> None:
        if self._out:
            self._out.pop(0)
        if self._down:
            self.log(f"spec service at {self.endpoint} answers again")
            self._down = False
        for sid in msg.unknown:  # a new service: this sequence goes up whole next time
            self._sent.pop(sid, None)
        for d in msg.drafts:
            seq = seqs.get(d.seq_id)
            tokens = None if seq is None else _still_ahead(d, seq)
            if not tokens or seq.spec is None or seq.num_inflight:
                self.stats["stale"] += 1
                continue
            if d.at != seq.num_tokens:
                self.stats["caught_up"] += 1  # came after the sequence moved on, guesses true
            seq.draft = tokens[: seq.spec.k]
            seq.draft_source = d.source
            self.stats["drafts"] += 1

    def _send(self, msg: SpecAsk | SpecEnd) -> bool:
        try:
            self.sock.send(self._enc.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.stats["dropped_sends"] += 1
            return False

    def _gone(self, why: str) -> None:
        if not self._down:
            self.log(f"spec service at {self.endpoint}: {why}; decoding without proposals")
        self._down = True
        self._sent.clear()  # whatever answers next holds no copies
        self._out.clear()

    def close(self) -> None:
        self.sock.close(linger=0)


def _still_ahead(d: SpecDraft, seq: Sequence) -> list[int] | None:
    """The draft's tokens past where the sequence stands: all of them when it was made for this
    length; for a draft that came late (the sequence moved on while the service answered: a
    step shorter than its round trip), the rest where the tokens it guessed for the positions
    since came true; else None."""
    lag = seq.num_tokens - d.at
    if lag < 0 or lag >= len(d.tokens) or lag > len(seq.output_ids):
        return None
    if lag and seq.output_ids[-lag:] != list(d.tokens[:lag]):
        return None
    return list(d.tokens[lag:])
