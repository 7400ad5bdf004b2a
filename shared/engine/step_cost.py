"""What a step costs on this worker's device, learned from the steps it runs.

A step's time is modelled as ``base + per_token * tokens + per_pair * pairs``: ``tokens`` are the
rows the step computes (decode rows, verified drafts and prompt-chunk tokens alike: each is a row
of every matmul), ``pairs`` the query-key pairs its attention scores (a decode row over c cached
tokens: c; a chunk of n tokens after p cached ones: n * p + n * (n + 1) / 2). ``base`` holds what
a step pays whatever its size (reading the weights once, launches, Python). The coefficients are
a least-squares fit over recent steps, refitted as steps arrive, with each coefficient kept
non-negative and steps far slower than the fit (a pause of the process) left out; a device, a
model and a machine's load each get their own numbers without a table of them.

Recent steps are kept per size class (rows by powers of two), a window each: while a long prompt
prefills every step has about the same rows, and a single window would forget the decode-only
steps, leaving rows and the fixed cost impossible to tell apart.
"""

from __future__ import annotations

from collections import deque
from itertools import combinations

import numpy as np

__all__ = ["StepCost", "chunk_pairs"]

_PAIR_UNIT = 1e3  # pairs are fitted in thousands: the columns' scales stay close


def chunk_pairs(n: int, prefix: int) -> int:
    """Query-key pairs of n new tokens after prefix cached ones (causal among the new ones)."""
    return n * prefix + n * (n + 1) // 2


class StepCost:
    def __init__(self, window: int = 32, refit_every: int = 4) -> None:
        self.window = window  # steps kept per size class
        self.classes: dict[int, deque[tuple[float, float, float]]] = {}
        self.refit_every = refit_every
        self.coef = np.zeros(3)  # ms: base, per token, per thousand pairs
        self.ready = False  # whether the fit has seen steps of two sizes (a slope to go by)
        self._since_fit = 0

    @property
    def samples(self) -> list[tuple[float, float, float]]:
        """The steps the fit is over: (rows, thousands of pairs, ms)."""
        return [x for c in self.classes.values() for x in c]

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        c = self.classes.setdefault(tokens.bit_length(), deque(maxlen=self.window))
        c.append((float(tokens), pairs / _PAIR_UNIT, seconds * 1e3))
        self._since_fit += 1
        # while few steps are held, each one refits (a handful of classes: a cheap count)
        if self._since_fit >= self.refit_every or sum(map(len, self.classes.values())) <= 16:
            self.refit()

    def reset(self) -> None:
        self.classes.clear()
        self.coef = np.zeros(3)
        self.ready = False

    def predict_ms(self, tokens: int, pairs: int) -> float:
        base, per_token, per_pair = self.coef
        return float(base + per_token * tokens + per_pair * pairs / _PAIR_UNIT)

    def refit(self) -> None:
        self._since_fit = 0
        if not self.samples:
            return
        data = np.array(self.samples)
        self.ready = len(np.unique(data[:, 0])) >= 2
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        coef = _nonneg_lstsq(x, y)
        resid = y - x @ coef
        # a step far slower than the fit (a pause, another process's burst) does not move it;
        # a faster one is information (nothing makes a step faster than it can be)
        spread = max(4.0 * float(np.median(np.abs(resid))), 0.05 * float(np.median(y)))
        keep = resid <= spread
        if 4 <= keep.sum() < len(y):
            coef = _nonneg_lstsq(x[keep], y[keep])
        self.coef = coef


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best fit over the subsets of columns
    whose unconstrained solution is non-negative (three columns: seven subsets at most)."""
    n = x.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for k in range(n, 0, -1):
        for cols in combinations(range(n), k):
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            full = np.zeros(n)
            full[list(cols)] = sol
            err = float(np.sum((x @ full - y) ** 2))
            if err < best_err - 1e-12:
                best, best_err = full, err
    return best
