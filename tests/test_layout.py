"""The package layout: no import cycle, lazy imports included, and the package root imported by
nobody inside it but the entry points.  (The layer order itself is import-linter's contract in
pyproject.toml, run by ``lint-imports`` in CI; this is what a layers contract cannot say.)"""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")  # comes with import-linter (the `test` extra)

# the entry points sit above the root package (the public names of ``import opcontracts``)
ROOT_IMPORTERS = {"opcontracts.cli", "opcontracts.pytest_plugin", "opcontracts.__main__"}


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
