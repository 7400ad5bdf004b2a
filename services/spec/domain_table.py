"""Persistent domain n-gram tables: what followed each n-gram in the outputs served for a
domain ("code", "sql", a team's name), counted in an LMDB env at `<table-dir>/ngrams.lmdb`,
so that a restart keeps what it learned and a sequence whose own tokens hold no match (prompt
lookup's blind spot: the first lines of new code) still gets a draft.

- Key: the domain (UTF-8, then a 0 byte), then the n-gram's ids as big-endian uint32. Value: a
  msgpack `NextCounts`: how often the n-gram was seen, and its `TOP` most frequent next tokens
  with their counts, most frequent first (the rest only count in `total`).
- `learn` takes a finished sequence's tokens and where its output starts: only the n-grams
  whose next token is output are counted (a prompt is the user's, and often boilerplate of a
  chat template that every request repeats). The counting runs on a writer thread (a queue
  bounded in sequences; when it is full the sequence is dropped and counted), so the ROUTER
  loop never waits on a commit.
- `propose` drafts greedily: for the current suffix, the longest n-gram (n_max down to n_min)
  whose top next token is trusted (seen `MIN_COUNT` times, more than `MIN_SHARE` of its
  n-gram's observations: a strict majority, so never a tie) gives the next token; the draft is
  extended from itself, up to k tokens. llama.cpp's static lookup cache asks for a sample size
  and a share the same way: a guess seen once is mostly noise, and a wrong draft costs the
  verification step its rows.
- Over `max_ngrams` entries (all domains together), the writer drops the entries seen least
  (lowest `total` first; among equals a random sample, so no domain or id range is favoured,
  nor the survivors of an earlier prune) until about 3/4 of the cap is left. Counts do not
  age: a table keeps a domain's steady habits over newcomers seen less often, and a fresh
  `--table-dir` starts over.
- Measured (the dev machine's EPYC core, n 3..8, a table of 120k entries): learning a
  1,000-token output ~30 ms on the writer thread (the loop keeps answering: service.py sets a
  short GIL switch interval for it); a proposal of 8 tokens ~16 us, one that finds nothing ~7 us.
- A dir that cannot be made or opened turns the tables off with a warning (`enabled` False),
  never an exception.
"""

from __future__ import annotations

import os
import queue
import random
import re
import struct
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import lmdb
import msgspec

from shared.protocol import DOMAIN_PATTERN

TOP = 4  # next tokens kept per n-gram
MIN_COUNT = 2  # a next token proposed only once seen this often after its n-gram
MIN_SHARE = 0.5  # and as more than this share of the n-gram's observations
_ENTRY_BYTES = 160  # an entry's share of the map (key, value, LMDB's page overhead), generous
_SLACK = 64 << 20
_DOMAIN = re.compile(DOMAIN_PATTERN)
_MAX_ID = 1 << 32


class NextCounts(msgspec.Struct, array_like=True, gc=False):
    total: int  # observations of the n-gram
    tokens: list[int]  # its most frequent next tokens, most frequent first
    counts: list[int]


_decode = msgspec.msgpack.Decoder(NextCounts).decode  # a Decoder holds no state: threads share it


def valid_domain(domain: str) -> bool:
    """Names of letters, digits, '.', '_', '-' (at most 64): a domain is a key prefix."""
    return _DOMAIN.fullmatch(domain) is not None


def ngram_key(domain: str, gram: Sequence[int]) -> bytes:
    return domain.encode() + b"\0" + struct.pack(f">{len(gram)}I", *gram)


def _warn(msg: str) -> None:
    print(f"spec: warning: {msg}", file=sys.stderr, flush=True)


class DomainTables:
    def __init__(
        self,
        directory: str,
        max_ngrams: int,
        n_min: int,
        n_max: int,
        max_pending: int = 256,
        warn: Callable[[str], None] = _warn,
    ) -> None:
        self.directory, self.max_ngrams = directory, max_ngrams
        self.n_min, self.n_max = n_min, n_max
        self._warn = warn
        self.learned = 0  # sequences counted
        self.dropped = 0  # sequences not counted: the queue was full
        self.pruned = 0  # entries dropped over the cap
        self.write_errors = 0
        self._rng = random.Random(0)  # which of the entries seen `cut` times a prune drops
        self._queue: queue.Queue[tuple[str, list[int], int] | None] = queue.Queue(max_pending)
        self._env: lmdb.Environment | None = None
        self._thread: threading.Thread | None = None
        if max_ngrams > 0:
            self._open()

    @property
    def enabled(self) -> bool:
        return self._env is not None

    @property
    def ngrams(self) -> int:
        return self._env.stat()["entries"] if self._env is not None else 0

    def _open(self) -> None:
        path = os.path.join(self.directory, "ngrams.lmdb")
        try:
            os.makedirs(path, exist_ok=True)
            map_size = self.max_ngrams * _ENTRY_BYTES + _SLACK
            self._env = lmdb.open(path, map_size=map_size, metasync=False, readahead=False)
        except (OSError, lmdb.Error) as e:
            self._warn(f"domain tables off: {path} is unusable ({e})")
            self._env = None
            return
        self._thread = threading.Thread(target=self._writer, name="spec-tables", daemon=True)
        self._thread.start()

    # -- learning --------------------------------------------------------------------------------
    def learn(self, domain: str, tokens: list[int], output_start: int) -> bool:
        """Queue a finished sequence's counts; False when off, the domain or ids are bad, or the
        queue is full (counted)."""
        if self._env is None or not valid_domain(domain) or len(tokens) <= output_start:
            return False
        if not all(0 <= t < _MAX_ID for t in tokens):
            return False
        try:
            self._queue.put_nowait((domain, list(tokens), output_start))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued sequence is counted (tests, close)."""
        self._queue.join()

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._count(*item)
            except lmdb.Error as e:
                self.write_errors += 1
                self._warn(f"domain table write failed ({e})")
            finally:
                self._queue.task_done()

    def _count(self, domain: str, tokens: list[int], output_start: int) -> None:
        seen: Counter[tuple[tuple[int, ...], int]] = Counter()
        for n in range(self.n_min, self.n_max + 1):
            for p in range(max(output_start, n), len(tokens)):
                seen[(tuple(tokens[p - n : p]), tokens[p])] += 1
        by_gram: dict[tuple[int, ...], Counter[int]] = {}
        for (gram, nxt), c in seen.items():
            by_gram.setdefault(gram, Counter())[nxt] += c
        assert self._env is not None
        try:
            self._merge(domain, by_gram)
        except lmdb.MapFullError:
            self._prune(self.max_ngrams // 2)
            self._merge(domain, by_gram)
        self.learned += 1
        if self.ngrams > self.max_ngrams:
            self._prune(self.max_ngrams * 3 // 4)

    def _merge(self, domain: str, by_gram: dict[tuple[int, ...], Counter[int]]) -> None:
        assert self._env is not None
        with self._env.begin(write=True) as txn:
            for gram, nxt in by_gram.items():
                key = ngram_key(domain, gram)
                old = txn.get(key)
                total = sum(nxt.values())
                if old is not None:
                    had = _decode(old)
                    total += had.total
                    nxt.update(dict(zip(had.tokens, had.counts, strict=True)))
                top = nxt.most_common(TOP)
                value = NextCounts(total, [t for t, _ in top], [c for _, c in top])
                txn.put(key, msgspec.msgpack.encode(value))

    def _prune(self, target: int) -> None:
        """Drop the entries seen least until about `target` are left."""
        assert self._env is not None
        with self._env.begin(write=True) as txn:
            totals = Counter(_decode(v).total for v in txn.cursor().iternext(keys=False))
            excess = sum(totals.values()) - target
            if excess <= 0:
                return
            # every entry seen fewer than `cut` times goes, and `share` of those seen `cut`
            # times (cut None: all of them)
            cut, share = None, 0.0
            for level in sorted(totals):
                if excess < totals[level]:
                    cut, share = level, excess / totals[level]
                    break
                excess -= totals[level]
            cursor = txn.cursor()
            more = cursor.first()
            while more:
                total = _decode(cursor.value()).total
                drop = cut is None or total < cut
                drop = drop or (total == cut and self._rng.random() < share)
                if not drop:
                    more = cursor.next()
                    continue
                self.pruned += 1
                # onto the next entry; a key is never empty, so b"" means none is left
                more = cursor.delete() and cursor.key() != b""

    # -- proposing -------------------------------------------------------------------------------
    def propose(self, domain: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that the domain's counts trust to follow `tokens`; [] when none."""
        if self._env is None or k <= 0 or not valid_domain(domain):
            return []
        ctx = list(tokens[max(0, len(tokens) - self.n_max) :])
        if not all(0 <= t < _MAX_ID for t in ctx):
            return []  # an id no table can hold: nothing to match
        draft: list[int] = []
        with self._env.begin(buffers=True) as txn:
            while len(draft) < k:
                nxt = None
                for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
                    value = txn.get(ngram_key(domain, ctx[len(ctx) - n :]))
                    if value is None:
                        continue
                    nc = _decode(value)
                    if nc.counts[0] >= MIN_COUNT and nc.counts[0] > MIN_SHARE * nc.total:
                        nxt = nc.tokens[0]
                        break
                if nxt is None:
                    break
                draft.append(nxt)
                ctx = [*ctx, nxt][-self.n_max :]
        return draft

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued counting (up to timeout), then close the env."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        if self._env is not None:
            self._env.close()
            self._env = None
