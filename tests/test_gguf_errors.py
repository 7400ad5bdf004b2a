"""Bad GGUF files raise GGUFError naming the file, the tensor (where there is one) and the problem;
the on-disk header cache is used on a second open and invalidated by rewriting the file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

import shared.loader.gguf_file as gguf_file
from shared.loader import GGUFError, GGUFFile
from shared.model import load_model
from shared.model.config import ModelConfig
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

TINY = SynthSpec(
    n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=256, vocab=300
)

# the tiny llama model written by write_tiny: d_model 64, 4 heads x 16, 2 KV heads, FFN 256
D, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, VOCAB, N_LAYERS = 64, 4, 2, 16, 256, 64, 2


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SKIFF_CACHE_DIR", str(cache))
    return cache


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The tensors of a tiny llama model, in file order."""
    rng = np.random.default_rng(seed)

    def mat(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    t = {"token_embd.weight": mat(VOCAB, D)}
    for i in range(N_LAYERS):
        p = f"blk.{i}"
        t[f"{p}.attn_norm.weight"] = norm(D)
        t[f"{p}.attn_q.weight"] = mat(q, D)
        t[f"{p}.attn_k.weight"] = mat(kv, D)
        t[f"{p}.attn_v.weight"] = mat(kv, D)
        t[f"{p}.attn_output.weight"] = mat(D, q)
        t[f"{p}.ffn_norm.weight"] = norm(D)
        t[f"{p}.ffn_gate.weight"] = mat(FFN, D)
        t[f"{p}.ffn_up.weight"] = mat(FFN, D)
        t[f"{p}.ffn_down.weight"] = mat(D, FFN)
    t["output_norm.weight"] = norm(D)
    t["output.weight"] = mat(VOCAB, D)
    return t


def write_tiny(
    path: Path,
    arch: str = "llama",
    tensors: dict[str, np.ndarray] | None = None,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """A tiny model (like tools/synthetic_gguf, without a tokenizer); `raw` adds tensors given as
    uint8 block bytes of a GGML type."""
    tensors = tiny_tensors() if tensors is None else tensors
    w = GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def raises_gguf(fn, *args) -> GGUFError:
    with pytest.raises(GGUFError) as info:
        fn(*args)
    return info.value


# -- files that are not (whole) GGUF files -------------------------------------------------------


def test_the_tiny_model_loads(tmp_path: Path) -> None:
    """The control for the tests below: unmodified, the tiny model loads."""
    model = load_model(GGUFFile(write_tiny(tmp_path / "ok.gguf")), "cpu")
    assert model.cfg.n_layers == N_LAYERS and model.cfg.vocab_size == VOCAB


def test_text_file_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("this is a text file, not a model\n")
    err = raises_gguf(GGUFFile, path)
    assert str(path) in str(err)
    assert "not a GGUF file" in str(err)
    assert err.path == str(path) and err.tensor is None


def test_empty_file_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    err = raises_gguf(GGUFFile, path)
    assert str(err).startswith(f"{path}: ")
    assert "not a GGUF file" in str(err)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.gguf"
    err = raises_gguf(GGUFFile, path)
    assert str(path) in str(err)
    assert "cannot read the file" in str(err)


def test_gguf_magic_then_garbage(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    err = raises_gguf(GGUFFile, path)
    assert str(path) in str(err)
    assert "cannot parse the GGUF header" in str(err)


def test_truncated_header(tmp_path: Path) -> None:
    full = write_synthetic_gguf(tmp_path / "full.gguf", TINY)
    path = tmp_path / "cut.gguf"
    path.write_bytes(full.read_bytes()[:100])
    err = raises_gguf(GGUFFile, path)
    assert str(err).startswith(f"{path}: ")
    assert "cannot parse the GGUF header" in str(err)


def _last_tensor(path: Path) -> tuple[str, int]:
    """Name and end offset of the tensor whose data ends last in the file."""
    t = max(GGUFReader(path).tensors, key=lambda t: t.data_offset + t.n_bytes)
    return t.name, int(t.data_offset + t.n_bytes)


@pytest.mark.parametrize("cut", [1, 5000])
def test_truncated_data_names_the_tensor(tmp_path: Path, cut: int) -> None:
    full = write_synthetic_gguf(tmp_path / "full.gguf", TINY)
    data = full.read_bytes()
    last, end = _last_tensor(full)
    assert end == len(data)  # the cut below lands inside `last`'s data, not in padding
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-cut])
    err = raises_gguf(GGUFFile, path)
    assert str(path) in str(err)
    assert f"tensor '{last}'" in str(err), str(err)
    assert "truncated" in str(err)
    assert err.tensor == last


# -- files that do not fit the model they claim to be --------------------------------------------


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny(tmp_path / "mamba.gguf", arch="mamba")
    f = GGUFFile(path)  # the file itself is fine
    assert f.architecture == "mamba"
    for fn in (ModelConfig.from_gguf, load_model):
        err = raises_gguf(fn, f)
        assert str(err).startswith(f"{path}: ")
        assert "unsupported architecture 'mamba'" in str(err)
        assert "llama" in str(err)  # lists what is supported


def test_missing_architecture(tmp_path: Path) -> None:
    path = write_tiny(tmp_path / "noarch.gguf")
    f = GGUFFile(path)
    del f.metadata["general.architecture"]
    err = raises_gguf(load_model, f)
    assert str(path) in str(err) and "general.architecture" in str(err)


def test_missing_metadata_key(tmp_path: Path) -> None:
    path = write_tiny(tmp_path / "nokey.gguf")
    f = GGUFFile(path)
    del f.metadata["llama.block_count"]
    err = raises_gguf(load_model, f)
    assert str(path) in str(err) and "'llama.block_count' is missing" in str(err)


def test_shape_mismatch(tmp_path: Path) -> None:
    tensors = tiny_tensors()
    kv = N_KV_HEADS * HEAD_DIM
    tensors["blk.0.attn_k.weight"] = np.zeros((kv + 16, D), np.float32)
    path = write_tiny(tmp_path / "shape.gguf", tensors=tensors)
    err = raises_gguf(load_model, GGUFFile(path), "cpu")
    assert str(err).startswith(f"{path}: tensor 'blk.0.attn_k.weight': ")
    assert err.tensor == "blk.0.attn_k.weight"
    assert f"shape [{kv + 16}, {D}]" in str(err)
    assert f"expected [{kv}, {D}]" in str(err)


def test_shape_mismatch_of_a_vector(tmp_path: Path) -> None:
    tensors = tiny_tensors()
    tensors["blk.1.ffn_norm.weight"] = np.ones(D * 2, np.float32)
    path = write_tiny(tmp_path / "vec.gguf", tensors=tensors)
    err = raises_gguf(load_model, GGUFFile(path), "cpu")
    assert err.tensor == "blk.1.ffn_norm.weight"
    assert f"shape [{2 * D}] does not match the expected [{D}]" in str(err)


def test_missing_tensor(tmp_path: Path) -> None:
    tensors = tiny_tensors()
    del tensors["blk.1.ffn_up.weight"]
    path = write_tiny(tmp_path / "missing.gguf", tensors=tensors)
    err = raises_gguf(load_model, GGUFFile(path), "cpu")
    assert str(err) == f"{path}: tensor 'blk.1.ffn_up.weight': tensor is missing"


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    tensors = tiny_tensors()
    del tensors["blk.0.ffn_down.weight"]  # [D, FFN]: rows of 256 = one IQ2_XXS block
    blocks = np.random.default_rng(1).integers(0, 256, (D, 66), dtype=np.uint8)
    raw = {"blk.0.ffn_down.weight": (blocks, GGMLQuantizationType.IQ2_XXS)}
    path = write_tiny(tmp_path / "iq2.gguf", tensors=tensors, raw=raw)
    f = GGUFFile(path)
    info = f.info("blk.0.ffn_down.weight")
    assert info.shape == (D, FFN) and info.type_name == "IQ2_XXS"
    err = raises_gguf(load_model, f, "cpu")
    assert str(err).startswith(f"{path}: tensor 'blk.0.ffn_down.weight': ")
    assert "IQ2_XXS" in str(err) and "not supported" in str(err)


def test_row_not_a_whole_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row length that is no multiple of the type's block is named at open time."""
    tensors = tiny_tensors()
    del tensors["blk.0.attn_q.weight"]
    blocks = np.zeros((N_HEADS * HEAD_DIM, 2 * 34), np.uint8)  # two Q8_0 blocks per row
    path = write_tiny(
        tmp_path / "q8.gguf",
        tensors=tensors,
        raw={"blk.0.attn_q.weight": (blocks, GGMLQuantizationType.Q8_0)},
    )
    # GGUFWriter refuses to write such a tensor, so change the row length (64 -> 48, not a
    # multiple of Q8_0's 32) in the parsed tensor table
    header = gguf_file._parse_header(path)
    (entry,) = [t for t in header["tensors"] if t[0] == "blk.0.attn_q.weight"]
    assert entry[2] == [N_HEADS * HEAD_DIM, D]
    entry[2][-1] = 48
    monkeypatch.setattr(gguf_file, "_parse_header", lambda p: header)
    err = raises_gguf(GGUFFile, path)
    assert str(err).startswith(f"{path}: tensor 'blk.0.attn_q.weight': ")
    assert "row length 48 is not a multiple of the 32-element block of Q8_0" in str(err)


# -- the header cache ----------------------------------------------------------------------------


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "gguf-headers").glob("*.msgpack"))


def test_header_cache_is_used_and_invalidated(
    tmp_path: Path, _private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY)
    assert _entries(_private_cache) == []
    parses = []
    real_parse = gguf_file._parse_header

    def counting_parse(p: Path):
        parses.append(p)
        return real_parse(p)

    monkeypatch.setattr(gguf_file, "_parse_header", counting_parse)

    first = GGUFFile(path)
    assert len(parses) == 1
    assert len(_entries(_private_cache)) == 1

    second = GGUFFile(path)
    assert len(parses) == 1, "the second open parsed the header again"
    assert second.metadata == first.metadata
    assert second.tensors == first.tensors
    assert second.architecture == "llama"
    assert second.metadata["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    np.testing.assert_array_equal(
        second.raw("blk.1.attn_v.weight"), first.raw("blk.1.attn_v.weight")
    )

    # a rewrite (another vocabulary: other metadata, other size) must not be served stale
    bigger = SynthSpec(**{**TINY.__dict__, "vocab": 320, "seed": 1})
    write_synthetic_gguf(path, bigger)
    third = GGUFFile(path)
    assert len(parses) == 2
    assert len(third.metadata["tokenizer.ggml.tokens"]) == 320
    assert third.tensors["token_embd.weight"].shape == (320, TINY.d_model)
    assert len(_entries(_private_cache)) == 2


def test_header_cache_same_size_rewrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same size, new weights and a new mtime: reparsed (the cache key includes the mtime)."""
    cache = tmp_path / "explicit-cache"
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY)
    parses = []
    real_parse = gguf_file._parse_header
    monkeypatch.setattr(gguf_file, "_parse_header", lambda p: parses.append(p) or real_parse(p))

    first = GGUFFile(path, cache_dir=cache)
    assert len(list(cache.glob("*.msgpack"))) == 1
    GGUFFile(path, cache_dir=cache)
    assert len(parses) == 1
    old = first.raw("output.weight").copy()

    st = path.stat()
    write_synthetic_gguf(path, SynthSpec(**{**TINY.__dict__, "seed": 7}))
    # make the new mtime distinct even on a coarse-timestamp file system
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert path.stat().st_size == st.st_size
    second = GGUFFile(path, cache_dir=cache)
    assert len(parses) == 2
    assert second.tensors == first.tensors  # the same layout ...
    assert not np.array_equal(second.raw("output.weight"), old)  # ... with new weights
    assert GGUFFile(path, cache_dir=cache).metadata == second.metadata
    assert len(parses) == 2  # the new entry is used


def test_corrupt_cache_entry_is_ignored(tmp_path: Path, _private_cache: Path) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY)
    first = GGUFFile(path)
    (entry,) = _entries(_private_cache)
    entry.write_bytes(b"\x00not msgpack at all")
    second = GGUFFile(path)
    assert second.metadata == first.metadata and second.tensors == first.tensors
    assert entry.read_bytes() != b"\x00not msgpack at all"  # rewritten
