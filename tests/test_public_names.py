"""Every name the README, the docs, the examples and the notebooks tell users to import exists.

Modules move (the package root holds only the public surface); what users were told must keep working.
Two kinds of reference are checked: ``from continuum... import a, b`` statements (in code blocks, examples and
notebook cells) and dotted names such as ``continuum.programs.aio.ASYNC_WORKERS`` written in the prose.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/benchmarks.md is a log of past measurements: it names modules as they were when each was taken
SOURCES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"),
           *sorted((ROOT / "examples").glob("*.py"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

_FROM = re.compile(r"^\s*from\s+(continuum[\w.]*)\s+import\s+(\([^)]*\)|[^\n#]*)", re.M)
_DOTTED = re.compile(r"(?<![\w./])(continuum(?:\.\w+)+)")


def _texts() -> list[tuple[str, str]]:
    out = [(p.name, p.read_text(encoding="utf-8")) for p in SOURCES]
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        out.append((nb.name, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")))
    return out


def imports() -> list[tuple[str, str, str]]:
    """(source file, module, name) of every ``from continuum... import name``."""
    found = set()
    for where, text in _texts():
        for module, names in _FROM.findall(text):
            for name in re.split(r"[,\s()]+", names.split(" as ")[0] if "(" not in names else names):
                if name and name != "as" and name.isidentifier() and name != "import":
                    found.add((where, module, name))
    return sorted(found)


def dotted() -> list[tuple[str, str]]:
    """(source file, dotted name) of every ``continuum.x.y`` named in the prose (not in ``from`` lines)."""
    found = set()
    for where, text in _texts():
        for ref in _DOTTED.findall(_FROM.sub("", text)):
            found.add((where, ref.rstrip(".")))
    return sorted(found)


def resolve(dotted_name: str) -> object:
    """Import the longest module prefix of ``dotted_name`` and read the rest as attributes."""
    parts = dotted_name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted_name)


def test_the_scanner_finds_references():
    assert ("README.md", "continuum", "continuous") in imports()
    assert any(ref == "continuum.chat.Chat" for _, ref in dotted())
    with pytest.raises(AttributeError):
        resolve("continuum.chat.NoSuchName")


@pytest.mark.parametrize(("where", "module", "name"), imports())
def test_imported_names_exist(where, module, name):
    assert hasattr(importlib.import_module(module), name), f"{where}: `from {module} import {name}` fails"


@pytest.mark.parametrize(("where", "ref"), dotted())
def test_dotted_names_exist(where, ref):
    try:
        resolve(ref)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{where} names `{ref}`, which does not resolve: {e}")
