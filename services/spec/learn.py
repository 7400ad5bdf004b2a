"""`skiff spec learn PATH... --domain NAME --model M.gguf`: teach a domain's persistent n-gram
table (domain_table.py) the text files under the paths before serving, so its first requests
get drafts from the user's own code instead of an empty table.

- Each file is tokenized whole by the model's own tokenizer (the tables hold token ids; only
  the GGUF header is read, as the gateway does) and counted by `DomainTables.learn` with its
  output starting at 0: the n-grams of the whole file, counted as a served output's are.
- A directory is walked in name order; hidden directories (.git, .venv) are not entered and
  symlinked directories not followed. A symlinked file is read only when it resolves inside the
  walked tree, and every file only once. A binary (a NUL byte), non-UTF-8, over-size, empty or
  special file is skipped and counted by reason; `--ext` filters the walked files (a file named
  on the command line is taken as it is).
- The table dir defaults to the spec service's ($SKIFF_CACHE_DIR/spec), so a following
  `skiff serve` drafts from what was learned. The writer thread's queue is flushed every
  `_BATCH` files (a full queue would drop a file) and at the end, before the env is closed.
- A bad path, domain, model or table dir exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.spec.config import NGRAM_MAX, NGRAM_MIN, TABLE_MAX_NGRAMS, default_table_dir
from services.spec.domain_table import DomainTables, valid_domain

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

MAX_FILE_BYTES = 1 << 20  # a larger file is more likely data or generated code than source
_BATCH = 64  # files queued to the writer between flushes (below its queue's bound)


class LearnError(Exception):
    """A problem with the command's arguments: one line for the user, exit 2."""


class SkipFile(Exception):
    """A file that is not learned; the message is the reason it is counted under."""


@dataclass(frozen=True)
class LearnConfig:
    paths: tuple[Path, ...]
    domain: str
    model: str
    table_dir: str
    table_max_ngrams: int = TABLE_MAX_NGRAMS
    exts: frozenset[str] = frozenset()  # walked files' extensions ("": all)
    max_files: int = 0  # 0: no limit
    max_bytes: int = MAX_FILE_BYTES

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> LearnConfig:
        exts = (e.strip().lower() for v in a.ext for e in v.split(","))
        return cls(
            paths=tuple(Path(p) for p in a.paths),
            domain=a.domain,
            model=a.model,
            table_dir=os.path.expanduser(a.table_dir or default_table_dir()),
            table_max_ngrams=a.table_max_ngrams,
            exts=frozenset(e if e.startswith(".") else "." + e for e in exts if e),
            max_files=a.max_files,
            max_bytes=a.max_bytes,
        )


@dataclass
class LearnReport:
    files: int = 0  # files counted
    tokens: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> files


def add_learn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="directories and files to learn")
    p.add_argument("--domain", required=True, help="the table's name, e.g. code")
    p.add_argument("--model", required=True, help="the GGUF file that will be served")
    p.add_argument("--table-dir", default=None, help="the tables' dir ($SKIFF_CACHE_DIR/spec)")
    p.add_argument(
        "--table-max-ngrams",
        type=int,
        default=TABLE_MAX_NGRAMS,
        help="entries kept, all domains (as the spec service's flag)",
    )
    p.add_argument(
        "--ext", action="append", default=[], help="walked files' extensions, e.g. .py,.js"
    )
    p.add_argument("--max-files", type=int, default=0, help="stop after N files (0: no limit)")
    p.add_argument("--max-bytes", type=int, default=MAX_FILE_BYTES, help="skip larger files")


def source_files(
    paths: tuple[Path, ...], exts: frozenset[str], skipped: Counter[str]
) -> Iterator[Path]:
    """Each file to read, resolved, once; what the walk passes over is counted in `skipped`."""
    seen: set[Path] = set()
    for path in paths:
        if not path.is_dir():
            yield from _once(path.resolve(), seen, skipped)
            continue
        root = path.resolve()
        for top, dirs, names in os.walk(root):  # followlinks=False: symlinked dirs stay shut
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                f = Path(top, name)
                if exts and f.suffix.lower() not in exts:
                    skipped["extension"] += 1
                    continue
                real = f.resolve()
                if f.is_symlink() and not real.is_relative_to(root):
                    skipped["symlink out of tree"] += 1
                    continue
                yield from _once(real, seen, skipped)


def _once(path: Path, seen: set[Path], skipped: Counter[str]) -> Iterator[Path]:
    if path in seen:
        skipped["duplicate"] += 1
    else:
        seen.add(path)
        yield path


def read_text(path: Path, max_bytes: int) -> str:
    """The file's text; SkipFile when it is not a small UTF-8 text file."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise SkipFile("not a regular file")  # a FIFO would block the read
        if st.st_size > max_bytes:
            raise SkipFile("too large")
        data = path.read_bytes()
    except OSError as e:
        raise SkipFile("unreadable") from e
    if b"\0" in data:
        raise SkipFile("binary")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SkipFile("not UTF-8") from e
    if not text.strip():
        raise SkipFile("empty")
    return text


def learn_files(cfg: LearnConfig, tokenizer: Tokenizer, tables: DomainTables) -> LearnReport:
    """Count every readable file under `cfg.paths` into `tables` for `cfg.domain`."""
    report = LearnReport()
    queued = 0
    for path in source_files(cfg.paths, cfg.exts, report.skipped):
        if cfg.max_files and report.files >= cfg.max_files:
            break
        try:
            text = read_text(path, cfg.max_bytes)
        except SkipFile as e:
            report.skipped[str(e)] += 1
            continue
        ids = tokenizer.encode(text, add_special=False, special=False)
        # output_start 0: every n-gram of the file counts, as a served output's do
        if not tables.learn(cfg.domain, ids, 0):
            report.skipped["not counted"] += 1
            continue
        report.files += 1
        report.tokens += len(ids)
        queued += 1
        if queued == _BATCH:  # the writer's queue drops a sequence when full: wait for it
            tables.flush()
            queued = 0
    tables.flush()
    return report


def _check(cfg: LearnConfig) -> None:
    if not valid_domain(cfg.domain):
        raise LearnError(
            f"invalid domain {cfg.domain!r}: letters, digits, '.', '_', '-' (at most 64), "
            "starting with a letter or digit"
        )
    for p in cfg.paths:
        if not p.exists():
            raise LearnError(f"no such file or directory: {p}")
    if not os.path.isfile(cfg.model):
        raise LearnError(f"model not found: {cfg.model}")
    if cfg.table_max_ngrams < 1:
        raise LearnError("--table-max-ngrams must be at least 1")
    if cfg.max_files < 0 or cfg.max_bytes < 1:
        raise LearnError("--max-files must be >= 0 and --max-bytes >= 1")


def _load_tokenizer(model: str) -> Tokenizer:
    # the header only (cached), as the gateway reads it: no weights, no torch
    from shared.loader import GGUFError, GGUFFile
    from shared.tokenizer import load_tokenizer

    try:
        return load_tokenizer(GGUFFile(model).metadata)
    except (GGUFError, NotImplementedError) as e:
        raise LearnError(f"cannot read the model's tokenizer: {e}") from e


def run_learn(args: argparse.Namespace) -> int:
    """The command: learn, then print a summary; 2 on a bad argument, 1 on a write error."""
    cfg = LearnConfig.from_args(args)
    warnings: list[str] = []
    try:
        _check(cfg)
        tokenizer = _load_tokenizer(cfg.model)
        tables = DomainTables(
            cfg.table_dir, cfg.table_max_ngrams, NGRAM_MIN, NGRAM_MAX, warn=warnings.append
        )
        if not tables.enabled:
            raise LearnError(warnings[0])
    except LearnError as e:
        print(f"skiff spec learn: error: {e}", file=sys.stderr)
        return 2
    try:
        report = learn_files(cfg, tokenizer, tables)
        entries, pruned, errors = tables.ngrams, tables.pruned, tables.write_errors
    finally:
        tables.close()
    skipped = ", ".join(f"{why} {n}" for why, n in sorted(report.skipped.items()))
    print(f"learned domain {cfg.domain!r} into {os.path.join(cfg.table_dir, 'ngrams.lmdb')}")
    print(f"files read: {report.files}")
    print(f"files skipped: {report.skipped.total()}" + (f" ({skipped})" if skipped else ""))
    print(f"tokens counted: {report.tokens}")
    print(f"table entries after: {entries} (all domains; {pruned} pruned over the cap)")
    for w in warnings:
        print(f"skiff spec learn: {w}", file=sys.stderr)
    return 1 if errors else 0
