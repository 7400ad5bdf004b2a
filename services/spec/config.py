"""SpecConfig: the spec process's one typed config, built once from its flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

# Defaults: n-gram sizes 3..8 (prompt_lookup.py says why), and a bound on what the service
# holds. Prompt lookup's index costs ~0.7 KB a token (n 3..8), so 2M tokens are ~1.4 GB.
NGRAM_MIN, NGRAM_MAX = 3, 8
MAX_SEQS = 4096
MAX_TOKENS = 2_000_000
MAX_DRAFT = 64  # the longest draft answered, whatever k a worker asks (a reply stays small)
TABLE_MAX_NGRAMS = 1_000_000  # the domain tables' entries, all domains (~100 MB on disk)


@dataclass(frozen=True)
class SpecConfig:
    endpoint: str
    max_seqs: int = MAX_SEQS  # live sequences held (all workers): the least recently asked go
    max_tokens: int = MAX_TOKENS  # tokens held in all (so memory is bounded too)
    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX
    max_draft: int = MAX_DRAFT
    table_dir: str = ""  # the domain tables' LMDB dir
    table_max_ngrams: int = TABLE_MAX_NGRAMS  # 0: no domain tables
    metrics_port: int = 0  # 0: no Prometheus endpoint
    summary_interval_s: float = 30.0
    draft: str = ""  # a draft model's GGUF ("": no draft-model proposer)
    draft_device: str = "cpu"  # cpu or cuda:N
    draft_threads: int = 0  # its CPU threads (0: torch's default)
    draft_kv_blocks: int = 0  # its KV pool's blocks of 16 tokens (0: 256 MiB of them)
    target: str = ""  # the served model's GGUF, whose vocabulary the draft must have


def default_table_dir() -> str:
    root = os.environ.get("SKIFF_CACHE_DIR") or str(Path.home() / ".cache" / "skiff")
    return os.path.join(root, "spec")


def parse_spec_args(argv: list[str] | None, description: str | None = None) -> SpecConfig:
    p = argparse.ArgumentParser(prog="python -m services.spec", description=description)
    p.add_argument("--endpoint", required=True, help="ROUTER address, e.g. tcp://127.0.0.1:5598")
    p.add_argument(
        "--max-seqs", type=int, default=MAX_SEQS, help="live sequences held (LRU over all workers)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="tokens held in all (LRU as well)"
    )
    p.add_argument("--ngram-min", type=int, default=NGRAM_MIN, help="shortest n-gram matched")
    p.add_argument("--ngram-max", type=int, default=NGRAM_MAX, help="longest n-gram matched")
    p.add_argument("--table-dir", default=None, help="domain tables' dir ($SKIFF_CACHE_DIR/spec)")
    p.add_argument(
        "--table-max-ngrams",
        type=int,
        default=TABLE_MAX_NGRAMS,
        help="domain tables' entries, all domains; 0 turns them off",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port on 127.0.0.1")
    p.add_argument("--draft", default="", help="a draft model's GGUF (the target's vocabulary)")
    p.add_argument("--draft-device", default="cpu", help="the draft model's device: cpu, cuda:N")
    p.add_argument(
        "--draft-threads", type=int, default=0, help="its CPU threads (0: torch's default)"
    )
    p.add_argument(
        "--draft-kv-blocks",
        type=int,
        default=0,
        help="its KV pool, in blocks of 16 tokens (0: 256 MiB); the least recently asked "
        "sequences' K/V go when it is full",
    )
    p.add_argument(
        "--target",
        default="",
        help="the served model's GGUF: the draft's vocabulary is checked against it at start",
    )
    a = p.parse_args(argv)
    if a.draft_device != "cpu" and not a.draft_device.startswith("cuda"):
        p.error(f"--draft-device: cpu or cuda:N, not {a.draft_device!r}")
    if a.draft_threads < 0 or a.draft_kv_blocks < 0:
        p.error("--draft-threads and --draft-kv-blocks must be >= 0")
    if a.max_seqs < 1 or a.max_tokens < 1:
        p.error("--max-seqs and --max-tokens must be at least 1")
    if a.table_max_ngrams < 0:
        p.error("--table-max-ngrams must be >= 0")
    if not 1 <= a.ngram_min <= a.ngram_max:
        p.error(f"need 1 <= --ngram-min <= --ngram-max, got {a.ngram_min} and {a.ngram_max}")
    return SpecConfig(
        endpoint=a.endpoint,
        max_seqs=a.max_seqs,
        max_tokens=a.max_tokens,
        ngram_min=a.ngram_min,
        ngram_max=a.ngram_max,
        table_dir=os.path.expanduser(a.table_dir or default_table_dir()),
        table_max_ngrams=a.table_max_ngrams,
        metrics_port=a.metrics_port,
        draft=os.path.expanduser(a.draft) if a.draft else "",
        draft_device=a.draft_device,
        draft_threads=a.draft_threads,
        draft_kv_blocks=a.draft_kv_blocks,
        target=os.path.expanduser(a.target) if a.target else "",
    )
