"""What a benchmark sends and when: the prompts (random words, or a dataset file) and the
requests' arrival times."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

# Common English words, each one token with its leading space in the usual BPE and
# SentencePiece vocabularies, so N words make a prompt of about N tokens on any server.
_WORDS = (
    "the of and to in is it that for was on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know"
)


def random_prompts(n: int, words: int, seed: int) -> list[str]:
    """n prompts of `words` random common words each, different from their first words on (no
    prefix-cache hit between two of them)."""
    rng = random.Random(f"prompts-{seed}")
    vocabulary = _WORDS.split()
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(n)]


def load_dataset(path: str | Path, n: int) -> list[str]:
    """n prompts from a file, cycled when it holds fewer. The file is a JSON list or JSON lines;
    each item a string, an object with a "prompt" string, or a ShareGPT conversation (an object
    with "conversations": [{"from": "human", "value": ...}, ...], whose first human turn is the
    prompt). Items without a prompt are skipped; a file with none is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the dataset: {e}") from e
    items = _items(text, path)
    prompts = [p for p in map(_prompt_of, items) if p]
    if not prompts:
        raise ValueError(
            f"{path}: no prompt found in {len(items)} items (each should be a string, an "
            'object with a "prompt" string, or a ShareGPT "conversations" list)'
        )
    return [prompts[i % len(prompts)] for i in range(n)]


def _items(text: str, path: Path) -> list[Any]:
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
        if text.lstrip().startswith("["):
            raise ValueError(f"{path}: not valid JSON") from None
    if isinstance(whole, list):
        return whole
    if whole is not None:
        return [whole]  # a JSON lines file of one line
    items = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON line: {e.msg}") from None
    return items


def _prompt_of(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("prompt"), str):
        return item["prompt"]
    turns = item.get("conversations")
    if isinstance(turns, list):
        for turn in turns:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                value = turn.get("value")
                return value if isinstance(value, str) else None
    return None


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n requests is sent: a Poisson process of `rate`
    requests per second (exponential gaps of mean 1/rate), the first at 0; all at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times
