"""`skiff spec learn`: a directory of Python files counted into a domain's table with SmolLM2's
tokenizer drafts the files' continuations, another domain's entries are left byte for byte,
binary and out-of-tree files are skipped and counted, and bad arguments exit 2 with one line.
CPU only, the GGUF header only: a few seconds."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import lmdb
import pytest

from services.spec.config import NGRAM_MAX, NGRAM_MIN, TABLE_MAX_NGRAMS
from services.spec.domain_table import DomainTables
from services.spec.learn import LearnConfig, source_files
from shared.cli import main
from shared.loader import GGUFFile
from shared.tokenizer import load_tokenizer

FUNCTION = """
def handler_{i}(request):
    payload = request.json()
    if not payload.get("user_id"):
        raise ValueError("missing user_id in payload")
    record = store.load(payload["user_id"])
    return store.save(record, payload)
"""
HEADER = '''"""Request handlers backed by the record store."""

import json
import logging

import store
from store import Record, Schema
'''


def _file_text(n: int) -> str:
    return HEADER + "".join(FUNCTION.format(i=10 * n + i) for i in range(3))


def _entries(table_dir: Path, domain: str) -> dict[bytes, bytes]:
    prefix = domain.encode() + b"\0"
    env = lmdb.open(str(table_dir / "ngrams.lmdb"), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {k: v for k, v in txn.cursor() if k.startswith(prefix)}
    finally:
        env.close()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    return load_tokenizer(GGUFFile(smollm2_path).metadata)


@pytest.fixture(scope="module")
def learned(tmp_path_factory, smollm2_path: Path):
    """A tree of three Python files and a binary one, learned as "code" into a table that
    already holds a "prose" domain."""
    root = tmp_path_factory.mktemp("learn")
    src, table_dir = root / "src", root / "tables"
    (src / "pkg").mkdir(parents=True)
    for n, path in enumerate([src / "a.py", src / "b.py", src / "pkg" / "c.py"]):
        path.write_text(_file_text(n))
    (src / "blob.py").write_bytes(b"\x7fELF\x00\x01" + bytes(range(256)))
    prose = DomainTables(str(table_dir), TABLE_MAX_NGRAMS, NGRAM_MIN, NGRAM_MAX)
    for _ in range(2):
        assert prose.learn("prose", [5, 6, 7, 8, 9, 10], 0)
    prose.close()
    before = _entries(table_dir, "prose")
    argv = ["spec", "learn", str(src), "--domain", "code", "--model", str(smollm2_path)]
    rc = main([*argv, "--table-dir", str(table_dir)])
    return rc, table_dir, before


# the prefix: the file's first NGRAM_MIN tokens (its first n-gram: counted only when the whole
# file is, from token 0), or the text up to a point in the first function's body
@pytest.mark.parametrize("cut_after", [None, "payload = request.json()"])
def test_learned_files_draft_their_continuation(learned, tokenizer, cut_after) -> None:
    rc, table_dir, _ = learned
    assert rc == 0
    text = _file_text(0)
    ids = tokenizer.encode(text, add_special=False)
    if cut_after is None:
        prefix = ids[:NGRAM_MIN]
    else:
        cut = text.index(cut_after) + len(cut_after)
        prefix = tokenizer.encode(text[:cut], add_special=False)
        assert ids[: len(prefix)] == prefix  # the cut falls on a token boundary
    expected = ids[len(prefix) : len(prefix) + 12]
    tables = DomainTables(str(table_dir), TABLE_MAX_NGRAMS, NGRAM_MIN, NGRAM_MAX)
    try:
        assert tables.propose("code", prefix, 12) == expected
        assert text.startswith(tokenizer.decode(prefix + expected))
        assert tables.propose("sql", prefix, 12) == []
    finally:
        tables.close()


def test_another_domain_is_untouched(learned) -> None:
    _, table_dir, before = learned
    assert len(before) == 6  # n 3..8 over 6 tokens: 3 + 2 + 1 n-grams with a next token
    assert _entries(table_dir, "prose") == before
    assert len(_entries(table_dir, "code")) > 100


def test_summary_counts_files_skips_and_tokens(tmp_path, smollm2_path, tokenizer, capsys):
    tree, table_dir = tmp_path / "tree", tmp_path / "tables"
    tree.mkdir()
    (tree / "one.py").write_text(_file_text(0))
    (tree / "two.py").write_text(_file_text(1))
    (tree / "blob.py").write_bytes(b"\x00\x01\x02binary")
    (tree / "latin.py").write_bytes("caf\xe9\n".encode("latin-1"))
    (tree / "empty.py").write_text("\n\n")
    (tree / "big.py").write_text("x = 1\n" * 200)
    (tmp_path / "outside.py").write_text(_file_text(2))
    (tree / "link.py").symlink_to(tmp_path / "outside.py")
    (tree / "again.py").symlink_to(tree / "one.py")  # inside the tree: read once, as one.py
    argv = ["spec", "learn", str(tree), "--domain", "code", "--model", str(smollm2_path)]
    rc = main([*argv, "--table-dir", str(table_dir), "--max-bytes", "1000"])
    out = capsys.readouterr().out
    tokens = sum(len(tokenizer.encode(_file_text(n), add_special=False)) for n in (0, 1))
    assert rc == 0
    assert "files read: 2\n" in out
    skipped = "binary 1, duplicate 1, empty 1, not UTF-8 1, symlink out of tree 1, too large 1"
    assert f"files skipped: 6 ({skipped})\n" in out
    assert f"tokens counted: {tokens}\n" in out
    assert f"table entries after: {len(_entries(table_dir, 'code'))} " in out


def test_walk_filters_extensions_hidden_dirs_and_repeats(tmp_path) -> None:
    for rel in ["a.py", "b.js", "c.txt", "sub/d.PY", ".git/e.py"]:
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("x\n")
    skipped: Counter[str] = Counter()
    paths = (tmp_path, tmp_path / "a.py")
    files = list(source_files(paths, frozenset({".py", ".js"}), skipped))
    assert files == [tmp_path / "a.py", tmp_path / "b.js", tmp_path / "sub" / "d.PY"]
    assert skipped == {"extension": 1, "duplicate": 1}


def test_table_dir_defaults_to_the_spec_services(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SKIFF_CACHE_DIR", str(tmp_path))
    ns = argparse.Namespace(
        paths=["."], domain="code", model="m.gguf", table_dir=None, ext=[".py,js", ".c"]
    )
    ns.table_max_ngrams, ns.max_files, ns.max_bytes = TABLE_MAX_NGRAMS, 0, 1000
    cfg = LearnConfig.from_args(ns)
    assert cfg.table_dir == str(tmp_path / "spec")
    assert cfg.exts == {".py", ".js", ".c"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--domain": "no spaces"}, "invalid domain 'no spaces'"),
        ({"--domain": "../up"}, "invalid domain '../up'"),
        ({"path": "missing-dir"}, "no such file or directory: "),
        ({"--model": "missing.gguf"}, "model not found: "),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, smollm2_path, capsys, change, message):
    args = {"path": str(tmp_path), "--domain": "code", "--model": str(smollm2_path)}
    args.update({k: str(tmp_path / v) if k != "--domain" else v for k, v in change.items()})
    argv = ["spec", "learn", args["path"], "--domain", args["--domain"]]
    rc = main([*argv, "--model", args["--model"], "--table-dir", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("skiff spec learn: error: ")
    assert message in err
    assert not (tmp_path / "t").exists()  # nothing opened before the arguments were checked


def test_a_file_that_is_not_gguf_exits_2(tmp_path, capsys) -> None:
    (tmp_path / "model.gguf").write_text("not a model")
    argv = ["spec", "learn", str(tmp_path), "--domain", "code"]
    rc = main([*argv, "--model", str(tmp_path / "model.gguf"), "--table-dir", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "cannot read the model's tokenizer: " in err and "not a GGUF file" in err
