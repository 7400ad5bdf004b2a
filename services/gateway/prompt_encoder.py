"""Tokenizing prompt text without stalling the streams the gateway is serving.

A long text (over ``THREAD_ENCODE_CHARS``) is tokenized on a thread, so that the event loop
keeps writing tokens meanwhile (32k tokens took 60-90 ms on a 2-core machine). Byte-level BPE
releases the GIL while it encodes a long text (shared/tokenizer/bpe.py); SentencePiece
(shared/tokenizer/spm.py, pure Python) holds it, and the event loop then waits up to
CPython's switch interval (5 ms) at every point where it needs the GIL back, once per message,
write and wake-up: W3's streams saw 44-59 ms gaps beside a gemma3 text prompt (BENCHMARKS.md
2026-11-30 (p)). While any such thread runs, the switch interval is lowered to
``BUSY_SWITCH_S`` and restored when the last one ends.
"""

from __future__ import annotations

import asyncio
import sys

__all__ = ["BUSY_SWITCH_S", "THREAD_ENCODE_CHARS", "PromptEncoder"]

THREAD_ENCODE_CHARS = 8192
BUSY_SWITCH_S = 0.0005


class PromptEncoder:
    """``encode`` of one tokenizer for the gateway's handlers (all on its event loop)."""

    def __init__(self, tokenizer, busy_switch_s: float = BUSY_SWITCH_S) -> None:
        self.tokenizer = tokenizer
        self._busy_switch_s = busy_switch_s
        self._threads = 0  # long encodes running on threads now
        self._saved_switch_s = 0.0

    async def encode(self, text: str, add_special: bool, special: bool = True) -> list[int]:
        tok = self.tokenizer
        if len(text) <= THREAD_ENCODE_CHARS:
            return tok.encode(text, add_special=add_special, special=special)
        if self._threads == 0:
            self._saved_switch_s = sys.getswitchinterval()
            sys.setswitchinterval(min(self._saved_switch_s, self._busy_switch_s))
        self._threads += 1
        try:
            return await asyncio.to_thread(
                tok.encode, text, add_special=add_special, special=special
            )
        finally:
            self._threads -= 1
            if self._threads == 0:
                sys.setswitchinterval(self._saved_switch_s)
