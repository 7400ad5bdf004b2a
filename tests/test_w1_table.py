"""tools/w1_table joins Skiff's and llama-bench's W1 lines into one table."""

from __future__ import annotations

import json
from pathlib import Path

from tools.w1_table import main


def test_one_row_per_skiff_model_with_llama_cpp_beside_it(tmp_path: Path, capsys) -> None:
    skiff = tmp_path / "s.jsonl"
    skiff.write_text(
        "noise\n"
        + json.dumps({"model": "a.gguf", "pp512_tok_s": 1000.0, "tg128_tok_s": 100.0,
                      "bound_tok_s": 400.0}) + "\n"
        + json.dumps({"model": "b.gguf", "pp512_tok_s": 500.0, "tg128_tok_s": 50.0,
                      "bound_tok_s": 200.0}) + "\n"
        + '{"model": "cut off'
    )  # fmt: skip
    llama = tmp_path / "l.jsonl"
    rows = [
        {"model_filename": "/tmp/a.gguf", "model_size": 1, "n_gen": 0, "avg_ts": 800.0},
        {"model_filename": "/tmp/a.gguf", "model_size": 1, "n_gen": 128, "avg_ts": 200.0},
    ]
    llama.write_text("\n".join(json.dumps(r) for r in rows))
    assert main([str(skiff), str(llama)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4
    assert out[2] == ("| a.gguf | 100.0 | 200.0 | 400.0 | 25.0% | 0.50× | 1,000 | 800 | 1.25× |")
    assert out[3].startswith("| b.gguf | 50.0 | – | 200.0 | 25.0% | – |")
