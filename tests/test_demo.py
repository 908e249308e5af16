"""``opcontracts demo``: the incident reproduced, caught, fixed, and its first NaN located."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import opcontracts
from opcontracts import cli, emulation, nan
from opcontracts._tools import demo


def _state() -> tuple[object, ...]:
    p = sys.modules.get("opcontracts.patch")
    targets = sorted(r.target for r in p.patched()) if p is not None else []
    return (emulation.installed(), p is not None and p.is_applied(), tuple(targets),
            demo.MODEL_MODULE in sys.modules, nan.active(), opcontracts.get_mode())


def test_four_outcomes_json_sentinel_and_state_restored(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    before = _state()
    out = tmp_path / "demo.json"
    assert cli.main(["demo", "--nan-check", "--json", str(out)]) == 0
    assert _state() == before

    printed = capsys.readouterr().out
    for name in ("reference", "unguarded", "strict", "fix"):
        assert f"] {name}:" in printed  # announced as it starts
    assert "profile 'incident'" in printed and "wall time" in printed
    assert "all four outcomes as described" in printed
    assert "call site: moe_block.py:" in printed  # the full violation message, user's line

    data = json.loads(out.read_text())
    assert data["ok"] is True and data["profile"] == "incident"
    sc = {s["name"]: s for s in data["scenarios"]}
    assert list(sc) == ["reference", "unguarded", "strict", "fix"]
    assert all(s["ok"] for s in sc.values())

    ref, ung, strict, fix = sc["reference"], sc["unguarded"], sc["strict"], sc["fix"]
    assert ref["nonfinite"] is False and ref["max_abs_diff"] == 0.0
    # the incident: the forward pass agrees with the reference, the gradients are NaN
    assert isinstance(ung["loss"], float) and ung["loss"] == pytest.approx(ref["loss"], rel=1e-3)
    assert ung["nonfinite"] is True and ung["grad_norm"] == "nan"
    assert strict["raised"] == "ContractViolation"
    assert strict["violation"]["arg"] == "probs"
    assert "npu_moe_token_unpermute" in strict["violation"]["op"]
    assert "probs = probs.to(torch.bfloat16)" in strict["error"]
    assert fix["nonfinite"] is False and fix["loss"] == pytest.approx(ref["loss"], rel=1e-2)
    assert 0 < fix["max_abs_diff"] < 1e-2  # bf16 probs: close, not identical
    assert fix["fixes"] and "'probs'" in fix["fixes"][0]

    first = ung["nan_check"]["first"]
    assert "npu_moe_token_unpermute" in first["op"] and first["direction"] == "backward"
    assert first["module"].startswith("layers.") and first["module"].endswith(".mlp")
    assert first["module_type"] == "MoELayer"
    assert first["call_site"].startswith("moe_block.py:")
    assert fix["nan_check"]["first"] is None and fix["nan_check"]["events"] == []
    assert ref["nan_check"] is None and strict["nan_check"] is None


def test_deterministic_and_no_sentinel_by_default() -> None:
    lines: list[str] = []
    a = demo.run_demo(seed=0, out=lines.append)
    b = demo.run_demo(seed=0, out=lines.append)
    assert a.ok and b.ok

    def numbers(r: demo.DemoResult) -> list[object]:
        return [demo._plain([s.loss, s.grad_norm, s.nonfinite, s.max_abs_diff, s.raised])
                for s in r.scenarios]

    assert numbers(a) == numbers(b)  # bit for bit (NaN compared as "nan")
    assert all(s.nan_check is None for s in a.scenarios)
    assert any(line.startswith("[1/4] reference") for line in lines)


def test_refuses_when_a_real_torch_npu_is_present(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(demo, "_real_torch_npu", lambda: "torch_npu is importable from /x")
    assert cli.main(["demo"]) == 2
    assert "real torch_npu" in capsys.readouterr().err


def test_command_line(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, "-m", "opcontracts", "demo", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scenario" in proc.stdout and json.loads(out.read_text())["ok"] is True
