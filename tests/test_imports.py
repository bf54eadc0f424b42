"""The import graph of ``continuum`` and ``benchmarks`` has no circles.

Every ``import`` statement counts, the ones inside functions too (a lazy import hides a circle, it
does not remove it). The one exception is documented in ``continuum/state/__init__.py``: ``state.core``
binds the modules that implement ``SequenceState``'s operators, and they import ``core``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATE_CORE = "continuum.state.core"
STATE_METHODS = {"continuum.state.combine", "continuum.state.convert", "continuum.state.indexing",
                 "continuum.state.persistence"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("continuum", "benchmarks"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the two packages it imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                edges.update(f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names)
        edges.discard(mod)
        if mod == STATE_CORE:  # the documented binding of the operator modules (see the module docstring)
            edges -= STATE_METHODS
        graph[mod] = {e for e in edges if e in mods}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_walker_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "continuum.models.kv" in graph["continuum.loop.decoding"]  # relative imports resolved
    assert "continuum.guides.prepare" in graph["continuum.guides.compile"]


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_processors_do_not_import_the_decoding_loop():
    assert "continuum.loop.decoding" not in import_graph()["continuum.processors"]


def test_lazy_roots_bind_their_names_not_their_submodules():
    """The lazy package roots (continuum/_lazy.py): after every submodule is imported, each exported name is still
    the function or class, not a submodule of the same name that took the attribute (``models.llamacpp``,
    ``models.llamacpp.decode``); and ``import continuum`` imports no torch (a fresh interpreter)."""
    import importlib
    import subprocess
    import sys
    import types

    for mod in sorted(_modules()):
        if mod.startswith("continuum.") and "cluster" not in mod and "serve" not in mod:
            try:
                importlib.import_module(mod)
            except ImportError:  # an optional extra (llama-cpp-python...)
                pass
    subpackages = {"chat", "cluster", "generate", "models", "samplers", "speculate"}
    for root in ("continuum", "continuum.models", "continuum.models.llamacpp"):
        package = importlib.import_module(root)
        for name in package.__all__:
            value = getattr(package, name)
            assert not isinstance(value, types.ModuleType) or (root == "continuum" and name in subpackages), \
                f"{root}.{name} is the submodule, not the exported name"
    code = "import sys, continuum, continuum.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
