"""The package layout: no import cycle, lazy imports included; the package root imported by
nobody inside it but the entry points; and docs/architecture.md, the map, true to the tree and
to the layers contract.  (The layer order itself is import-linter's contract in pyproject.toml,
run by ``lint-imports`` in CI; these are what a layers contract cannot say.)"""

from __future__ import annotations

import re
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

grimp = pytest.importorskip("grimp")  # comes with import-linter (the `test` extra)

# the entry points sit above the root package (the public names of ``import opcontracts``)
# and the demo's model file, which is user code (run as ``moe_block.py``) and reads
# ``opcontracts.preflight.active()`` as a user's model file does
ROOT_IMPORTERS = {"opcontracts.cli", "opcontracts.pytest_plugin", "opcontracts.__main__",
                  "opcontracts._tools.demo_model"}


@pytest.fixture(scope="module")
def graph():  # type: ignore[no-untyped-def]
    return grimp.build_graph("opcontracts", include_external_packages=False)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph) -> None:  # type: ignore[no-untyped-def]
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


def test_only_entry_points_import_the_package_root(graph) -> None:  # type: ignore[no-untyped-def]
    importers = set(graph.find_modules_that_directly_import("opcontracts"))
    assert importers <= ROOT_IMPORTERS, sorted(importers - ROOT_IMPORTERS)


# --------------------------------------------------------------------------- the map stays true
def _layers_in_pyproject() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    [layers] = [c for c in data["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [" ".join(layer.split()) for layer in layers["layers"]]


def test_architecture_page_states_the_layers_contract() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = text.split("## The contract that holds the layers", 1)[1].split("```text\n", 1)[1]
    shown = [" ".join(line.split()) for line in block.split("```", 1)[0].splitlines()]
    assert shown == _layers_in_pyproject()


def test_architecture_page_names_every_module() -> None:
    """Each module of the package is on the map (by name, or by a pattern such as `_fam_*.py`)."""
    names = set(re.findall(r"[\w*]+\.py\b", ARCHITECTURE.read_text(encoding="utf-8")))
    missing = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "opcontracts").rglob("*.py")
                     if not any(fnmatch(p.name, n) for n in names))
    assert not missing, f"not in docs/architecture.md: {missing}"
