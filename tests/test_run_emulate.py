"""``opcontracts run --emulate``: an unmodified torch_npu script on the emulated device.

``examples/torch_npu_step.py`` imports torch_npu, moves its model with ``.npu()`` and calls
``torch_npu.npu_moe_token_(un)permute``; it has no emulation code of its own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opcontracts._tools import run as _run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/torch_npu_step.py"


def _run_cli(*args: str, targets: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::opcontracts.ContractWarning"}
    if targets is not None:
        env["OPCONTRACTS_TARGETS"] = targets
    env.pop("OPCONTRACTS_MODE", None)
    return subprocess.run([sys.executable, "-m", "opcontracts", "run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


def test_an_unmodified_torch_npu_script_trains_on_the_emulated_device() -> None:
    p = _run_cli("--emulate", SCRIPT)
    assert p.returncode == 0, p.stderr
    assert "Ascend910B3: loss" in p.stdout and "backward on a worker thread" in p.stdout
    assert "gradients finite" in p.stdout
    assert "no contract violations" in p.stderr


def test_strict_stops_the_fp32_probs_of_the_unmodified_script() -> None:
    # the incident's stack: CANN 8.0.RC3's unpermute reads bf16 probs only (on CANN >= 8.0.0
    # fp32 is fine, so with CANN unknown the call is only warned about: conditional)
    p = _run_cli("--emulate=incident", "--mode", "strict", SCRIPT, "--fp32-probs",
                 targets="cann=8.0.RC3")
    assert p.returncode == 1
    assert "npu_moe_token_unpermute: argument 'probs' has dtype float32" in p.stderr
    assert f"call site: {SCRIPT}:" in p.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                    reason="a real torch_npu is installed: the script runs on it")
def test_without_emulate_the_script_cannot_import_torch_npu() -> None:
    p = _run_cli(SCRIPT)
    assert p.returncode == 1 and "No module named 'torch_npu'" in p.stderr


@pytest.mark.parametrize(("argv", "profile"), [
    (["--emulate", "s.py"], "narrow"), (["--emulate=wide", "s.py"], "wide"), (["s.py"], None)])
def test_emulate_takes_an_optional_profile(argv: list[str], profile: str | None) -> None:
    opts = _run.parse(argv)
    assert opts.emulate == profile and opts.script == "s.py"


def test_an_unknown_profile_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run.main(["--emulate=narow", "s.py"]) == 2
    err = capsys.readouterr().err
    assert "--emulate: unknown profile 'narow'; expected one of narrow, incident, wide" in err


CHIP_SCRIPT = """\
import subprocess, sys
import torch
import torch_npu
import opcontracts
from opcontracts._lang import versions
print("parent", torch.npu.get_device_name(), versions.current().soc)
child = "import torch, torch_npu; print('child', torch.npu.get_device_name())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
"""


def test_soc_names_the_chip_the_emulated_device_and_its_children_report(tmp_path: Path) -> None:
    """``--soc Ascend950PR``: torch_npu.npu.get_device_name(), the detected SoC the contracts
    are chosen by, and a Python process the script starts all say Ascend950PR."""
    script = tmp_path / "chip.py"
    script.write_text(CHIP_SCRIPT, encoding="utf-8")
    p = _run_cli("-q", "--emulate=wide", "--soc", "Ascend950PR", str(script))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["parent Ascend950PR Ascend950PR", "child Ascend950PR"]
    default = _run_cli("-q", "--emulate", str(script))
    assert default.stdout.splitlines()[0] == "parent Ascend910B3 Ascend910B3"


def test_a_bad_soc_is_a_usage_error_and_soc_needs_emulate(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("", encoding="utf-8")
    assert _run.parse(["--emulate", "--soc=Ascend910_9392", "s.py"]).soc == "Ascend910_9392"
    assert _run.main(["--emulate", "--soc", "910B", str(script)]) == 2
    assert "--soc: soc='910B': expected the name of the Ascend chip" in capsys.readouterr().err
    assert _run.main(["--soc", "Ascend950PR", str(script)]) == 2
    assert "--soc needs --emulate" in capsys.readouterr().err


def test_the_soc_variable_is_checked_where_the_device_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opcontracts.emulation import _device
    from opcontracts.errors import SettingError

    monkeypatch.setenv(_device.SOC_ENV, "Ascend950PR")
    assert _device.soc_setting() == "Ascend950PR"
    monkeypatch.setenv(_device.SOC_ENV, "a5")
    with pytest.raises(SettingError, match="OPCONTRACTS_EMULATE_SOC='a5'"):
        _device.soc_setting()
    monkeypatch.delenv(_device.SOC_ENV)
    assert _device.soc_setting() == _device.DEFAULT_SOC
