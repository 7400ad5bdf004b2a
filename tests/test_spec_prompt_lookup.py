"""Prompt lookup's incremental n-gram index against a brute-force scan of the history: the
longest suffix wins, then its most recent earlier occurrence; drafts never run past the end;
appending, truncating and resending leave the index equal to a fresh one. CPU only, fast."""

from __future__ import annotations

import random

import pytest

from services.spec.prompt_lookup import PromptLookup


def reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The draft by a scan: for n from n_max down, the latest q < len - n with tokens[q:q+n]
    equal to the last n tokens gives what follows it."""
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n :]
        for q in range(len(tokens) - n - 1, -1, -1):
            if tokens[q : q + n] == suffix:
                return tokens[q + n : q + n + k]
    return []


def test_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    # the 4-gram 1 2 3 4 occurred at the start (then 50); the 2-gram 3 4 more recently (then 60)
    tokens = [1, 2, 3, 4, 50, 51, 9, 3, 4, 60, 61, 8, 1, 2, 3, 4]
    assert PromptLookup(2, 4, tokens).propose(2) == [50, 51]
    assert PromptLookup(2, 3, tokens).propose(2) == [50, 51]  # 2 3 4 only at the start too
    assert PromptLookup(2, 2, tokens).propose(2) == [60, 61]  # 3 4: the latest wins


def test_most_recent_occurrence_wins() -> None:
    tokens = [7, 8, 10, 11, 7, 8, 20, 21, 0, 7, 8]
    assert PromptLookup(2, 4, tokens).propose(3) == [20, 21, 0]


def test_k_bounds_the_draft_and_the_history_end_bounds_it_too() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 5, 6]
    pl = PromptLookup(2, 4, tokens)
    assert pl.propose(3) == [7, 8, 9]
    assert pl.propose(0) == [] and pl.propose(-1) == []
    assert pl.propose(100) == [7, 8, 9, 10, 5, 6]  # up to the end, never past it
    run = PromptLookup(3, 4, [1, 1, 1, 1])  # (1 1 1) at 1..3 is the suffix: only 0..2 counts
    assert run.propose(8) == [1]


def test_nothing_to_propose() -> None:
    assert PromptLookup(2, 4, []).propose(4) == []
    assert PromptLookup(2, 4, [3]).propose(4) == []
    assert PromptLookup(2, 4, [1, 2, 3, 4, 5]).propose(4) == []  # no repeat
    assert PromptLookup(3, 4, [1, 2, 9, 1, 2]).propose(4) == []  # only a 2-gram repeats
    with pytest.raises(ValueError, match="n_min <= n_max"):
        PromptLookup(3, 2)
    with pytest.raises(ValueError, match="1 <= n_min"):
        PromptLookup(0, 2)


def test_update_cuts_appends_and_reports_what_it_kept() -> None:
    pl = PromptLookup(2, 3, [1, 2, 3, 1, 2])
    assert pl.propose(2) == [3, 1]
    assert pl.update(6, [9]) is None and pl.tokens == [1, 2, 3, 1, 2]  # past the end
    assert pl.update(5, [4]) == 5 and pl.tokens == [1, 2, 3, 1, 2, 4]
    assert pl.update(0, [1, 2, 3, 1, 2, 4]) == 6  # a resend of what it holds: all kept
    assert pl.update(3, [1, 2, 7, 1, 2]) == 5  # 1 2 held already, cut after them
    assert pl.tokens == [1, 2, 3, 1, 2, 7, 1, 2] and pl.propose(2) == [7, 1]
    assert pl.update(2, []) == 2 and pl.tokens == [1, 2]  # a cut alone
    pl.check_integrity()
    assert pl.update(0, [4, 5]) == 0 and pl.tokens == [4, 5] and pl.propose(2) == []
    pl.check_integrity()


@pytest.mark.parametrize(("n_min", "n_max"), [(1, 1), (1, 4), (2, 4), (3, 8)])
def test_random_streams_match_the_scan_through_cuts_and_resends(n_min: int, n_max: int) -> None:
    rng = random.Random(n_min * 100 + n_max)
    for _ in range(40):
        vocab = rng.choice([2, 3, 5, 12])  # small vocabularies repeat n-grams often
        pl = PromptLookup(n_min, n_max, [rng.randrange(vocab) for _ in range(rng.randrange(30))])
        for _ in range(30):
            op = rng.random()
            if op < 0.5:  # a step's few tokens
                pl.extend([rng.randrange(vocab) for _ in range(rng.randrange(1, 4))])
            elif op < 0.75:  # a rollback, then new tokens
                start = rng.randrange(len(pl) + 1)
                pl.update(start, [rng.randrange(vocab) for _ in range(rng.randrange(6))])
            elif op < 0.9:  # a resend from an earlier point of what it holds, and more
                start = rng.randrange(len(pl) + 1)
                pl.update(start, pl.tokens[start:] + [rng.randrange(vocab)])
            else:
                pl.truncate(rng.randrange(len(pl) + 1))
            for k in (1, 3, 16):
                assert pl.propose(k) == reference(pl.tokens, k, n_min, n_max), pl.tokens
            fresh = PromptLookup(n_min, n_max, pl.tokens)
            assert pl._last == fresh._last and pl._prev == fresh._prev
        pl.check_integrity()


def test_a_cut_then_the_same_tokens_again_restores_every_proposal() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(400)]
    pl = PromptLookup(3, 8, tokens)
    want = [pl.propose(8)]
    for cut in (399, 350, 200, 17, 0):
        pl.truncate(cut)
        assert pl.propose(8) == reference(tokens[:cut], 8, 3, 8)
        pl.extend(tokens[cut:])
        assert pl.tokens == tokens and [pl.propose(8)] == want
        pl.check_integrity()
