"""The gateway's prompt encoder (services/gateway/prompt_encoder.py): long texts go to a thread
with CPython's switch interval lowered while any is running, and restored after the last."""

from __future__ import annotations

import asyncio
import sys
import threading

from services.gateway.prompt_encoder import THREAD_ENCODE_CHARS, PromptEncoder


class _Recorder:
    """A tokenizer stand-in: one id a character; notes the thread and switch interval it ran
    with, and (when `hold` is set) waits for it before returning."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, float]] = []
        self.hold: threading.Event | None = None

    def encode(self, text: str, add_special: bool, special: bool) -> list[int]:
        on_main = threading.current_thread() is threading.main_thread()
        self.seen.append((on_main, sys.getswitchinterval()))
        if self.hold is not None:
            assert self.hold.wait(5)
        return [ord(c) for c in text] + ([1] if add_special else [])


def test_short_texts_inline_and_long_ones_on_a_thread_with_a_short_switch_interval() -> None:
    before = sys.getswitchinterval()
    tok = _Recorder()
    enc = PromptEncoder(tok, busy_switch_s=0.0002)
    short, long = "ab", "x" * (THREAD_ENCODE_CHARS + 1)
    assert asyncio.run(enc.encode(short, add_special=True)) == [97, 98, 1]
    assert asyncio.run(enc.encode(long, add_special=False)) == [120] * len(long)
    assert tok.seen[0] == (True, before)  # inline, untouched
    assert tok.seen[1][0] is False and abs(tok.seen[1][1] - 0.0002) < 1e-9  # microseconds inside
    assert sys.getswitchinterval() == before


def test_overlapping_long_encodes_restore_the_interval_once_both_end() -> None:
    before = sys.getswitchinterval()
    tok = _Recorder()
    tok.hold = threading.Event()
    enc = PromptEncoder(tok, busy_switch_s=0.0003)
    text = "y" * (THREAD_ENCODE_CHARS + 5)

    async def run() -> None:
        first = asyncio.create_task(enc.encode(text, add_special=False))
        second = asyncio.create_task(enc.encode(text, add_special=False))
        while len(tok.seen) < 2:  # both threads inside encode
            await asyncio.sleep(0.01)
        assert abs(sys.getswitchinterval() - 0.0003) < 1e-9
        tok.hold.set()
        await asyncio.gather(first, second)

    asyncio.run(run())
    assert all(abs(s - 0.0003) < 1e-9 for _, s in tok.seen) and len(tok.seen) == 2
    assert sys.getswitchinterval() == before


def test_a_failing_encode_restores_the_interval() -> None:
    before = sys.getswitchinterval()

    class Broken:
        def encode(self, text: str, add_special: bool, special: bool) -> list[int]:
            raise ValueError("no byte token")

    enc = PromptEncoder(Broken())
    try:
        asyncio.run(enc.encode("z" * (THREAD_ENCODE_CHARS + 1), add_special=False))
    except ValueError:
        pass
    else:
        raise AssertionError("the tokenizer's error must reach the caller")
    assert sys.getswitchinterval() == before
