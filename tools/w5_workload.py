"""W5's prompts (../shared/BENCHMARKS.md): code edits built from real source files and prose.

A code edit asks for a whole Python standard-library function back with one name changed, the
task prompt lookup is for (the answer copies most of the prompt); prose asks for new text, where
drafts rarely hold. Both are deterministic for one Python version (the sources are the running
interpreter's own).
"""

from __future__ import annotations

import ast
import importlib
import inspect

MODULES = ("textwrap", "shlex", "json.encoder", "json.decoder", "string", "fnmatch", "glob",
           "calendar", "colorsys", "difflib", "heapq", "bisect", "queue", "csv",
           "base64")  # fmt: skip
TOPICS = ("the history of bridges", "how bees make honey", "a walk along a winter beach",
          "why the sky is blue", "the life of a lighthouse keeper", "how bread rises",
          "a city market at dawn", "the first day at a new school", "how rivers shape valleys",
          "a letter to a friend far away")  # fmt: skip


def functions(min_lines: int = 8, max_lines: int = 40) -> list[tuple[str, str]]:
    """(name, source) of the module-level functions of MODULES within the line bounds."""
    out = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        tree = ast.parse(inspect.getsource(mod))
        lines = inspect.getsource(mod).splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    out.append((node.name, "\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


def code_edits(n: int, max_lines: int = 40) -> list[str]:
    """n instructions: rename a function and return all of it (cycling through the sources)."""
    fns = functions(max_lines=max_lines)
    out = []
    for i in range(n):
        name, src = fns[i % len(fns)]
        out.append(
            f"Rename the function `{name}` to `{name}_v2` in this Python code and return the "
            f"whole code, nothing else.\n\n```python\n{src}\n```"
        )
    return out


def prose(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
