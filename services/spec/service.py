"""The spec service's ROUTER loop and its message handling (`SpecService.handle`, socket-free,
so tests drive it directly).

- `SpecAsk` -> one `SpecDrafts` on the same identity: each `SpecSeq` updates the sequence's copy
  (start 0: replaced; start > 0: cut there and extended) and, when k > 0, gets a draft of up to
  k tokens (at most `max_draft`) continuing its length: its prompt lookup's ("prompt"), else,
  for a sequence with a `domain`, that domain table's ("table"), else, with a draft model, its
  greedy guesses ("draft"; the ask's sequences that need it in one batch). The n-gram proposers
  go first because they are free (microseconds) and, where they match, long and often right (a
  code edit copies its prompt); the draft model costs a forward per guessed token, so it runs
  only where they find nothing. An item with no copy from its start on goes to `unknown` (the
  worker resends it from 0) and gets none.
- `SpecEnd`: the sequences are forgotten (the draft model's K/V of them freed); a finished
  sequence with a domain first teaches that domain's table its output (a sequence evicted by
  the bound teaches nothing). No reply.
- A malformed message is counted and ignored; it never stops the loop.

The loop answers in arrival order, so an ask waits behind the ones before it: a sequence's
first copy (its whole prompt) is the costly part (prompt_lookup.py has the figures), which is
why a worker does best to send it with k = 0 before its first decode step.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from typing import TYPE_CHECKING

import zmq

from services.spec.config import SpecConfig
from services.spec.domain_table import DomainTables
from services.spec.metrics import SpecStats, serve_metrics, snapshot, summary
from services.spec.sequences import LiveSequences
from shared.protocol import (
    SpecAsk,
    SpecDraft,
    SpecDrafts,
    SpecEnd,
    SpecToWorker,
    WorkerToSpec,
    decoder,
    encoder,
)

if TYPE_CHECKING:  # torch and the model code load only with a draft model
    from services.spec.draft_model import DraftModel

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_LOGGED_ERRORS = 10  # malformed messages described on stderr before going quiet


def _log(msg: str) -> None:
    print(f"spec: {msg}", file=sys.stderr, flush=True)


class SpecService:
    def __init__(
        self,
        seqs: LiveSequences,
        stats: SpecStats,
        max_draft: int,
        tables: DomainTables | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.seqs, self.stats, self.max_draft, self.tables = seqs, stats, max_draft, tables
        self.draft = draft
        if draft is not None:
            seqs.on_evict = draft.forget
        self._decode = decoder(WorkerToSpec).decode

    def handle(self, frames: list[bytes]) -> list[bytes | SpecToWorker]:
        """One ROUTER message ([identity, payload]) -> [identity, reply] or [] (none)."""
        try:
            identity, payload = frames
            msg = self._decode(payload)
            if isinstance(msg, SpecAsk):
                reply = self._ask(identity, msg)
            else:
                reply = self._end(identity, msg)
        except Exception as e:  # a bad frame must never stop the service
            self.stats.malformed += 1
            if self.stats.malformed <= _LOGGED_ERRORS:
                _log(f"malformed message ignored ({type(e).__name__}: {e})")
            return []
        return [identity, reply] if reply is not None else []

    def _ask(self, who: bytes, msg: SpecAsk) -> SpecDrafts:
        self.stats.asks += 1
        drafts: list[SpecDraft] = []
        unknown: list[int] = []
        to_model: list[tuple[tuple[bytes, int], list[int], int]] = []
        for item in msg.seqs:
            self.stats.seqs_asked += 1
            live = self.seqs.update(who, item)
            if live is None:
                unknown.append(item.seq_id)
                continue
            if self.draft is not None:
                self.draft.cut((who, item.seq_id), item.start)
            k = min(item.k, self.max_draft)
            tokens, source = live.lookup.propose(k), "prompt"
            if not tokens and k > 0 and live.domain and self.tables is not None:
                tokens, source = self.tables.propose(live.domain, live.lookup.tokens, k), "table"
            if not tokens and k > 0 and self.draft is not None:
                to_model.append(((who, item.seq_id), live.lookup.tokens, k))
            self._add(drafts, SpecDraft(item.seq_id, len(live.lookup), tokens, source))
        if to_model and (guesses := self._guess(to_model)):
            for (key, seq_tokens, _), tokens in zip(to_model, guesses, strict=True):
                self._add(drafts, SpecDraft(key[1], len(seq_tokens), tokens, "draft"))
        self.stats.unknown += len(unknown)
        return SpecDrafts(drafts, unknown)

    def _guess(self, asks: list) -> list[list[int]] | None:
        """The draft model's guesses; None when it failed (the n-gram drafts still go)."""
        try:
            return self.draft.propose(asks)
        except Exception as e:  # noqa: BLE001 - a failing draft model must not stop the answers
            self.stats.draft_errors += 1
            if self.stats.draft_errors <= _LOGGED_ERRORS:
                _log(f"draft model failed ({type(e).__name__}: {e}); answered without it")
            return None

    def _add(self, drafts: list[SpecDraft], draft: SpecDraft) -> None:
        if draft.tokens:
            drafts.append(draft)
            self.stats.drafts[draft.source] += 1
            self.stats.draft_tokens[draft.source] += len(draft.tokens)

    def _end(self, who: bytes, msg: SpecEnd) -> None:
        for seq_id in msg.seq_ids:
            live = self.seqs.end(who, seq_id)
            if self.draft is not None:
                self.draft.forget((who, seq_id))
            if live is None:
                continue
            self.stats.ends += 1
            if live.domain and self.tables is not None:
                self.tables.learn(live.domain, live.lookup.tokens, live.prompt_len)


def serve(config: SpecConfig) -> int:
    """Run the spec service until SIGTERM or SIGINT; its exit status."""
    # The tables' writer thread counts in Python: at CPython's default 5 ms switch interval an
    # ask arriving meanwhile waits up to 5 ms for the GIL, past a worker's 2 ms grace (measured
    # while learning 1,000-token outputs: p99 wake-up 5.2 ms at 5 ms, 0.84 ms at 0.5 ms)
    sys.setswitchinterval(0.0005)
    seqs = LiveSequences(config.max_seqs, config.max_tokens, config.ngram_min, config.ngram_max)
    stats = SpecStats()
    try:
        draft = _load_draft(config)
    except (ValueError, OSError) as e:  # a vocabulary mismatch, a bad GGUF, a missing file
        _log(f"cannot start the draft model: {e}")
        return 2
    tables = DomainTables(
        config.table_dir, config.table_max_ngrams, config.ngram_min, config.ngram_max
    )
    service = SpecService(seqs, stats, config.max_draft, tables, draft)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    stopping: list[int] = []
    previous = {s: signal.signal(s, lambda n, _f: stopping.append(n)) for s in _SIGNALS}
    try:
        try:
            sock.bind(config.endpoint)
        except zmq.ZMQError as e:
            _log(f"cannot bind {config.endpoint} ({e})")
            return 2
        if config.metrics_port:
            serve_metrics(config.metrics_port, stats, seqs, tables, draft)
        where = f"at {config.table_dir} ({tables.ngrams} n-grams)" if tables.enabled else "off"
        model = "off"
        if draft is not None:
            model = f"{config.draft} on {config.draft_device} ({draft.n_layers} layers)"
        _log(
            f"ready at {config.endpoint}, prompt lookup over n-grams {config.ngram_min}.."
            f"{config.ngram_max}, up to {config.max_seqs} sequences and {config.max_tokens} "
            f"tokens, domain tables {where}, draft model {model}"
        )
        _loop(sock, service, config.summary_interval_s, stopping)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close(0)
        ctx.term()
        tables.close()


def _load_draft(config: SpecConfig) -> DraftModel | None:
    """The draft model, its vocabulary checked against the target's first (no draft: None)."""
    if not config.draft:
        return None
    from services.spec.vocab_check import check_vocab  # the GGUF reader: with a draft only

    if config.target:
        size = check_vocab(config.draft, config.target)
        _log(f"draft model {config.draft}: the vocabulary of {config.target} ({size} tokens)")
    else:
        _log(f"no --target: the vocabulary of the draft model {config.draft} is not checked")
    import torch

    from services.spec.draft_model import DraftModel

    if config.draft_device == "cpu" and config.draft_threads:
        torch.set_num_threads(config.draft_threads)
    return DraftModel(config.draft, config.draft_device, config.draft_kv_blocks)


def _loop(sock: zmq.Socket, service: SpecService, every_s: float, stopping: list) -> None:
    encode = encoder().encode
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    stats, seqs, tables, draft = service.stats, service.seqs, service.tables, service.draft
    last_log, last_seen = time.monotonic(), snapshot(stats, seqs, tables, draft)
    while not stopping:
        if poller.poll(500):
            for _ in range(256):  # a bounded drain, so the summary and signals get their turn
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out = service.handle(frames)
                if out:
                    with contextlib.suppress(zmq.Again):  # a peer past its HWM: drop
                        sock.send_multipart([out[0], encode(out[1])], zmq.NOBLOCK)
        now = time.monotonic()
        if now - last_log >= every_s:
            last_log = now
            seen = snapshot(stats, seqs, tables, draft)
            if seen != last_seen:
                last_seen = seen
                print(summary(stats, seqs, tables, draft), file=sys.stderr, flush=True)
