"""Writes a GGUF file holding a model's first N decoder layers: a draft model with the target's
vocabulary (issue 43), for tests and measurements, since no two shipped models share one.

The metadata is copied with `{arch}.block_count` set to N; the tensors of layers 0..N-1 and the
ends (token_embd, output_norm, output when the file has it, rope_freqs) are copied byte for byte
in their GGUF types. Its output is the full model's first N layers then the final norm and the
LM head: a weak but well-formed guesser, closest to the target where the later layers change
the least.

Usage: python -m tools.truncate_gguf SRC.gguf DST.gguf --layers N
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from tools.synthetic_gguf import part_path

_LAYER = re.compile(r"^blk\.(\d+)\.")


def truncate_gguf(src: str | Path, dst: str | Path, layers: int) -> Path:
    """Writes `dst`: `src` cut to its first `layers` decoder layers; returns dst."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"{src} has {total} layers: cannot keep {layers}")
    tmp = str(part_path(dst))
    w = GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == count_key:
            w.add_uint32(key, layers)
        elif field.types[0] == GGUFValueType.ARRAY:
            # the element type too: a list of ints would otherwise be written as the writer
            # guesses (tokenizer.ggml.token_type is int32 in llama.cpp's files)
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        m = _LAYER.match(t.name)
        if m is not None and int(m.group(1)) >= layers:
            continue
        qtype = GGMLQuantizationType(t.tensor_type)
        w.add_tensor(t.name, t.data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(tmp).replace(dst)
    return Path(dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--layers", type=int, required=True, help="decoder layers kept, from the first")
    a = p.parse_args(argv)
    truncate_gguf(a.src, a.dst, a.layers)
    print(f"wrote {a.dst} ({a.layers} layers of {a.src.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
