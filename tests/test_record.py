"""The recorder (``opcontracts.record``, ``opcontracts run --record``): a golden run written as a
contract file that a later run uses to flag drift."""

from __future__ import annotations

import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _guarded_module import guarded_module

import opcontracts
from opcontracts import Arg, Contract
from opcontracts._engine import registry
from opcontracts._observers import layer
from opcontracts._tools import run
from opcontracts.record import Recorder
from opcontracts.spec import load_contracts

MOD = "record_test_ops"


def _route(x: torch.Tensor, probs: torch.Tensor | None = None, k: int = 2,
           mode: str = "top") -> torch.Tensor:
    return x * 2


def _plain(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return x * scale


@pytest.fixture
def ops() -> Iterator[types.ModuleType]:
    """``record_test_ops.route`` guarded by a permissive contract (bf16 or fp32 probs, any k):
    the shipped-contract situation where a golden run is stricter than the rules."""
    with guarded_module(MOD, {"route": _route, "plain": _plain},
                        [Contract("t.route", {"x": Arg(["bf16", "fp32"]),
                                              "probs": Arg(["bf16", "fp32"], optional=True)},
                                  targets=[f"{MOD}.route"], source="test: permissive")]) as mod:
        yield mod


SCRIPT = """
import sys
import torch
import record_test_ops as ops

dtype = getattr(torch, sys.argv[1])
x = torch.ones(4, 8, dtype=torch.bfloat16)
for _ in range(3):
    ops.route(x, torch.ones(4, 2, dtype=dtype), k=2, mode="top")
ops.route(x, None, mode="top")
"""


def _script(tmp_path: Path) -> Path:
    p = tmp_path / "train.py"
    p.write_text(textwrap.dedent(SCRIPT), encoding="utf-8")
    return p


def test_recorder_keeps_dtypes_ranks_constants_and_none(ops: types.ModuleType) -> None:
    with Recorder() as rec:
        ops.route(torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(4, 2), k=2, mode="top")
        ops.route(torch.ones(4, 8, dtype=torch.bfloat16), None, k=2, mode="top")
    (c,) = rec.contracts(script="train.py")
    assert c["op"] == "t.route" and c["targets"] == [f"{MOD}.route"]
    assert c["args"]["x"] == {"dtype": ["bf16"], "rank": [2]}
    assert c["args"]["probs"] == {"dtype": ["fp32"], "rank": [2], "optional": True}
    assert c["args"]["k"] == {"allowed": [2]} and c["args"]["mode"] == {"allowed": ["top"]}
    assert "train.py" in c["source"] and "torch " in c["source"] and "opcontracts" in c["source"]
    assert c["when"] == {"torch": ">=0"}
    assert layer.attached() == []  # off again: nothing installed


def test_run_record_then_drift_is_flagged(ops: types.ModuleType, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    golden = tmp_path / "golden.toml"
    script = _script(tmp_path)
    assert run.main(["--record", str(golden), str(script), "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert f"golden run recorded to {golden}" in err
    (c,) = load_contracts(golden)  # a contract file like any other
    assert c.op == "t.route" and c.targets == (f"{MOD}.route",)
    assert c.args["probs"].dtype == ("bfloat16",) and c.args["probs"].optional
    assert c.args["mode"].allowed == ("top",)
    assert "k" not in c.args  # left out in one call: its default is not known, nothing pinned
    assert c.source is not None and "script " + str(script) in c.source
    text = golden.read_text()
    assert "OPCONTRACTS_CONTRACTS" in text and text.startswith("# Golden run recorded")
    # the same step with fp32 probs passes the permissive contract ...
    assert run.main(["--mode", "strict", str(script), "float32"]) == 0
    capsys.readouterr()
    # ... and is flagged as a drift from the golden run once it is loaded
    monkeypatch.setenv("OPCONTRACTS_CONTRACTS", str(golden))
    assert run.main(["--mode", "strict", str(script), "float32"]) == 1
    err = capsys.readouterr().err
    assert "ContractViolation" in err and "argument 'probs' has dtype float32" in err
    assert "recorded by opcontracts run --record" in err  # the rule names the golden run
    monkeypatch.setenv("OPCONTRACTS_CONTRACTS", str(golden))
    assert run.main(["--mode", "strict", str(script), "bfloat16"]) == 0  # no drift


def test_record_under_the_shipped_rules_keeps_them(ops: types.ModuleType, tmp_path: Path) -> None:
    """Recorded contracts sit next to the op's own (another ``when``): both apply, merged."""
    with Recorder() as rec:
        ops.route(torch.ones(2, 2), torch.ones(2, 2))
    path = rec.write(tmp_path / "g.toml", script="s.py")
    registry.register(load_contracts(path), replace=True)
    merged = registry.resolve("t.route")
    assert merged is not None
    assert merged.args["x"].dtype == ("float32",)  # the golden dtype, within the shipped set
    assert "test: permissive" in (merged.source or "") and "recorded" in (merged.source or "")
    with opcontracts.mode("strict"), pytest.raises(opcontracts.ContractViolation):
        ops.route(torch.ones(2, 2, dtype=torch.bfloat16))


@pytest.mark.skipif(not layer._empty_contract_compiles(),
                    reason="--record-target needs the checker to compile a contract without "
                           "rules (opcontracts/_engine/compile.py)")
def test_record_target_without_a_contract(ops: types.ModuleType, tmp_path: Path) -> None:
    with Recorder(watch={f"{MOD}.plain": f"{MOD}.plain"}) as rec:
        ops.plain(torch.ones(3, dtype=torch.float16), scale=0.5)
    (c,) = [c for c in rec.contracts() if c["op"] == f"{MOD}.plain"]
    assert c["targets"] == [f"{MOD}.plain"]
    assert c["args"]["x"] == {"dtype": ["fp16"], "rank": [1]}
    assert c["args"]["scale"] == {"allowed": [0.5]}


def test_record_target_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--record-target", "a.b", "s.py"]) == 2
    assert "--record-target needs --record FILE" in capsys.readouterr().err
    assert run.main(["--record", "g.toml", "--record-target", "notdotted", "s.py"]) == 2
    assert "expected a dotted path" in capsys.readouterr().err
