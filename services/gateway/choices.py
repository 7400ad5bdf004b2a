"""A request's n choices: n `Generation`s of one prompt, their deltas merged in the order they
come, and all ended together.

Choice 0 starts first; the others start once its first token is out, on the same worker where
the router allows: the prompt's full blocks are then in that worker's prefix cache, so the
prompt is computed once (each other choice computes its last partial block only). Choice i
samples with seed + i (wrapped to int64), so seeded choices differ from each other and are each
reproducible. With one choice the deltas come straight
from its generation; with more, a task per choice pumps its deltas into one queue, so a stream
interleaves the choices as the worker makes them, and a failure of any (the client leaving
too) ends the request: `close()` aborts every choice still running on a worker.
"""

from __future__ import annotations

import asyncio

import msgspec

from services.gateway.generation import Delta, Generation
from services.gateway.metrics import GatewayMetrics
from shared.protocol import Sampling

_INT64 = 2**63


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: seed + index, kept in int64's range (the wire's)."""
    if seed is None:
        return None
    return (seed + index + _INT64) % (2 * _INT64) - _INT64


class Choices:
    def __init__(self, gens: list[Generation], metrics: GatewayMetrics) -> None:
        self.gens = gens
        self.metrics = metrics
        # (choice index, a delta, the exception that ended it, or None once it is done)
        self._queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._running = len(gens)

    async def start(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop_ids: list[int],
        domain: str,
    ) -> None:
        def seeded(i: int) -> Sampling:
            return msgspec.structs.replace(sampling, seed=choice_seed(sampling.seed, i))

        first = self.gens[0]
        await first.start(prompt_ids, max_tokens, seeded(0), stop_ids, domain)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        if len(self.gens) == 1:
            return
        # the others once choice 0 has its first token: its prompt's full blocks are then in
        # the worker's prefix cache, and each of them computes only the last partial block
        prefilled = asyncio.Event()
        self._pumps = [asyncio.create_task(self._pump(0, first, prefilled), name="choice-0")]
        await prefilled.wait()
        for i, gen in enumerate(self.gens[1:], 1):
            await gen.start(
                prompt_ids, max_tokens, seeded(i), stop_ids, domain, prefer=first.stream.worker_id
            )
            self._pumps.append(asyncio.create_task(self._pump(i, gen), name=f"choice-{i}"))

    # -- usage: the prompt once, the completions summed -----------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return self.gens[0].prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(gen.completion_tokens for gen in self.gens)

    @property
    def cached_tokens(self) -> int:
        # the prompt is counted once: as cached only where every choice found it cached
        return min(gen.cached_tokens for gen in self.gens)

    # -- deltas -----------------------------------------------------------------------------------
    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        if len(self.gens) == 1:
            return 0, await self.gens[0].__anext__()
        while self._running:
            index, item = await self._queue.get()
            if item is None:
                self._running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def _pump(self, index: int, gen: Generation, first: asyncio.Event | None = None) -> None:
        """The choice's deltas into the queue; `first` set at its first delta (or its end)."""
        try:
            async for delta in gen:
                self._queue.put_nowait((index, delta))
                if first is not None:
                    first.set()
        except Exception as exc:  # the worker failed it, or the client left: the request ends
            self._queue.put_nowait((index, exc))
        else:
            self._queue.put_nowait((index, None))
        finally:
            if first is not None:
                first.set()

    async def close(self) -> None:
        """Stop the pumps, then abort every choice the worker still runs."""
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for gen in self.gens:
            await gen.close()
