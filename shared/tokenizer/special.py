"""Cutting special tokens out of text before segmentation (llama.cpp's `tokenizer_st_partition`).

llama.cpp walks its special tokens longest first and, for each, splits every remaining text
fragment at all of its occurrences. The result is "longest token wins globally", which is not
the same as a leftmost-longest scan, so the same order is kept here. USER_DEFINED tokens are
cut out even when `special=False`; CONTROL and UNKNOWN ones only when `special=True`.
"""

from __future__ import annotations

from shared.tokenizer.vocab import (
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    Vocab,
)

Fragment = str | int  # raw text, or a token id already decided

# C isspace(): what llama.cpp's LSTRIP/RSTRIP remove
_C_SPACE = " \t\n\v\f\r"
# Most specials share a prefix ("<unused", "<|"): one `in` test per prefix group rules a whole
# group out, which keeps a 6k-special vocabulary (Gemma) cheap to scan.
_GROUP_PREFIX = 4
_SMALL_GROUP = 8


class SpecialTokens:
    """The partition for one vocabulary, for both values of `parse_special`."""

    def __init__(self, vocab: Vocab) -> None:
        self._attrs = vocab.attrs
        ids = vocab.special_ids()
        # Longest first as llama.cpp sorts; equal lengths in id order (its sort is unstable,
        # and two equal-length specials overlapping in one text is not a real case).
        ids.sort(key=lambda i: -len(vocab.tokens[i]))
        self._order = {tid: rank for rank, tid in enumerate(ids)}
        self._groups: dict[bool, dict[str, dict[str, int]]] = {False: {}, True: {}}
        for tid in ids:
            text = vocab.tokens[tid]
            self._groups[True].setdefault(text[:_GROUP_PREFIX], {})[text] = tid
            if not vocab.attrs[tid] & (ATTR_CONTROL | ATTR_UNKNOWN):
                self._groups[False].setdefault(text[:_GROUP_PREFIX], {})[text] = tid
        # lengths per prefix over all specials; the parse_special=False groups are subsets
        self._lengths = {p: sorted({len(t) for t in g}) for p, g in self._groups[True].items()}

    def _present(self, text: str, parse_special: bool) -> list[tuple[str, int]]:
        """The specials occurring in `text`, in partition order."""
        found: dict[str, int] = {}
        for prefix, group in self._groups[parse_special].items():
            if prefix not in text:
                continue
            if len(group) <= _SMALL_GROUP:
                found.update((t, tid) for t, tid in group.items() if t in text)
                continue
            # a big family ("<unused0>".."<unused6241>"): look up the text at each occurrence
            # of the shared prefix instead of searching for every member
            lengths = self._lengths[prefix]
            pos = text.find(prefix)
            while pos >= 0:
                for n in lengths:
                    tid = group.get(text[pos : pos + n])
                    if tid is not None:
                        found[text[pos : pos + n]] = tid
                pos = text.find(prefix, pos + 1)
        return sorted(found.items(), key=lambda e: self._order[e[1]])

    def partition(self, text: str, parse_special: bool) -> list[Fragment]:
        """Split `text` into raw-text fragments and special token ids, in order."""
        if not text:
            return []
        fragments: list[Fragment] = [text]
        for special, tid in self._present(text, parse_special):
            attr = self._attrs[tid]
            out: list[Fragment] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(special)
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                    if attr & ATTR_LSTRIP and k + 1 < len(parts):
                        part = part.rstrip(_C_SPACE)
                    if attr & ATTR_RSTRIP and k:
                        part = part.lstrip(_C_SPACE)
                    if part:
                        out.append(part)
            fragments = out
        return fragments
