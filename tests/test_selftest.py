"""``opcontracts selftest`` on a CPU machine: the checks run on the emulation and say so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opcontracts import emulation
from opcontracts._tools import selftest as _selftest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(_selftest._real_torch_npu_importable(), reason="a real torch_npu is here: "
                    "tests/test_real_stack.py runs the checks on it")
def test_the_checks_run_on_the_emulation_and_leave_nothing_behind() -> None:
    import opcontracts.patch as patch

    was = patch.is_applied()
    patch.unpatch()
    assert not emulation.installed()
    try:
        stack = _selftest.open_stack()
        try:
            assert not stack.real and stack.where == "emulation"
            results = {r.name: r for r in _selftest.run_checks(stack)}
        finally:
            _selftest.close_stack(stack)
        assert not emulation.installed() and not patch.is_applied()
    finally:
        if was:
            patch.apply()
    assert list(results) == ["soc", "packets", "strict", "mindspeed", "dispatched",
                             "backward-mode", "torchair"]
    for name in ("soc", "packets", "strict", "mindspeed", "dispatched", "backward-mode"):
        assert results[name].status == _selftest.PASS, results[name]
    assert "device not initialised by it" in results["soc"].detail
    assert "on the autograd worker thread" in results["backward-mode"].detail
    assert results["torchair"].status == _selftest.PASS, results["torchair"]  # the stand-in torchair
    assert "expected bfloat16" in results["strict"].detail


def test_the_command_says_where_each_check_ran() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPCONTRACTS_MODE"}
    p = subprocess.run([sys.executable, "-m", "opcontracts", "selftest"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)
    lines = p.stdout.splitlines()
    assert lines[0].startswith("opcontracts selftest on the emulation: torch_npu 2.13.0")
    checks = [line for line in lines if line.startswith("  ")]
    assert len(checks) == len(_selftest.CHECKS)
    assert all("[emulation]" in line for line in checks)
    failed = sum(line.startswith("  FAIL") for line in checks)
    assert p.returncode == (1 if failed else 0)
    assert lines[-1].startswith("selftest: ") and "run it on an NPU machine" in lines[-1]
