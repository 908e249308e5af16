"""Loading into the registry is one call (``opcontracts.use``); unknown ops say what is near."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import opcontracts
from opcontracts import ContractFileError, UnknownOpError

MINE = '''
[[contract]]
op = "my_scale"
targets = ["mymod_use.scale"]
source = "test"
[contract.args.x]
dtype = "bf16"
'''


def test_use_loads_and_registers_in_one_call(tmp_path: Path):
    f = tmp_path / "mine.toml"
    f.write_text(MINE)
    with pytest.raises(UnknownOpError):
        opcontracts.get_contract("my_scale")
    loaded = opcontracts.use(f)
    assert [c.op for c in loaded] == ["my_scale"]
    assert opcontracts.get_contract("my_scale").file == str(f)

    @opcontracts.enforce("my_scale")
    def scale(x):
        return x

    with opcontracts.mode("strict"), pytest.raises(opcontracts.ContractViolation):
        scale(torch.ones(2))
    assert opcontracts.use(f) == loaded  # the same file again is no conflict
    (tmp_path / "changed.toml").write_text(MINE.replace('"bf16"', '"fp16"'))
    with pytest.raises(opcontracts.OpContractsError, match="replace=True"):
        opcontracts.use(tmp_path / "changed.toml")
    opcontracts.use(tmp_path / "changed.toml", replace=True)
    assert opcontracts.get_contract("my_scale").args["x"].dtype == ("float16",)


def test_use_registers_nothing_when_any_file_is_bad(tmp_path: Path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(MINE)
    bad.write_text('[[contract]]\nop = "y"\n[contract.args.a]\ndtype = "bf17"\n')
    with pytest.raises(ContractFileError) as ei:
        opcontracts.use(good, bad)
    assert ei.value.file == str(bad) and ei.value.field == "args.a.dtype"
    with pytest.raises(UnknownOpError):
        opcontracts.get_contract("my_scale")


def test_use_after_the_patch_guards_the_new_targets(tmp_path: Path):
    (tmp_path / "mymod_use.py").write_text("def scale(x):\n    return x\n")
    (tmp_path / "mine.toml").write_text(MINE)
    code = textwrap.dedent("""
        import torch, opcontracts.patch, mymod_use, opcontracts
        opcontracts.use("mine.toml")
        with opcontracts.mode("strict"):
            mymod_use.scale(torch.ones(2, dtype=torch.bfloat16))
            try:
                mymod_use.scale(torch.ones(2))
            except opcontracts.ContractViolation as exc:
                print("caught", exc.op)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "caught my_scale"


@pytest.mark.parametrize("typo, near", [
    ("npu_moe_token_unpermut", "npu_moe_token_unpermute"),
    ("unpermute", "npu_moe_token_unpermute"),
    ("NPU_SWIGLU", "npu_swiglu"),
])
def test_unknown_op_lists_near_matches_and_how_to_load(typo, near):
    with pytest.raises(UnknownOpError) as ei:
        opcontracts.get_contract(typo)
    assert near in ei.value.near
    assert f"near matches: {near}" in str(ei.value) or f", {near}" in str(ei.value)
    assert "opcontracts.use('FILE.toml')" in str(ei.value)
    assert "OPCONTRACTS_CONTRACTS" in str(ei.value)


def test_unknown_op_without_near_matches_still_says_how_to_load():
    with pytest.raises(UnknownOpError) as ei:
        opcontracts.check("zzqqxx", torch.ones(1))
    assert ei.value.near == () and "near matches" not in str(ei.value)
    assert "opcontracts.use(" in str(ei.value)
