"""The command line speaks to scripts too (issue 13, item 22): ``--version``, ``list --json``,
``list OP_PATTERN``, ``env --json``, and ``list`` loading ``OPCONTRACTS_CONTRACTS`` as a job does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import opcontracts
from opcontracts import cli

USER_CONTRACT = """
[[contract]]
op = "team.fused_router"
targets = ["team_ops.fused_router"]
source = "team wiki, fused_router"

[contract.args.logits]
dtype = "bf16"
shape = "N E"
"""


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    status, out, _ = _main(capsys, *argv)
    assert status == 0
    return json.loads(out)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env.update(extra)
    return env


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out == f"opcontracts {opcontracts.__version__}\n"
    # the console script, without importing torch on the way
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "opcontracts", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout == f"opcontracts {opcontracts.__version__}\n"
    assert " torch\n" not in proc.stderr


def test_list_json_says_what_applies_and_what_is_enforced(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPCONTRACTS_TORCH_NPU_VERSION", "2.13.0")
    monkeypatch.setenv("OPCONTRACTS_CANN_VERSION", "8.0.RC3")
    opcontracts.set_versions()  # re-read the environment
    try:
        data = _json(capsys, "list", "--json")
    finally:
        monkeypatch.delenv("OPCONTRACTS_TORCH_NPU_VERSION")
        monkeypatch.delenv("OPCONTRACTS_CANN_VERSION")
        opcontracts.set_versions()
    assert data["environment"]["cann"]["value"] == "8.0.RC3"
    ops = {o["op"]: o for o in data["ops"]}
    unpermute = ops["npu_moe_token_unpermute"]
    # every contract is listed with its verdict (--all is implied), and why
    verdicts = {c["status"] for c in unpermute["contracts"]}
    assert "applies" in verdicts and "does not apply" in verdicts
    applying = [c for c in unpermute["contracts"] if c["applies"] is True]
    assert len(applying) == 1 and "cann 8.0.RC3" in applying[0]["why"]
    probs = applying[0]["args"]["probs"]
    assert probs["spec"]["dtype"] == ["bfloat16"] and probs["spec"]["optional"] is True
    assert probs["rules"] == "bf16, (N K), optional"
    assert applying[0]["source"] and applying[0]["when"]["cann"]
    assert {t["target"] for t in applying[0]["targets"]} >= {"torch_npu.npu_moe_token_unpermute"}
    assert unpermute["enforced"]["probs"]["spec"]["dtype"] == ["bfloat16"]
    assert data["loaded"] >= len(data["ops"]) and data["pattern"] is None


def test_list_op_pattern_substring_or_glob(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "list", "--json", "UNPERMUTE")  # a substring, case-insensitive
    found = {o["op"] for o in data["ops"]}
    assert {"npu_moe_token_unpermute", "mindspeed.npu_moe_token_unpermute",
            "npu_moe_token_unpermute_grad"} <= found
    assert all("unpermute" in op.lower() for op in found)  # mindspeed.GmmUnpermuteAlltoallv
    data = _json(capsys, "list", "--json", "mindspeed.*")  # a glob
    assert data["ops"] and all(o["op"].startswith("mindspeed.") for o in data["ops"])
    status, out, _ = _main(capsys, "list", "*_grad")
    assert status == 0
    assert "matching '*_grad'" in out.splitlines()[-1]
    assert "\nnpu_moe_token_unpermute\n" not in out
    status, out, err = _main(capsys, "list", "no_such_op")
    assert (status, out) == (1, "")
    assert "no op matches 'no_such_op'" in err


def test_list_loads_opcontracts_contracts_like_a_job(tmp_path: Path) -> None:
    good = tmp_path / "team.toml"
    good.write_text(USER_CONTRACT, encoding="utf-8")
    bad = tmp_path / "broken.toml"
    bad.write_text("[[contract]]\nop = 3\n", encoding="utf-8")
    env = _clean_env(OPCONTRACTS_CONTRACTS=os.pathsep.join([str(good), str(bad)]))
    proc = subprocess.run([sys.executable, "-m", "opcontracts", "list", "--json", "team."],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    [op] = data["ops"]
    assert op["op"] == "team.fused_router"
    assert op["contracts"][0]["file"] == str(good)
    assert op["contracts"][0]["args"]["logits"]["rules"] == "bf16, (N E)"
    assert data["contract_paths"] == [str(good), str(bad)]
    # the bad file is skipped with the patch's warning (naming it), once; list still works
    assert proc.stderr.count("broken.toml") == 1 and "skipped" in proc.stderr
    # and the text listing shows it too
    proc = subprocess.run([sys.executable, "-m", "opcontracts", "list", "fused_router"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "team.fused_router\n  [applies]" in proc.stdout


def test_env_json_shows_versions_mode_and_contract_paths(tmp_path: Path) -> None:
    good = tmp_path / "team.toml"
    good.write_text(USER_CONTRACT, encoding="utf-8")
    missing = tmp_path / "nope"
    env = _clean_env(OPCONTRACTS_MODE="strict", OPCONTRACTS_CANN_VERSION="8.0.RC3",
                     OPCONTRACTS_CONTRACTS=os.pathsep.join([str(good), str(tmp_path),
                                                            str(missing)]))
    proc = subprocess.run([sys.executable, "-m", "opcontracts", "env", "--json"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["opcontracts"] == opcontracts.__version__
    assert data["versions"]["cann"] == {"value": "8.0.RC3", "shown": "8.0.RC3 (= 8.0rc3)",
                                        "origin": "$OPCONTRACTS_CANN_VERSION", "emulated": False}
    assert data["versions"]["torch"]["value"].startswith("2.")
    assert data["mode"] == {"mode": "strict", "by_op": {}, "OPCONTRACTS_MODE": "strict",
                            "error": None}
    assert data["contract_paths"] == [{"path": str(good), "kind": "file"},
                                      {"path": str(tmp_path), "kind": "folder"},
                                      {"path": str(missing), "kind": "not found"}]
    assert data["settings"]["OPCONTRACTS_MODE"] == "strict"
    # the text form says the same
    proc = subprocess.run([sys.executable, "-m", "opcontracts", "env"],
                          capture_output=True, text=True, timeout=60, env=env)
    lines = proc.stdout.splitlines()
    assert any(ln.split()[:3] == ["mode", "strict", "$OPCONTRACTS_MODE"] for ln in lines)
    assert any(ln.startswith("contracts") and str(missing) in ln and "(not found)" in ln
               for ln in lines)


def test_env_names_a_bad_mode_setting(capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # changed after start-up (the start-up itself refuses it: see test_modes)
    monkeypatch.setenv("OPCONTRACTS_MODE", "stirct")
    status, out, _ = _main(capsys, "env", "--json")
    assert status == 2
    mode = json.loads(out)["mode"]
    assert mode["mode"] is None and "OPCONTRACTS_MODE" in mode["error"] and "strict" in mode["error"]
    status, out, _ = _main(capsys, "env")
    assert status == 2 and "mode       invalid" in out


def test_a_bad_contracts_file_on_the_command_line_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[contract]]\nop = "x"\n[contract.args.a]\ndtype = "bf17"\n',
                   encoding="utf-8")
    status, out, err = _main(capsys, "list", "--contracts", str(bad))
    assert status == 2 and out == ""
    assert err.startswith("opcontracts list: ") and "bad.toml" in err and "bf17" in err
