"""``when`` version fields as lists of alternatives: torch_npu releases do not document in
version order (2.7.1.post11 ships the 2.13 docs, 2.9.1 the old ones), so a contract's range is a
union of ranges."""

from __future__ import annotations

import pytest

from opcontracts._lang import versions
from opcontracts._lang.versions import Env, applies, explain, satisfies
from opcontracts.errors import ContractFileError
from opcontracts.spec import When, contracts_from_toml

WIDE = [">=2.13", ">=2.7.1.post11,<2.8", ">=2.9.0.post9,<2.9.1"]


@pytest.mark.parametrize(("version", "ok"), [
    ("2.7.1", False), ("2.7.1.post10", False), ("2.7.1.post11", True), ("2.7.1.post12", True),
    ("2.8.0", False), ("2.9.0.post9", True), ("2.9.1", False), ("2.12.0", False),
    ("2.13.0", True), ("2.14.0", True),
])
def test_any_alternative_suffices(version: str, ok: bool) -> None:
    w = When(torch_npu=WIDE)
    assert w.torch_npu == " || ".join(WIDE)
    assert applies(w, Env(torch_npu=version)) is ok
    assert satisfies(version, " || ".join(WIDE)) is ok
    # the patch's index reads raw TOML tables: the same answer from a list
    assert applies({"torch_npu": WIDE}, Env(torch_npu=version)) is ok


def test_post_releases_order_after_their_release() -> None:
    assert satisfies("2.7.1.post11", ">2.7.1") and not satisfies("2.7.1.post11", "<2.7.1")
    assert satisfies("2.7.1.post11", "<2.8")


def test_explain_names_every_alternative() -> None:
    w = When(torch_npu=WIDE, cann=">=8.0.0")
    text = explain(w, Env(torch_npu="2.9.1", cann="8.0.0"))
    assert text == "needs torch_npu >=2.13 || >=2.7.1.post11,<2.8 || >=2.9.0.post9,<2.9.1, found 2.9.1"
    # met: only the alternative that holds is named
    assert explain(w, Env(torch_npu="2.14.0", cann="8.0.0")) == \
        "torch_npu 2.14.0 meets >=2.13; cann 8.0.0 meets >=8.0.0"
    assert explain(w, Env(torch_npu="2.9.0.post9", cann="8.0.0")).startswith(
        "torch_npu 2.9.0.post9 meets >=2.9.0.post9,<2.9.1;")
    assert applies(w, Env(torch_npu="2.14.0")) is None  # CANN unknown


def test_a_string_with_alternatives_is_the_same_condition() -> None:
    assert When(torch_npu=">=2.13 || ==2.7.1.post11") == When(torch_npu=[">=2.13", "==2.7.1.post11"])


def test_bad_alternative_names_the_file_and_field() -> None:
    text = """
[[contract]]
op = "x"
when = {torch_npu = [">=2.13", "2.7.1 or so"]}
[contract.args.a]
dtype = "bf16"
"""
    with pytest.raises(ContractFileError) as info:
        contracts_from_toml(text, "f.toml")
    msg = str(info.value)
    assert "f.toml" in msg and "when.torch_npu" in msg and "'2.7.1 or so'" in msg
    with pytest.raises(ContractFileError):
        contracts_from_toml(text.replace('[">=2.13", "2.7.1 or so"]', "[]"), "f.toml")


def test_unknown_version_keeps_every_alternative_open() -> None:
    assert applies(When(torch_npu=WIDE), Env()) is None
    assert versions.explain(When(torch_npu=WIDE), Env()).startswith("torch_npu unknown")
