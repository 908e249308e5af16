"""``opcontracts check-dump`` and ``record --from-dump`` on real msprobe dumps.

The dumps under tests/data/msprobe/ were written by mindstudio-probe 26.2.0 itself
(``tests/data/msprobe/make_dumps.py``: a tiny MoE layer on two ranks over the CPU emulation);
they need no msprobe here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from _check_dump_cli import as_json, run

from opcontracts import cli
from opcontracts._tools import msprobe_dump

DATA = Path(__file__).parent / "data" / "msprobe"
WRONG = DATA / "stats_wrong"
CLEAN = DATA / "stats_clean"
TENSOR = DATA / "tensor_wrong"
NPU = DATA / "stats_npu"


def _probs(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in findings if f["argument"] == "probs"]


# ----------------------------------------------------------------- the wrong call, two ranks
def test_two_rank_statistics_dump_names_argument_step_and_ranks(capsys: Any) -> None:
    code, out, _ = run(capsys, WRONG)
    assert code == 1
    rows = [ln for ln in out.splitlines() if "MindSpeed.npu_moe_token_unpermute.0.forward" in ln
            and ln.startswith(("0 ", "1 "))]
    assert len(rows) == 2, out  # one per step, the ranks merged
    for step, row in zip("01", rows):
        cells = row.split()
        assert cells[:6] == [step, "mindspeed.npu_moe_token_unpermute", "probs", "dtype",
                             "bfloat16", "dtype"]
        assert "float32" in row and " 0,1 " in row
    assert "fix:       probs = probs.to(torch.bfloat16)" in out
    assert "make_dumps.py:86 in forward" in out  # the user's frame from stack.json


def test_json_findings(capsys: Any) -> None:
    code, data = as_json(capsys, WRONG)
    assert code == 1
    assert set(data) >= {"findings", "checked", "skipped_ops"}
    assert data["checked"] == 12  # 3 ops x 2 steps x 2 ranks
    found = data["findings"]
    assert [(f["op"], f["argument"], f["rule"], f["expected"], f["step"], f["rank"],
             f["api"], f["verdict"]) for f in found] == [
        ("mindspeed.npu_moe_token_unpermute", "probs", "dtype", "bfloat16", step, [0, 1],
         "MindSpeed.npu_moe_token_unpermute.0.forward", "violation") for step in (0, 1)]
    assert found[0]["got"] == "dtype float32 (shape (4, 2))"
    assert "Tensor.__mul__" in data["skipped_ops"] and "Functional.linear" in data["skipped_ops"]
    assert not any(s.startswith(("NPU.", "MindSpeed.")) for s in data["skipped_ops"])


def test_json_to_a_file_keeps_the_table(capsys: Any, tmp_path: Path) -> None:
    target = tmp_path / "out" / "findings.json"
    code, out, _ = run(capsys, WRONG, "--json", target)
    assert code == 1 and "1 contract violation" not in out and "2 contract violation(s)" in out
    assert json.loads(target.read_text())["checked"] == 12


def test_clean_dump_exits_0(capsys: Any) -> None:
    code, out, _ = run(capsys, CLEAN)
    assert code == 0
    assert "no contract violations." in out
    assert "checked 6 call(s) of 3 op(s)" in out
    code, data = as_json(capsys, CLEAN)
    assert data["findings"] == [] and data["checked"] == 6


def test_tensor_mode_dump(capsys: Any) -> None:
    code, data = as_json(capsys, TENSOR)
    assert code == 1
    assert [(f["argument"], f["step"], f["rank"]) for f in data["findings"]] == [
        ("probs", 0, [0, 1])]


def test_one_rank_folder_and_one_dump_json(capsys: Any) -> None:
    code, data = as_json(capsys, WRONG / "step1" / "rank1")
    assert code == 1
    assert [(f["step"], f["rank"]) for f in data["findings"]] == [(1, [1])]
    assert data["checked"] == 3
    code, data = as_json(capsys, WRONG / "step0" / "rank0" / "dump.json")
    assert code == 1
    assert [(f["step"], f["rank"]) for f in data["findings"]] == [(0, [0])]


def test_one_step_folder(capsys: Any) -> None:
    code, data = as_json(capsys, WRONG / "step1")
    assert code == 1 and [f["step"] for f in data["findings"]] == [1]


def test_a_rank_that_alone_saw_it(capsys: Any, tmp_path: Path) -> None:
    """Merged as ``report merge`` merges: the ranks that saw each violation."""
    dump = tmp_path / "dump"
    shutil.copytree(WRONG / "step0" / "rank0", dump / "step0" / "rank0")
    shutil.copytree(CLEAN / "step0" / "rank1", dump / "step0" / "rank1")
    code, out, _ = run(capsys, dump)
    assert code == 1
    assert "ranks 0,1" not in out and "rank 0 only (not rank 1)" in out


# ----------------------------------------------------------------- versions
def test_version_dependent_rule_is_conditional(capsys: Any) -> None:
    """torch_npu's unpermute takes fp32 probs on CANN >= 8.0.0 with the 2.13 docs, bf16 only
    before: with the versions unknown, fp32 probs is a conditional verdict, not a violation."""
    code, data = as_json(capsys, NPU)
    assert code == 0
    (f,) = _probs(data["findings"])
    assert f["verdict"] == "conditional" and f["op"] == "npu_moe_token_unpermute"
    assert any("cann" in d for d in f["depends_on"])
    code, out, _ = run(capsys, NPU)
    assert "no contract violations." in out and "1 conditional" in out


def test_flags_decide_the_versions(capsys: Any) -> None:
    code, data = as_json(capsys, NPU, "--torch-npu", "2.13.0", "--cann", "8.0.RC3")
    assert code == 1
    (f,) = _probs(data["findings"])
    assert f["verdict"] == "violation" and f["expected"] == "bfloat16"
    code, data = as_json(capsys, NPU, "--torch-npu", "2.13.0", "--cann", "8.5.0")
    assert code == 0 and data["findings"] == []
    assert [(s["torch_npu"], s["cann"]) for s in data["stacks"]] == [("2.13.0", "8.5.0")]


def test_flags_win_over_environment(capsys: Any, monkeypatch: Any) -> None:
    from opcontracts._lang import versions

    monkeypatch.setenv("OPCONTRACTS_CANN_VERSION", "8.0.RC3")
    monkeypatch.setenv("OPCONTRACTS_TORCH_NPU_VERSION", "2.13.0")
    versions.refresh()
    try:
        assert as_json(capsys, NPU)[0] == 1
        assert as_json(capsys, NPU, "--cann", "8.5.0")[0] == 0
        code, data = as_json(capsys, NPU, "--cann", "unknown")  # forced unknown: conditional
        assert code == 0 and [f["verdict"] for f in _probs(data["findings"])] == ["conditional"]
    finally:
        monkeypatch.undo()
        versions.refresh()


def test_targets_decide_when_no_flag_is_given(capsys: Any, monkeypatch: Any,
                                              tmp_path: Path) -> None:
    """flags > targets (``[tool.opcontracts]``, ``OPCONTRACTS_TARGETS``) > detection."""
    monkeypatch.delenv("OPCONTRACTS_TARGETS", raising=False)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.opcontracts]\ntargets = [{torch_npu = "2.13.0", cann = "8.0.RC3", name = "old"}]\n')
    monkeypatch.chdir(tmp_path)
    code, data = as_json(capsys, NPU)
    assert code == 1 and [f["verdict"] for f in _probs(data["findings"])] == ["violation"]
    assert data["stacks"][0]["label"].startswith("target 'old'")
    assert as_json(capsys, NPU, "--torch-npu", "2.13.0", "--cann", "8.5.0")[0] == 0  # flags win
    monkeypatch.setenv("OPCONTRACTS_TARGETS", "torch_npu=2.13.0,cann=8.5.0")  # over the file
    assert as_json(capsys, NPU)[0] == 0


def test_several_targets_name_the_one_that_rejects(capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("OPCONTRACTS_TARGETS", "torch_npu=2.13.0,cann=8.5.0,name=new;"
                       "torch_npu=2.13.0,cann=8.0.RC3,name=old")
    code, out, _ = run(capsys, NPU)
    assert code == 1
    assert "rejected on: target 'old' (torch_npu 2.13.0, cann 8.0.RC3)" in out
    assert "judged for target 'new'" in out and "judged for target 'old'" in out


# ----------------------------------------------------------------- binding and naming
def _edit(src: Path, dest: Path, api: str, change: Any) -> Path:
    """A copy of the rank folder ``src`` with ``change`` applied to its entry ``api``."""
    shutil.copytree(src, dest)
    p = dest / "dump.json"
    data = json.loads(p.read_text())
    change(data["data"][api])
    p.write_text(json.dumps(data))
    return dest


def test_positional_inputs_bind_by_the_schema(capsys: Any, tmp_path: Path) -> None:
    """npu_rms_norm(self, gamma, epsilon=...): a gamma (the second positional input) in
    another dtype than self breaks gamma's same-dtype rule."""
    def fp32_gamma(entry: dict[str, Any]) -> None:
        entry["input_args"][1]["dtype"] = "torch.float32"

    rank = _edit(CLEAN / "step0" / "rank0", tmp_path / "rank0", "NPU.npu_rms_norm.0.forward",
                 fp32_gamma)
    code, data = as_json(capsys, rank)
    assert code == 1
    (f,) = data["findings"]
    assert (f["op"], f["argument"], f["rule"]) == ("npu_rms_norm", "gamma", "same_dtype")
    assert f["expected"].startswith("the dtype of self (bfloat16)")


def test_keyword_inputs_bind_by_name(capsys: Any, tmp_path: Path) -> None:
    def gamma_as_keyword(entry: dict[str, Any]) -> None:
        gamma = entry["input_args"].pop(1)
        gamma["shape"] = [7]
        entry["input_kwargs"]["gamma"] = gamma

    rank = _edit(CLEAN / "step0" / "rank0", tmp_path / "rank0", "NPU.npu_rms_norm.0.forward",
                 gamma_as_keyword)
    code, data = as_json(capsys, rank)
    assert code == 1
    (f,) = data["findings"]
    assert (f["argument"], f["rule"]) == ("gamma", "shape")


def test_dump_with_no_op_that_has_a_contract_says_nothing_was_checked(capsys: Any,
                                                                      tmp_path: Path) -> None:
    rank = tmp_path / "rank0"
    rank.mkdir()
    data = json.loads((CLEAN / "step0" / "rank0" / "dump.json").read_text())
    data["data"] = {k: v for k, v in data["data"].items() if k.startswith(("Torch", "Tensor"))}
    (rank / "dump.json").write_text(json.dumps(data))
    code, out, _ = run(capsys, rank)
    assert code == 0
    assert "nothing was checked" in out and "no contract violations" not in out


def test_custom_api_with_a_user_contract(capsys: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """``register_custom_api(mypkg.ops, "fused_scale")``: msprobe names it with the module as
    prefix; a user's contract guarding ``mypkg.ops.fused_scale`` judges it."""
    contract = tmp_path / "mine.toml"
    contract.write_text('[[contract]]\nop = "fused_scale"\ntargets = ["mypkg.ops.fused_scale"]\n'
                        'source = "test"\n[contract.args.x]\ndtype = "bf16"\nshape = "N H"\n')
    monkeypatch.setenv("OPCONTRACTS_CONTRACTS", str(contract))
    rank = tmp_path / "rank0"
    rank.mkdir()
    tensor = {"type": "torch.Tensor", "dtype": "torch.float16", "shape": [4, 8]}
    (rank / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "data": {
        "mypkg.ops.fused_scale.0.forward": {"input_args": [tensor], "input_kwargs": {},
                                            "output": [tensor]}}}))
    code, data = as_json(capsys, rank)
    assert code == 1
    assert [(f["op"], f["argument"], f["api"]) for f in data["findings"]] == [
        ("fused_scale", "x", "mypkg.ops.fused_scale.0.forward")]


def test_api_names() -> None:
    p = msprobe_dump.parse_api_name
    assert p("NPU.npu_moe_token_unpermute.0.forward") == ("NPU", "npu_moe_token_unpermute",
                                                         "forward")
    assert p("MindSpeed.npu_gmm.3.backward") == ("MindSpeed", "npu_gmm", "backward")
    assert p("Tensor.__mul__.12.forward") == ("Tensor", "__mul__", "forward")
    assert p("mypkg.ops.fused.1.forward") == ("mypkg.ops", "fused", "forward")
    assert p("Module.layers.0.mlp.MoELayer.forward.0")[2] == ""


def test_old_stack_json_layout(tmp_path: Path) -> None:
    """Before msprobe 8, stack.json mapped each API to its frames."""
    rank = tmp_path / "rank3"
    shutil.copytree(WRONG / "step0" / "rank0", rank)
    new = json.loads((rank / "stack.json").read_text())
    (rank / "stack.json").write_text(json.dumps({api: frames for apis, frames in new.values()
                                                 for api in apis}))
    d = msprobe_dump.read_rank_dump(rank / "dump.json")
    assert d.rank == 3 and d.step is None
    assert d.frames["MindSpeed.npu_moe_token_unpermute.0.forward"] == \
        "tests/data/msprobe/make_dumps.py:86 in forward"


# ----------------------------------------------------------------- bad input: exit 2, one line
@pytest.mark.parametrize("make, says", [
    (lambda p: p / "missing", "no such file or folder"),
    (lambda p: p, "no msprobe dump here"),
    (lambda p: _write(p / "dump.json", "{not json"), "not JSON"),
    (lambda p: _write(p / "dump.json", "[1, 2]"), "not an msprobe dump.json"),
    (lambda p: _write(p / "dump.json", '{"task": "statistics"}'), "not an msprobe dump.json"),
    (lambda p: _write(p / "dump.json", '{"data": {"NPU.x.0.forward": 3}}'), "expected an object"),
    (lambda p: _write(p / "rank0" / "dump.json", b"\xff\xfe\x00"), "not a text file"),
])
def test_malformed_input_exits_2_with_one_line(capsys: Any, tmp_path: Path, make: Any,
                                               says: str) -> None:
    path = make(tmp_path)
    code, out, err = run(capsys, path)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("opcontracts check-dump: ") and says in err
    assert "Traceback" not in err
    assert str(path) in err or str(tmp_path) in err


def test_malformed_stack_json_names_it(capsys: Any, tmp_path: Path) -> None:
    rank = tmp_path / "rank0"
    shutil.copytree(CLEAN / "step0" / "rank0", rank)
    (rank / "stack.json").write_text("[]")
    code, _, err = run(capsys, rank)
    assert code == 2 and "stack.json" in err and len(err.strip().splitlines()) == 1


def _write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# ----------------------------------------------------------------- record --from-dump
def test_record_from_a_golden_dump(capsys: Any, tmp_path: Path) -> None:
    from opcontracts.spec import load_contracts

    out = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(CLEAN), "-o", str(out)]) == 0
    capsys.readouterr()
    contracts = {c.op: c for c in load_contracts(out)}
    assert set(contracts) == {"mindspeed.npu_moe_token_permute",
                              "mindspeed.npu_moe_token_unpermute", "npu_rms_norm"}
    unpermute = contracts["mindspeed.npu_moe_token_unpermute"]
    assert unpermute.args["probs"].dtype == ("bfloat16",)
    assert unpermute.args["permuted_tokens"].rank == (2,)
    assert unpermute.targets == ("mindspeed.ops.npu_moe_token_unpermute.npu_moe_token_unpermute",)
    assert "msprobe dump" in (unpermute.source or "")


def test_a_golden_file_from_a_dump_flags_drift(capsys: Any, tmp_path: Path) -> None:
    """Golden run: torch_npu's unpermute with bf16 probs.  On torch_npu 2.13 / CANN 8.5 the
    shipped contract takes fp32 probs too; the golden file does not."""
    golden_dump = tmp_path / "golden"
    for rank in ("rank0", "rank1"):
        def bf16_probs(entry: dict[str, Any]) -> None:
            entry["input_args"][2]["dtype"] = "torch.bfloat16"

        _edit(NPU / "step0" / rank, golden_dump / "step0" / rank,
              "NPU.npu_moe_token_unpermute.0.forward", bf16_probs)
    versions = ["--torch-npu", "2.13.0", "--cann", "8.5.0"]
    golden = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(golden_dump), "-o", str(golden), *versions]) == 0
    assert "6 call(s) of 3 op(s) recorded" in capsys.readouterr().err
    assert as_json(capsys, NPU, *versions)[0] == 0  # the shipped rules alone: fine
    code, data = as_json(capsys, NPU, *versions, "--contracts", golden)
    assert code == 1
    assert [(f["op"], f["argument"], f["expected"]) for f in data["findings"]] == [
        ("npu_moe_token_unpermute", "probs", "bfloat16")]


def test_record_leaves_violating_calls_out(capsys: Any, tmp_path: Path) -> None:
    out = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(WRONG), "-o", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("opcontracts record: MindSpeed.npu_moe_token_unpermute.0.forward")
    assert "(probs: dtype, expected bfloat16, got dtype float32 (shape (4, 2)))" in err[0]
    assert "left out of the golden file" in err[0]
    from opcontracts.spec import load_contracts

    ops = {c.op: c for c in load_contracts(out)}
    assert "mindspeed.npu_moe_token_unpermute" not in ops  # every call of it broke its contract
    assert "left out" in out.read_text()
    assert cli.main(["record", "--from-dump", str(WRONG), "-o", str(out),
                     "--record-violations"]) == 0
    assert "recorded anyway (--record-violations)" in capsys.readouterr().err
    ops = {c.op: c for c in load_contracts(out)}
    assert ops["mindspeed.npu_moe_token_unpermute"].args["probs"].dtype == ("float32",)


def test_module_entries_of_a_mix_level_dump_are_skipped_by_kind(capsys: Any,
                                                                tmp_path: Path) -> None:
    """Level ``mix`` / ``L0`` adds module entries (``Module.<path>.<Class>.forward.<n>``):
    counted under their kind, the API entries judged as before."""
    rank = tmp_path / "rank0"
    shutil.copytree(WRONG / "step0" / "rank0", rank)
    data = json.loads((rank / "dump.json").read_text())
    entry = {"input_args": [], "input_kwargs": {}, "output": []}
    data["data"] = {"Module.layers.0.mlp.MoE.forward.0": entry,
                    "Module.layers.1.mlp.MoE.forward.0": entry, **data["data"]}
    (rank / "dump.json").write_text(json.dumps(data))
    code, data = as_json(capsys, rank)
    assert code == 1 and data["checked"] == 3
    assert "Module" in data["skipped_ops"]
    assert not any(s.startswith("Module.") for s in data["skipped_ops"])


@pytest.mark.parametrize("flag, value", [("--cann", "banana"), ("--torch-npu", "two"),
                                         ("--soc", " ")])
def test_a_version_flag_that_is_not_one_is_a_usage_error(capsys: Any, flag: str,
                                                         value: str) -> None:
    code, out, err = run(capsys, CLEAN, flag, value)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"opcontracts check-dump: {flag}")


def test_entries_without_inputs_are_not_judged(capsys: Any, tmp_path: Path) -> None:
    """msprobe's ``data_mode = ["output"]`` records outputs only: no input is no violation,
    and no clean bill either (exit status 3: nothing could be judged)."""
    rank = tmp_path / "rank0"
    shutil.copytree(WRONG / "step0" / "rank0", rank)
    data = json.loads((rank / "dump.json").read_text())
    for entry in data["data"].values():
        entry.pop("input_args", None)
        entry.pop("input_kwargs", None)
    (rank / "dump.json").write_text(json.dumps(data))
    code, out, _ = run(capsys, rank)
    assert code == 3 and "nothing could be judged" in out and "no contract violations" not in out
    assert "not judged: 3 call(s) of 3 op(s)" in out
    assert "npu_rms_norm: the whole call: inputs not recorded (msprobe's data_mode): 1 call(s)" \
        in out


MSPROBE_PYTHON = "OPCONTRACTS_MSPROBE_PYTHON"


def test_fresh_dumps_from_msprobe_itself(tmp_path: Path, capsys: Any) -> None:
    """Opt-in: make the dumps anew with mindstudio-probe (a venv of its own, ~0.5 GB of
    dependencies) and check them as the committed ones are checked."""
    import os
    import subprocess

    python = os.environ.get(MSPROBE_PYTHON)
    if not python:
        pytest.skip(f"set {MSPROBE_PYTHON} to a python with mindstudio-probe and this checkout "
                    "installed (python -m venv --system-site-packages V && V/bin/pip install "
                    "mindstudio-probe==26.2.0 && V/bin/pip install -e . --no-deps)")
    subprocess.run([python, str(DATA / "make_dumps.py"), "stats_wrong", "stats_clean",
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=600)
    code, data = as_json(capsys, tmp_path / "stats_wrong")
    assert code == 1
    assert [(f["argument"], f["step"], f["rank"]) for f in data["findings"]] == [
        ("probs", 0, [0, 1]), ("probs", 1, [0, 1])]
    assert as_json(capsys, tmp_path / "stats_clean")[0] == 0


def test_a_job_without_ranks(capsys: Any, tmp_path: Path) -> None:
    """Without a process group msprobe names the folder after the process: ``proc{PID}``."""
    shutil.copytree(WRONG / "step0" / "rank1", tmp_path / "step0" / "proc4242")
    code, data = as_json(capsys, tmp_path)
    assert code == 1
    assert [(f["step"], f["rank"]) for f in data["findings"]] == [(0, [])]


def test_the_same_verdict_as_the_guard_on_the_live_call(npu: Any, capsys: Any) -> None:
    """The call the dump recorded, made for real through the patched MindSpeed op in strict
    mode, fails on the rule check-dump names, with the same expectation and the same got."""
    import torch
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute

    import opcontracts

    _, data = as_json(capsys, WRONG / "step0" / "rank0")
    (f,) = data["findings"]
    opcontracts.set_mode("strict")
    tokens = torch.randn(8, 8).to(torch.bfloat16)
    with pytest.raises(opcontracts.ContractViolation) as info:
        npu_moe_token_unpermute(tokens, torch.arange(8, dtype=torch.int32),
                                torch.rand(4, 2, dtype=torch.float32))
    e = info.value
    assert (e.op, e.arg, e.rule, e.expected, e.got) == (
        f["op"], f["argument"], f["rule"], f["expected"], f["got"])
