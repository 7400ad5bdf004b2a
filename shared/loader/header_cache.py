"""On-disk cache of parsed GGUF headers (metadata and tensor table).

`GGUFReader` takes seconds on a large vocabulary (~9 s for Gemma 3's 262k tokens), so the
parsed header is stored once as msgpack, keyed by the file's absolute path, size and mtime.
A stale or corrupt cache entry is ignored and rewritten, never trusted.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import msgspec

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    root = os.environ.get("SKIFF_CACHE_DIR") or os.path.join(Path.home(), ".cache", "skiff")
    return Path(root) / "gguf-headers"


def cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def load(cache_dir: Path, path: Path) -> dict[str, Any] | None:
    entry = cache_dir / f"{cache_key(path)}.msgpack"
    try:
        data = msgspec.msgpack.decode(entry.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return None
    return data


def store(cache_dir: Path, path: Path, header: dict[str, Any]) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        entry = cache_dir / f"{cache_key(path)}.msgpack"
        tmp = entry.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(msgspec.msgpack.encode({**header, "version": CACHE_VERSION}))
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only home is no reason to refuse to load the model
