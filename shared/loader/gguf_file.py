"""A GGUF file opened for loading: metadata, tensor table and raw tensor bytes.

The header is parsed with the `gguf` package (and cached on disk, see header_cache); tensor data
is read through a read-only memory map so weights reach the device in their GGUF block format.
Every problem with the file raises GGUFError naming the file, the tensor and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from shared.loader import header_cache
from shared.loader.errors import GGUFError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int
    shape: tuple[int, ...]  # numpy order: the last dimension is contiguous (GGUF's ne reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"


def expected_nbytes(qtype: int, shape: tuple[int, ...], path: str, name: str) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise GGUFError(path, f"unknown tensor type id {qtype}", name) from None
    if shape and shape[-1] % block:
        raise GGUFError(
            path,
            f"row length {shape[-1]} is not a multiple of the {block}-element block "
            f"of {GGMLQuantizationType(qtype).name}",
            name,
        )
    return int(np.prod(shape, dtype=np.int64)) // block * type_size


class _HeaderReader(GGUFReader):
    """GGUFReader that records the tensor table without mapping any tensor data, so a truncated
    file reaches GGUFFile's per-tensor bounds check instead of failing inside numpy."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        self.tensor_table: list[list] = []
        seen: set[str] = set()
        for field in fields:
            _len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8")
            if name in seen:
                raise ValueError(f"duplicated tensor name '{name}'")
            seen.add(name)
            shape = [int(d) for d in reversed(dims.tolist())]
            self.tensor_table.append([name, int(raw_dtype[0]), shape, start_offs + int(offset[0])])


def _parse_header(path: Path) -> dict[str, Any]:
    try:
        reader = _HeaderReader(path)
    except Exception as exc:  # the gguf package raises bare ValueError/IndexError on bad input
        raise GGUFError(str(path), f"cannot parse the GGUF header: {exc}") from exc
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        metadata[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return {"metadata": metadata, "tensors": reader.tensor_table}


class GGUFFile:
    """Metadata and tensors of one GGUF file; cheap to open twice thanks to the header cache."""

    def __init__(self, path: str | Path, cache_dir: Path | None = None) -> None:
        self.path = Path(path)
        spath = str(self.path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise GGUFError(spath, f"cannot read the file: {exc.strerror}") from exc
        if magic != GGUF_MAGIC:
            raise GGUFError(spath, f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cache_dir = cache_dir or header_cache.default_cache_dir()
        header = header_cache.load(cache_dir, self.path)
        if header is None:
            header = _parse_header(self.path)
            header_cache.store(cache_dir, self.path, header)
        self.metadata: dict[str, Any] = header["metadata"]
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, shape, offset in header["tensors"]:
            shape = tuple(shape)
            nbytes = expected_nbytes(qtype, shape, spath, name)
            if offset + nbytes > size:
                raise GGUFError(
                    spath,
                    f"truncated file: the data ends at byte {offset + nbytes} "
                    f"but the file has {size} bytes",
                    name,
                )
            self.tensors[name] = TensorInfo(name, qtype, shape, offset, nbytes)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(str(self.path), "metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(str(self.path), f"metadata key '{key}' is missing")
        return self.metadata[key]

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(str(self.path), "tensor is missing", name)
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the file."""
        t = self.info(name)
        return self._map[t.offset : t.offset + t.nbytes]
