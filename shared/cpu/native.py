"""The CPU's C library (qdot.c: quantized matmuls; ops.c: norms, activations, RoPE and the KV
write, attention; layers.c: a run of Llama-family layers in one call), compiled on first use
for this machine.

The sources are built with the system's C compiler (``cc -O3 -march=native -fopenmp``) into the
cache directory, named by a hash of the source, the compiler's version and the CPU's flags, so
a machine builds it once (under a second) and a changed CPU or source builds anew. torch is
imported first: its OpenMP runtime (``libgomp.so.1``) is then the one the library's threads
come from, so torch's ops and these matmuls share one pool and one thread count
(``torch.set_num_threads``). Without a compiler, ``load()`` returns None and the caller keeps
torch's own path."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch  # noqa: F401 - loads torch's libgomp before the library's

__all__ = ["compile_library", "load", "SOURCES"]

SOURCES = [Path(__file__).with_name(n) for n in ("qdot.c", "ops.c", "layers.c")]
HEADERS = [Path(__file__).with_name("half.h")]
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_NATIVE = "-march=native"  # this CPU's instructions (AVX2, F16C where it has them)
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.blake2b(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + version.encode()
        + _cpu_flags().encode()
        + " ".join([*_FLAGS, _NATIVE]).encode(),
        digest_size=8,
    ).hexdigest()
    root = os.environ.get("SKIFF_CACHE_DIR") or Path.home() / ".cache" / "skiff"
    out = Path(root) / "cpu" / f"qdot-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside its final name and renamed: processes building at once each rename a
    # whole file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        _compile(cc, Path(tmp), native=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _compile(cc: str, out: Path, native: bool) -> None:
    flags = [*_FLAGS, _NATIVE] if native else _FLAGS
    subprocess.run(
        [cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"],
        check=True,
        capture_output=True,
        text=True,
    )


def compile_library(out: Path, native: bool = True) -> ctypes.CDLL:
    """The library built at `out` and loaded; native False: for any CPU of the architecture
    (no AVX2, no F16C: the portable C paths, which the tests run too)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    _compile(cc, out, native)
    return _bind(ctypes.CDLL(str(out)))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.skiff_quantize_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P]
    lib.skiff_quantize_rows.restype = None
    lib.skiff_qmatmul.argtypes = [_I, _P, _L, _I, _I, _P, _P, _P, _I, _P, _L, _I]
    lib.skiff_qmatmul.restype = None
    lib.skiff_matmul.argtypes = [_I, _P, _L, _I, _I, _P, _I, _P, _L, _I]
    lib.skiff_matmul.restype = None
    _F = ctypes.c_float
    lib.skiff_add_rms_norm.argtypes = [_P, _P, _P, _F, _I, _I, _P, _P]
    lib.skiff_gated_act.argtypes = [_P, _P, _L, _I, _I, _I, _P]
    lib.skiff_rope_kv.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _F, _I, _P, _P, _P, _I]
    lib.skiff_attention.argtypes = [
        _P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _P,
    ]  # fmt: skip
    lib.skiff_llama_layers.argtypes = [_P, _I, _P, _P, _P, _I]
    for name in ("skiff_add_rms_norm", "skiff_gated_act", "skiff_rope_kv", "skiff_attention",
                 "skiff_llama_layers"):  # fmt: skip
        getattr(lib, name).restype = None
    lib.skiff_supported.argtypes = [_I]
    lib.skiff_supported.restype = _I
    lib.skiff_act_block.argtypes = [_I]
    lib.skiff_act_block.restype = _I
    lib.skiff_simd.argtypes = []
    lib.skiff_simd.restype = _I
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, built if needed; None (with a warning) where it cannot be built or
    loaded. ``SKIFF_CPU_NATIVE=0`` turns it off."""
    if os.environ.get("SKIFF_CPU_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        warnings.warn("no C compiler: the CPU's quantized matmuls use torch", stacklevel=2)
        return None
    try:
        return _bind(ctypes.CDLL(str(_build(cc))))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        warnings.warn(f"the CPU matmul library did not build: {detail[:300]}", stacklevel=2)
        return None
