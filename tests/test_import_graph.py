"""The house's walls, read from the source with ast (no module is imported): no import circle
among the project's modules, the gateway free of torch, triton and model code, no service
importing another, and the wire protocol importing nothing of the runtime (STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.cluster import ROOT

_TREES = ("shared", "services", "tools", "tests")
# what the gateway must never reach, even through shared/ (its process stays light and safe)
_GATEWAY_FORBIDDEN = ("torch", "triton", "shared.model", "shared.kernels", "shared.engine")
_GATEWAY_FORBIDDEN += ("shared.ops", "shared.quant", "shared.kv", "shared.worker")
_PROTOCOL_ALLOWED = ("msgspec", "__future__", "enum", "typing")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    return {
        _module_name(p, root): p for tree in _TREES for p in sorted((root / tree).rglob("*.py"))
    }


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module `name` imports, at any depth of its code (a lazy import in a function is
    still an edge): project modules by name, others by their top-level package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` depends on the submodule, not on pkg's own code
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        for t in targets:
            if t in modules:
                out.add(t)
            elif t.split(".")[0] not in _TREES:
                out.add(t.split(".")[0])
            else:  # a name inside a project module: the deepest module that holds it
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t:
                    out.add(t)
    out.discard(name)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start] & graph.keys())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w] & graph.keys()))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return found


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _forbidden(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_circles(graph):
    assert circles(graph) == []


def test_gateway_reaches_no_torch_triton_or_model_code(graph):
    for name in (n for n in graph if n.startswith("services.gateway")):
        bad = sorted(m for m in reach(graph, name) if _forbidden(m, _GATEWAY_FORBIDDEN))
        assert not bad, f"{name} reaches {bad}"


def test_services_do_not_import_each_other(graph):
    for name, deps in graph.items():
        if name.startswith("services.") and name.count(".") >= 1:
            own = ".".join(name.split(".")[:2])
            others = sorted(d for d in deps if d.startswith("services.") and not d.startswith(own))
            assert not others, f"{name} imports {others}"


def test_protocol_imports_nothing_of_the_runtime(graph):
    assert all(d.split(".")[0] in _PROTOCOL_ALLOWED for d in graph["shared.protocol"]), graph[
        "shared.protocol"
    ]


def test_the_checks_catch_a_circle_and_a_broken_wall(tmp_path):
    # the reader itself, on a tree made to break every rule once
    files = {
        "shared/__init__.py": "",
        "shared/a.py": "from shared import b\n",
        "shared/b.py": "def f():\n    from shared.a import g\n",
        "shared/protocol.py": "import msgspec\nfrom shared.a import x\n",
        "services/__init__.py": "",
        "services/gateway/__init__.py": "",
        "services/gateway/app.py": "from shared.c import y\nimport services.decode.main\n",
        "services/decode/__init__.py": "",
        "services/decode/main.py": "",
        "shared/c.py": "import torch\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = import_graph(tmp_path)
    assert circles(g) == [["shared.a", "shared.b"]]
    assert "torch" in reach(g, "services.gateway.app")
    assert "services.decode.main" in g["services.gateway.app"]
    assert "shared.a" in g["shared.protocol"]
