"""The persistent domain n-gram tables (LMDB): counted from outputs only, per domain, trusted
only when seen often enough, longest n-gram first, kept across a reopen, pruned under the cap
with the frequent n-grams kept; drafts against a brute-force count of what was learned."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from services.spec.domain_table import MIN_COUNT, MIN_SHARE, DomainTables, valid_domain


def _tables(path: Path, max_ngrams: int = 10_000, n_min: int = 2, n_max: int = 4) -> DomainTables:
    return DomainTables(str(path), max_ngrams, n_min, n_max)


def _learn(t: DomainTables, domain: str, tokens: list[int], start: int, times: int = 1) -> None:
    for _ in range(times):
        assert t.learn(domain, tokens, start)
    t.flush()


def reference(
    outputs: list[tuple[list[int], int]], ctx: list[int], k: int, n_min: int, n_max: int
) -> list[int]:
    """The greedy draft from counts made by a scan of every learned output."""
    counts: dict[tuple[int, ...], Counter[int]] = {}
    for tokens, start in outputs:
        for n in range(n_min, n_max + 1):
            for p in range(max(start, n), len(tokens)):
                counts.setdefault(tuple(tokens[p - n : p]), Counter())[tokens[p]] += 1
    ctx, draft = list(ctx), []
    while len(draft) < k:
        nxt = None
        for n in range(min(n_max, len(ctx)), n_min - 1, -1):
            c = counts.get(tuple(ctx[len(ctx) - n :]))
            if c is None:
                continue
            tok, top = max(c.items(), key=lambda kv: (kv[1], -kv[0]))
            if top >= MIN_COUNT and top > MIN_SHARE * sum(c.values()):
                nxt = tok
                break
        if nxt is None:
            return draft
        draft.append(nxt)
        ctx.append(nxt)
    return draft


def test_outputs_seen_twice_are_proposed_per_domain(tmp_path: Path) -> None:
    t = _tables(tmp_path)
    prompt, output = [90, 91, 92, 93], [1, 2, 3, 4, 5, 6]
    _learn(t, "code", prompt + output, len(prompt))
    assert t.propose("code", [7, 1, 2], 4) == []  # seen once: not trusted
    _learn(t, "code", prompt + output, len(prompt))
    assert t.propose("code", [7, 1, 2], 4) == [3, 4, 5, 6]
    assert t.propose("code", [7, 1, 2], 2) == [3, 4]
    assert t.propose("prose", [7, 1, 2], 4) == []  # another domain's table
    assert t.propose("code", [91, 92], 4) == []  # the prompt was not counted
    assert t.propose("code", [93, 1], 4) == [2, 3, 4, 5]  # but it is the first n-gram's context
    assert t.learned == 2 and t.ngrams > 0
    t.close()


def test_the_longest_trusted_ngram_wins_and_a_split_is_not_trusted(tmp_path: Path) -> None:
    t = _tables(tmp_path)
    _learn(t, "d", [1, 2, 3, 10], 3, times=2)  # 1 2 3 -> 10
    _learn(t, "d", [9, 2, 3, 20], 3, times=3)  # 2 3 -> 20 more often than -> 10
    assert t.propose("d", [1, 2, 3], 1) == [10]
    assert t.propose("d", [8, 2, 3], 1) == [20]  # 3/5 of 2 3's observations
    _learn(t, "d", [7, 5, 6, 30], 3, times=2)
    _learn(t, "d", [7, 5, 6, 31], 3, times=2)
    assert t.propose("d", [7, 5, 6], 1) == []  # 2/4 each at every n: a tie, not trusted
    _learn(t, "d", [7, 5, 6, 31], 3)
    assert t.propose("d", [7, 5, 6], 1) == [31]  # 3/5
    t.close()


def test_drafts_match_a_brute_force_count(tmp_path: Path) -> None:
    rng = random.Random(3)
    t = _tables(tmp_path, n_min=2, n_max=4)
    learned: list[tuple[list[int], int]] = []
    for _ in range(60):  # vocabulary 4: no n-gram has more next tokens than the table keeps
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 30))]
        start = rng.randrange(len(tokens))
        assert t.learn("d", tokens, start)
        learned.append((tokens, start))
    t.flush()
    for _ in range(200):
        ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        assert t.propose("d", ctx, 6) == reference(learned, ctx, 6, 2, 4), ctx
    t.close()


def test_tables_outlive_a_reopen(tmp_path: Path) -> None:
    t = _tables(tmp_path)
    _learn(t, "code", [5, 6, 7, 8, 9], 0, times=2)
    ngrams = t.ngrams
    t.close()
    again = _tables(tmp_path)
    assert again.ngrams == ngrams and again.propose("code", [5, 6], 3) == [7, 8, 9]
    again.close()


def test_pruning_keeps_the_cap_and_the_frequent_ngrams(tmp_path: Path) -> None:
    rng = random.Random(5)
    t = _tables(tmp_path, max_ngrams=300)
    frequent = [1000, 1001, 1002, 1003, 1004]
    for i in range(200):
        noise = [rng.randrange(100_000) for _ in range(20)]  # ~57 fresh n-grams each
        assert t.learn("d", noise, 0)
        if i % 4 == 0:
            assert t.learn("d", frequent, 0)
    t.flush()
    assert 0 < t.ngrams <= 300 and t.pruned > 0
    assert t.propose("d", [1000, 1001], 3) == [1002, 1003, 1004]
    t.close()


def test_bad_input_and_an_unusable_dir_turn_nothing_on(tmp_path: Path) -> None:
    t = _tables(tmp_path)
    assert not t.learn("", [1, 2, 3], 0) and not t.learn("a b", [1, 2, 3], 0)
    assert not t.learn("d", [1, 2, 3], 3)  # no output
    assert not t.learn("d", [1, -2, 3], 0) and not t.learn("d", [1, 2**32, 3], 0)
    assert t.propose("d", [1, 2**40], 3) == [] and t.propose("d", [1, 2], 0) == []
    t.close()
    assert valid_domain("code") and valid_domain("team-a.sql_2") and not valid_domain("x" * 65)
    (tmp_path / "file").write_text("")
    warned: list[str] = []
    off = DomainTables(str(tmp_path / "file"), 100, 2, 4, warn=warned.append)
    assert not off.enabled and "domain tables off" in warned[0]
    assert not off.learn("d", [1, 2, 3], 0) and off.propose("d", [1, 2], 2) == []
    off.close()
    assert not DomainTables(str(tmp_path / "zero"), 0, 2, 4).enabled  # cap 0: off
    assert not (tmp_path / "zero").exists()
