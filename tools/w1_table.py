"""Prints W1 as one table from the two engines' JSON lines: Skiff's (tools/bench_w1.py) and
llama-bench's (`-o jsonl`), matched by model file name.

    python -m tools.w1_table w1-skiff.jsonl w1-llama.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a timeout
    return out


def table(skiff: list[dict], llama: list[dict]) -> str:
    ref: dict[str, dict[str, float]] = {}
    for r in llama:
        name = Path(r["model_filename"]).name
        kind = "tg" if r["n_gen"] else "pp"
        ref.setdefault(name, {})[kind] = r["avg_ts"]
        ref[name]["bytes"] = r["model_size"]
    rows = [
        "| model | Skiff tg tok/s | llama.cpp tg tok/s | bound | Skiff % of bound | Skiff / "
        "llama.cpp | Skiff pp tok/s | llama.cpp pp tok/s | pp ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in skiff:
        name = s["model"]
        tg = next(v for k, v in s.items() if k.startswith("tg") and k.endswith("_tok_s"))
        pp = next(v for k, v in s.items() if k.startswith("pp") and k.endswith("_tok_s"))
        bound = s["bound_tok_s"]
        r = ref.get(name, {})
        ltg, lpp = r.get("tg"), r.get("pp")
        rows.append(
            f"| {name} | {tg:,.1f} | {f'{ltg:,.1f}' if ltg else '–'} | {bound:,.1f} | "
            f"{tg / bound:.1%} | {f'{tg / ltg:.2f}×' if ltg else '–'} | {pp:,.0f} | "
            f"{f'{lpp:,.0f}' if lpp else '–'} | {f'{pp / lpp:.2f}×' if lpp else '–'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(_lines(Path(args[0])), _lines(Path(args[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
