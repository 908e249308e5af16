"""The precomputed index of the shipped contracts' targets (``contracts/index.json``): what
``import opcontracts.patch`` reads instead of parsing every contract file.  It is current (a
stale committed index fails here), and a stale or broken one is never believed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from opcontracts._engine import contract_index as _contract_index
from opcontracts._engine import registry as _registry

SHIPPED = _registry.shipped_contracts_dir()


def test_the_committed_index_is_current() -> None:
    assert _contract_index.load(SHIPPED) is not None, (
        "contracts/index.json is stale or missing: run python -m opcontracts._engine.contract_index")
    data = json.loads((SHIPPED / _contract_index.INDEX_NAME).read_text(encoding="utf-8"))
    assert data == _contract_index.build(SHIPPED)


def test_the_patch_reads_the_same_entries_from_the_index_as_from_the_files(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_registry, "_index", None)
    from_index = _registry.shipped_index()
    monkeypatch.setattr(_registry, "_index", None)
    monkeypatch.setattr(_contract_index, "load", lambda folder: None)  # as if stale
    from_files = _registry.shipped_index()
    assert from_files == from_index and any(e.args for e in from_index)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    dst = tmp_path / "contracts"
    shutil.copytree(SHIPPED, dst)
    return dst


def test_an_edited_added_or_removed_file_makes_the_index_stale(copy: Path) -> None:
    assert _contract_index.load(copy) is not None
    first = sorted(copy.rglob("*.toml"))[0]
    text = first.read_text(encoding="utf-8")
    first.write_text(text + "\n# edited\n", encoding="utf-8")
    assert _contract_index.load(copy) is None
    first.write_text(text, encoding="utf-8")
    assert _contract_index.load(copy) is not None
    (copy / "extra.toml").write_text("", encoding="utf-8")
    assert _contract_index.load(copy) is None
    (copy / "extra.toml").unlink()
    first.unlink()
    assert _contract_index.load(copy) is None


@pytest.mark.parametrize("content", ["", "{", "[]", '{"version": 99}', '{"version": 1}'])
def test_a_broken_index_is_not_believed(copy: Path, content: str) -> None:
    (copy / _contract_index.INDEX_NAME).write_text(content, encoding="utf-8")
    assert _contract_index.load(copy) is None


def test_an_index_whose_entries_are_malformed_is_not_believed(copy: Path) -> None:
    path = copy / _contract_index.INDEX_NAME
    data = json.loads(path.read_text(encoding="utf-8"))
    data["entries"][0]["targets"] = "not a list"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert _contract_index.load(copy) is None


def test_the_command_rewrites_a_stale_index(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (copy / "extra.toml").write_text('[[contract]]\nop = "x.extra"\ntargets = ["m.f"]\n',
                                     encoding="utf-8")
    assert _contract_index.main([str(copy)]) == 0
    entries = _contract_index.load(copy)
    assert entries is not None
    assert {"op": "x.extra", "targets": ["m.f"], "when": None, "args": None,
            "file": "extra.toml"} in entries
    assert "index.json" in capsys.readouterr().out
