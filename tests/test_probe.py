"""``opcontracts probe``: what the kernels really accept, measured against their references.

On the CPU emulation the truth is known (the profile says which dtypes each kernel reads
correctly), so the probe must recover it exactly, for every emulated op and every profile.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import opcontracts
from opcontracts import cli, emulation
from opcontracts.emulation import OP_NAMES, PROFILES
from opcontracts.probe import GRIDS, probe
from opcontracts.spec import load_contracts

ONE_BYTE = {"bool", "int8", "uint8"}


@pytest.fixture
def versions() -> Iterator[None]:
    yield
    opcontracts.set_versions(cann=None, soc=None)


@contextlib.contextmanager
def _installed(profile: str) -> Iterator[None]:
    emulation.install(profile)
    import torch_npu  # noqa: F401 - the stand-in: its version is detected

    try:
        yield
    finally:
        emulation.uninstall()


@pytest.fixture
def narrow() -> Iterator[None]:
    with _installed("narrow"):
        yield


@pytest.fixture
def wide() -> Iterator[None]:
    with _installed("wide"):
        yield


# dtypes that are a mode only together with another argument's: the grid changes one argument
# at a time (the others at the example's dtype), so alone they measure wrong, as the kernel
# computes them (A4W4: int4 packed in int32 in x1 and x2 at once; int32 x1 with int8 x2 is
# no mode of npu_quant_matmul)
PAIRED_MODES: dict[tuple[str, str], set[str]] = {
    ("npu_quant_matmul", "x1"): {"int32"}, ("npu_quant_matmul", "x2"): {"int32"},
}


@pytest.mark.parametrize("profile", ["narrow", "incident", "wide"])
def test_recovers_each_profiles_dtypes_for_every_emulated_op(profile: str) -> None:
    """Per kernel and argument the profile lists, the dtypes measured correct are exactly the
    profile's; arguments it does not list read every dtype of their grid correctly.  One
    exception, which no output can reveal: a 0/1 mask read as another one-byte dtype holds the
    same bytes, so the other one-byte dtypes also measure correct (``routing_map``,
    ``atten_mask``, ``finished``)."""
    with _installed(profile):
        for op in OP_NAMES:
            rep = probe(op)
            listed = PROFILES[profile].get(op, {})
            assert rep.args, op
            for a in rep.args:
                correct = set(a.dtypes("correct"))
                if a.name in listed:
                    # the dtypes of its grid (a float x that a quantized mode takes as int8 too)
                    want = set(listed[a.name]) & {c.dtype for c in a.cells}
                    want -= PAIRED_MODES.get((op, a.name), set())
                    if want <= ONE_BYTE and a.kind == "mask":
                        assert want <= correct <= want | ONE_BYTE, (op, a.name, correct)
                    else:
                        assert correct == want, (op, a.name, sorted(correct), sorted(want))
                    # garbage, silently (a paired mode's dtype alone: refused, as no mode)
                    assert set(a.dtypes("raises")) <= PAIRED_MODES.get((op, a.name), set()), \
                        (op, a.name)
                else:
                    assert correct == {c.dtype for c in a.cells}, (op, a.name)
                    assert len(a.cells) == len(GRIDS[a.kind])


def test_reports_both_kinds_of_disagreement_with_the_contract(narrow: None, versions: None
                                                             ) -> None:
    # torch_npu 2.13 on CANN 8.0.0: the shipped contract allows fp16/fp32 probs; the narrow
    # kernels (bf16 only, like MindSpeed's) compute them wrong: claimed but wrong
    opcontracts.set_versions(cann="8.0.0")
    rep = probe("npu_moe_token_unpermute")
    claimed = {(c.args, c.dtype) for c in rep.claimed_but_wrong}
    assert (("probs",), "fp32") in claimed and (("permuted_tokens",), "fp16") in claimed
    assert rep.correct_but_forbidden == []
    assert "claimed but wrong (the contract allows it, the kernel gets it wrong):" in rep.table()


def test_an_allowance_only_while_cann_is_unknown_is_told_apart(narrow: None) -> None:
    # CANN unknown: fp32 probs pass strict mode only as a conditional call (the 8.0.RC3 reading
    # rejects them, a later one allows them); the narrow kernel misreads them.  That is not a
    # contract that must forbid them (the claimed-but-wrong exit), it is a target to set.
    with opcontracts.versions(cann="unknown"):
        rep = probe("npu_moe_token_unpermute")
    probs = next(a for a in rep.args if a.name == "probs").to_dict()
    assert "fp32" in probs["allowed_while_unknown"]
    assert "fp32" not in probs["allowed_by_contract"]
    assert (("probs",), "fp32") not in {(c.args, c.dtype) for c in rep.claimed_but_wrong}
    assert (("probs",), "fp32") in {(c.args, c.dtype) for c in rep.unknown_but_wrong}
    table = rep.table()
    assert "fp32?" in table and "allowed while a version is unknown, and wrong" in table


def test_correct_but_forbidden(wide: None) -> None:
    # the incident's stack (CANN 8.0.RC3: bf16 only) declared; the wide kernels read fp32 (with
    # CANN unknown the bf16-only reading is one of several: a conditional verdict, not forbidden)
    opcontracts.set_targets(cann="8.0.RC3")
    rep = probe("npu_moe_token_unpermute")
    forbidden = {(c.args, c.dtype) for c in rep.correct_but_forbidden}
    assert (("probs",), "fp32") in forbidden
    assert all(c.rule for c in rep.correct_but_forbidden)  # each names the rule that rejects it
    probs = next(a for a in rep.args if a.name == "probs")
    assert probs.to_dict()["allowed_by_contract"] == ["bf16"]


def test_write_contract_pins_the_detected_versions(narrow: None, versions: None,
                                                   tmp_path: Path) -> None:
    opcontracts.set_versions(cann="8.0.RC3", soc="Ascend910B3")
    rep = probe("npu_moe_token_unpermute")
    path = rep.write_contract(tmp_path / "measured.toml")
    (c,) = load_contracts(path)
    assert c.op == "npu_moe_token_unpermute"
    assert c.when is not None
    assert (c.when.torch_npu, c.when.cann, c.when.soc) == ("==2.13.0", "==8.0.RC3",
                                                           ("Ascend910B3",))
    assert c.args["probs"].dtype == ("bfloat16",) and c.args["probs"].optional
    assert c.args["sorted_indices"].dtype == ("int32",)
    assert "torch.ops.npu.npu_moe_token_unpermute" in c.targets
    assert c.source is not None and "measured by opcontracts probe" in c.source
    assert "emulation profile 'narrow'" in c.source


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_toml = tmp_path / "p.json", tmp_path / "p.toml"
    assert cli.main(["probe", "npu_swiglu", "mindspeed.npu_gmm", "--profile", "wide", "--json",
                     str(out_json), "--write-contract", str(out_toml)]) == 0
    out = capsys.readouterr().out
    assert "opcontracts probe: npu_swiglu (torch.ops.npu.npu_swiglu)" in out
    assert "emulation profile 'wide'" in out and "2 op(s) probed" in out
    data = json.loads(out_json.read_text())
    swiglu = data["ops"][0]
    assert swiglu["args"][0]["correct"] == ["bf16", "fp16", "fp32"]
    assert swiglu["args"][0]["wrong"] == ["fp64"]
    assert [c.op for c in load_contracts(out_toml)] == ["npu_swiglu", "mindspeed.npu_gmm"]
    assert not emulation.installed()  # put back as it was
    assert cli.main(["probe", "no_such_op"]) == 2
    assert "no reference with example inputs for 'no_such_op'" in capsys.readouterr().err
    assert cli.main(["probe"]) == 2


def test_cli_exit_1_when_the_contract_lets_garbage_through(versions: None,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    opcontracts.set_versions(cann="8.0.0")
    assert cli.main(["probe", "npu_moe_token_unpermute", "--profile", "narrow"]) == 1
    assert "the contract allows are computed wrong" in capsys.readouterr().err
