"""``opcontracts list --coverage``: which ops of a torch_npu release have a contract."""

from __future__ import annotations

import json

import pytest

from opcontracts import Arg, Contract, cli
from opcontracts.wheel import coverage, digest


def test_coverage_of_2_14_counts_every_op_once() -> None:
    rel = digest.load().release("2.14.0")
    shipped = [Contract("npu_swiglu", {"self": Arg("bf16")}),
               Contract("mine", {"x": Arg("bf16")}, targets=["torch.ops.npu.npu_add_rms_norm"]),
               Contract("npu_moe_token_unpermute", {"probs": Arg("bf16")},
                        when={"torch_npu": "<2.6"})]
    cov = coverage.coverage(rel, shipped)
    assert set(cov.covered) == {"npu_swiglu", "npu_add_rms_norm"}
    assert cov.covered["npu_add_rms_norm"] == ["mine"]  # by its target
    assert "npu_moe_token_unpermute" in cov.other_versions  # its `when` excludes 2.14.0
    parts = len(cov.covered) + len(cov.uncovered_documented) + len(cov.uncovered_undocumented)
    assert parts == len(cov.ops) and not any(o.startswith("_") for o in cov.ops)
    assert "npu_moe_token_unpermute" in cov.uncovered_documented


def test_list_coverage_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list", "--coverage", "2.14.0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch_npu"] == "2.14.0"
    assert "npu_moe_token_unpermute" in data["covered"]  # the shipped packs
    assert data["ops"] == (len(data["covered"]) + len(data["documented_uncovered"])
                           + len(data["undocumented_uncovered"]))
    assert cli.main(["list", "--coverage", "2.5.1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torch_npu 2.5.1: ")
    assert "npu_moe_token_unpermute:" not in out  # absent from 2.5.1
    assert cli.main(["list", "--coverage", "9.9.9"]) == 2
    assert "9.9.9" in capsys.readouterr().err
