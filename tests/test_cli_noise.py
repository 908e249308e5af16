"""Noise a new user meets before any finding (issue 13, item 23): the NumPy warning of the CPU
torch wheel, opcontracts warnings leaking into the test suite's summary, the missing LICENSE."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_numpy_is_a_dependency() -> None:
    # torch imports numpy when it can; the CPU wheel does not depend on it, and without it
    # every command prints "UserWarning: Failed to initialize NumPy" (the object collectives
    # of torch.distributed need it too)
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    names = {Requirement(r).name.lower() for r in project["dependencies"]}
    assert "numpy" in names
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -q -e '.[test]'" in ci and "--no-deps" not in ci


def test_license_file_is_the_one_the_metadata_declares(tmp_path: Path) -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text  # the full text
    # the metadata setuptools writes: the SPDX expression and the file, shipped in the wheel
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    dist_info = tmp_path / out.stdout.strip().splitlines()[-1]
    meta = (dist_info / "METADATA").read_text(encoding="utf-8")
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert (dist_info / "licenses" / "LICENSE").read_text(encoding="utf-8") == text


LEAKY_TEST = '''
import torch

import opcontracts
from opcontracts import Arg, Contract

leaky = opcontracts.enforce(Contract("leaky_op", {"x": Arg("bf16")}))(lambda x: x)
fixing = opcontracts.enforce(Contract("fixing_op", {"x": Arg("bf16")}))(lambda x: x.dtype)


def test_calls_a_guard_in_warn_mode_without_asserting_the_warning():
    leaky(torch.ones(1))  # about something else: the call goes through


def test_fix_mode_without_asserting_the_warning():
    with opcontracts.mode("fix"):
        assert fixing(torch.ones(1)) is torch.bfloat16


def test_a_test_that_asserts_still_sees_it():
    import pytest

    with pytest.warns(opcontracts.ContractWarning, match="leaky_op"):
        leaky(torch.ones(2))


def test_other_warnings_still_show():
    import warnings

    warnings.warn("an unrelated warning", UserWarning)
'''


def test_suite_summary_shows_no_opcontracts_warnings(tmp_path: Path) -> None:
    """The suite's conftest, on tests that call guards without asserting their warnings: the
    summary of ``pytest -q`` keeps other warnings and shows no opcontracts ones."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "4 passed, 1 warning" in out
    assert "an unrelated warning" in out
    assert "ContractWarning" not in out and "ContractFixWarning" not in out
    assert "leaky_op" not in out and "fixing_op" not in out
