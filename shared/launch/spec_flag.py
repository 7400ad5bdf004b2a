"""`skiff serve --spec`: its values and the spec service's command line.

- `ngram` (the default): the n-gram proposers (prompt lookup, the domain tables);
- `draft:PATH`: those, and a draft model (a GGUF with the served model's vocabulary) where they
  find nothing; the spec service gets `--draft PATH --target MODEL` (and the workers a longer
  wait for proposals, `--spec-wait-ms`), and checks the vocabularies
  itself, and `skiff serve` checks them before it starts anything (`check_draft`), so a wrong
  file fails once, with the reason, not in a service restarted again and again;
- `off`: no spec service, no drafts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DRAFT = "draft:"
# With a draft model a step waits this long at most for its guesses (the n-gram proposers'
# 2 ms grace finds them late every time): 8 guesses of a 20-layer SmolLM2 draft take ~200 ms
# on two cores (~25 ms a forward); well under the worker's 1 s before it calls a service gone
DRAFT_WAIT_MS = 300
HELP = (
    "speculative decoding, verified in the decode steps of CPU workers: ngram (default: drafts "
    "from the spec service's n-gram proposers, prompt lookup), draft:PATH (those, then a draft "
    "model, a GGUF with the served model's vocabulary, where they find nothing), or off"
)


def parse_spec(value: str) -> str:
    """argparse's type for --spec: ngram, off, or draft: and the draft's absolute path."""
    if value in ("ngram", "off"):
        return value
    if value.startswith(DRAFT) and value[len(DRAFT) :]:
        path = Path(value[len(DRAFT) :]).expanduser().resolve()
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"the draft model {path} is not a file")
        return f"{DRAFT}{path}"
    raise argparse.ArgumentTypeError(f"{value!r}: ngram, draft:PATH or off")


def draft_path(spec: str) -> str:
    """The draft model's path of a --spec value ("": none)."""
    return spec[len(DRAFT) :] if spec.startswith(DRAFT) else ""


def spec_service_argv(python: str, endpoint: str, spec: str, model: str) -> list[str]:
    argv = [python, "-m", "services.spec", "--endpoint", endpoint]
    if draft := draft_path(spec):
        argv += ["--draft", draft, "--target", model]
    return argv


def worker_args(spec: str) -> list[str]:
    """A speculating worker's flags for this --spec value (beyond the endpoint's)."""
    return ["--spec-wait-ms", str(DRAFT_WAIT_MS)] if draft_path(spec) else []


def check_draft(spec: str, model: str) -> str | None:
    """Why the draft of a --spec value cannot serve `model` (None: it can, or no draft)."""
    if not (draft := draft_path(spec)):
        return None
    from services.spec.vocab_check import check_vocab  # the GGUF reader: with a draft only

    try:
        check_vocab(draft, model)
    except (ValueError, OSError) as e:  # a vocabulary mismatch, a bad or missing GGUF
        return str(e)
    return None
