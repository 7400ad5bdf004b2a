"""The live sequences: a copy of each speculating sequence's tokens (with its prompt-lookup
index), keyed by the worker's socket identity and the sequence id, within a bound.

Workers forget to end sequences when they die or reconnect under a new identity, so the bound
is what frees those: one LRU over every key, the least recently asked going first while more
than `max_seqs` sequences or `max_tokens` tokens are held (the one just asked always stays). A
worker whose sequence was evicted learns it from `unknown` and resends it whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.spec.prompt_lookup import PromptLookup
from shared.protocol import SpecSeq

Key = tuple[bytes, int]  # (worker identity, seq id)


@dataclass
class LiveSeq:
    lookup: PromptLookup
    domain: str  # "": none; set by the first item that names one, changed by a later one
    prompt_len: int  # the tokens of its first copy: what comes after them is output


class LiveSequences:
    def __init__(self, max_seqs: int, max_tokens: int, n_min: int, n_max: int) -> None:
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.n_min, self.n_max = n_min, n_max
        self._seqs: OrderedDict[Key, LiveSeq] = OrderedDict()  # least recently asked first
        self.tokens = 0  # held in all
        self.evicted = 0
        self.on_evict: Callable[[Key], None] | None = None  # hears of each sequence evicted

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, key: Key) -> bool:
        return key in self._seqs

    def update(self, who: bytes, seq: SpecSeq) -> LiveSeq | None:
        """Apply one `SpecSeq` (its copy cut at `start`, its tokens appended) and make it the
        most recent; None, and nothing changed, when it has no copy from `start` on (unknown
        with start > 0, or start past its copy's end)."""
        key = (who, seq.seq_id)
        live = self._seqs.get(key)
        if live is None:
            if seq.start:
                return None
            live = LiveSeq(PromptLookup(self.n_min, self.n_max, seq.tokens), seq.domain, 0)
            live.prompt_len = len(live.lookup)
            self._seqs[key] = live
        else:
            held = len(live.lookup)
            kept = live.lookup.update(seq.start, seq.tokens)
            if kept is None:
                return None
            self.tokens -= held
            live.domain = seq.domain or live.domain  # "" (the wire's default) keeps it
            live.prompt_len = min(live.prompt_len, kept)
        self.tokens += len(live.lookup)
        self._seqs.move_to_end(key)
        self._evict()
        return live

    def end(self, who: bytes, seq_id: int) -> LiveSeq | None:
        """Forget a sequence; what it held (None: it had no copy)."""
        live = self._seqs.pop((who, seq_id), None)
        if live is not None:
            self.tokens -= len(live.lookup)
        return live

    def _evict(self) -> None:
        while len(self._seqs) > self.max_seqs or (
            self.tokens > self.max_tokens and len(self._seqs) > 1
        ):
            key, live = self._seqs.popitem(last=False)
            self.tokens -= len(live.lookup)
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(key)
