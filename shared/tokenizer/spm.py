"""SentencePiece-style segmentation, exactly as llama.cpp's `llm_tokenizer_spm` does it.

The algorithm: start from single characters, repeatedly merge the adjacent pair whose
concatenation is the vocabulary piece with the highest score (ties: leftmost pair), until no
adjacent pair forms a piece; characters that never became a piece are emitted as `<0xNN>`
byte tokens. Any piece may be formed this way, control and user-defined ones included.

Why not `tokenizers`' BPE with merges derived from the scores: for Gemma's 262k pieces that
means ~515k derived merges and ~4 s to derive and build (loading must stay under ~2 s); BPE ranks
cannot express "equal score, leftmost wins". Instead the text is cut into chunks that no
piece can span and each chunk is segmented here, with a per-instance cache of chunk results,
so repeated words cost a dict lookup.
"""

from __future__ import annotations

import heapq
import re

_SPACE = "▁"
# A chunk boundary is a "▁" that follows another character: a piece spanning it would contain
# "x▁", and only the few pieces listed in `SpmModel._spanning` do.
_CHUNK = re.compile(r"▁*[^▁]+|▁+")
_CACHE_MAX = 1 << 16
# More spanning pieces than this and chunking stops paying for itself: segment whole fragments.
_MAX_SPANNING = 256


class SpmModel:
    """Score-driven merge segmentation over one vocabulary."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float], unk_id: int | None):
        self._get = token_to_id.get
        self._scores = scores
        self._unk_id = unk_id
        self._bytes = [token_to_id.get(f"<0x{b:02X}>") for b in range(256)]
        for b in range(128):  # llama.cpp's fallback when `<0xNN>` is missing: the raw byte
            if self._bytes[b] is None:
                self._bytes[b] = token_to_id.get(chr(b))
        spanning = [t for t in token_to_id if _SPACE in t[1:] and re.search("[^▁]▁", t)]
        self._spanning = spanning if len(spanning) <= _MAX_SPANNING else None
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """Segment already-escaped text (spaces replaced by "▁")."""
        out: list[int] = []
        cache = self._cache
        for chunk in self._chunks(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._segment(chunk)
                if len(cache) >= _CACHE_MAX:
                    cache.clear()
                cache[chunk] = ids
            out.extend(ids)
        return out

    def _chunks(self, text: str) -> list[str]:
        if self._spanning is None or _SPACE not in text:
            return [text]
        starts = [m.start() for m in _CHUNK.finditer(text)]
        keep = set(starts)
        for piece in self._spanning:
            pos = text.find(piece)
            while pos >= 0:  # an occurrence of a spanning piece glues its chunks together
                keep.difference_update(range(pos + 1, pos + len(piece)))
                pos = text.find(piece, pos + 1)
        cuts = [s for s in starts if s in keep] + [len(text)]
        return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]

    def _segment(self, text: str) -> list[int]:
        # Symbol i starts at character i (merges only grow a symbol to the right), so a symbol
        # is its length plus its neighbours; length 0 marks a symbol merged away.
        n = len(text)
        get, scores = self._get, self._scores
        length = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []
        for i in range(n - 1):
            tid = get(text[i : i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)

        def push(left: int, right: int) -> None:
            size = length[left] + length[right]
            tid = get(text[left : left + size])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, size))

        while heap:
            _, left, right, size = heapq.heappop(heap)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue  # stale: one side was merged since this pair was queued
            length[left] = size
            length[right] = 0
            after = nxt[left] = nxt[right]
            if after >= 0:
                prev[after] = left
            if prev[left] >= 0:
                push(prev[left], left)
            if after >= 0:
                push(left, after)

        out: list[int] = []
        i = 0
        while i >= 0:
            piece = text[i : i + length[i]]
            tid = get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_ids(piece))
            i = nxt[i]
        return out

    def _byte_ids(self, piece: str) -> list[int]:
        ids = []
        for b in piece.encode("utf-8", "surrogatepass"):
            tid = self._bytes[b]
            if tid is None:
                tid = self._unk_id
                if tid is None:  # llama.cpp aborts here; an exception is kinder
                    raise ValueError(f"no byte token for 0x{b:02X} and no unknown token")
            ids.append(tid)
        return ids
