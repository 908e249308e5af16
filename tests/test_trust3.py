"""The newer surfaces under bad input, and what a new user tripped on.  Each test is named
after the item of the review list it proves (item N) and failed on the code before its fix."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import traceback
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trust import _unpermute_args  # the incident's call: bf16 tokens, probs as given

import opcontracts
from opcontracts import Arg, Contract, ContractFileError, ContractViolation
from opcontracts.cli import main as cli_main
from opcontracts.spec import Case

ROOT = Path(__file__).resolve().parent.parent


def _private(new: str, old: str) -> Any:
    """A private module, where the layer packages put it (issue 21) or where it was."""
    import importlib

    try:
        return importlib.import_module(f"opcontracts.{new}")
    except ImportError:
        return importlib.import_module(f"opcontracts.{old}")


def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``opcontracts ARGV`` in this process: (exit status, stdout, stderr).  Any exception
    escaping ``main`` is a traceback a user would see, and fails the test."""
    try:
        rc = cli_main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


def _one_error_line(err: str, *needles: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines, "no error message"
    text = "\n".join(lines)
    for n in needles:
        assert n in text, (n, text)


MS_UNPERMUTE = "mindspeed.npu_moe_token_unpermute"
# a user's file that would widen MindSpeed's bf16-only probs to fp32 if it replaced the rule
WIDER_PROBS = f"""
[[contract]]
op = "{MS_UNPERMUTE}"
signature = ["permuted_tokens", "sorted_indices", "probs", "padded_mode", "restore_shape"]
[contract.args.probs]
dtype = ["bf16", "fp32"]
optional = true
"""


# --------------------------------------------------------------------------- item 1
def _user_file(tmp_path: Path, body: str, name: str = "user.toml") -> Path:
    p = tmp_path / name
    p.write_text(body, encoding="utf-8")
    return p


def test_item01_user_file_adds_to_shipped_rules(tmp_path: Path) -> None:
    """A user contract for a shipped op with the same (no) ``when`` used to replace the
    shipped one: fp32 probs, which MindSpeed's kernel computes wrong, passed strict mode."""
    f = _user_file(tmp_path, WIDER_PROBS)
    opcontracts.set_mode("strict")
    opcontracts.use(f)
    with pytest.raises(ContractViolation, match="probs"):
        opcontracts.check(MS_UNPERMUTE, *_unpermute_args(torch.float32))
    opcontracts.check(MS_UNPERMUTE, *_unpermute_args(torch.bfloat16))


def test_item01_same_verdict_whichever_pack_loads_first(tmp_path: Path) -> None:
    f = _user_file(tmp_path, WIDER_PROBS)
    verdicts = []
    for shipped_first in (True, False):
        _private("_engine.registry", "_registry").clear()
        if shipped_first:
            _private("_engine.registry", "_registry").load_shipped()
        opcontracts.use(f)
        try:
            opcontracts.check(MS_UNPERMUTE, *_unpermute_args(torch.float32))
            verdicts.append("accepted")
        except ContractViolation:
            verdicts.append("rejected")
    assert verdicts == ["rejected", "rejected"]


def test_item01_disjoint_dtypes_are_a_load_error_naming_both_files(tmp_path: Path) -> None:
    f = _user_file(tmp_path, f"""
[[contract]]
op = "{MS_UNPERMUTE}"
signature = ["permuted_tokens", "sorted_indices", "probs", "padded_mode", "restore_shape"]
[contract.args.probs]
dtype = ["fp32"]
""")
    with pytest.raises(ContractFileError) as info:
        opcontracts.use(f)
    text = str(info.value)
    assert str(f) in text and "moe_token_permute.toml" in text and "probs" in text
    assert "replace = true" in text  # says how to mean it


def test_item01_replace_true_replaces_the_shipped_rules(tmp_path: Path) -> None:
    f = _user_file(tmp_path, f"""
[[contract]]
op = "{MS_UNPERMUTE}"
replace = true
signature = ["permuted_tokens", "sorted_indices", "probs", "padded_mode", "restore_shape"]
[contract.args.probs]
dtype = ["fp32"]
""")
    opcontracts.set_mode("strict")
    opcontracts.use(f)
    opcontracts.check(MS_UNPERMUTE, *_unpermute_args(torch.float32))
    with pytest.raises(ContractViolation, match="probs"):
        opcontracts.check(MS_UNPERMUTE, *_unpermute_args(torch.bfloat16))


def test_item01_recorder_leaves_out_violations_and_warns(npu: Any, tmp_path: Path) -> None:
    from opcontracts.record import Recorder

    rec = Recorder()
    with rec, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        npu.npu_moe_token_unpermute(*_unpermute_args(torch.float32))  # warn mode: runs
        npu.npu_moe_token_unpermute(*_unpermute_args(torch.bfloat16))
    texts = [str(w.message) for w in caught]
    assert any(t.startswith("opcontracts.record") and "probs" in t and "npu_moe_token_unpermute" in t
               for t in texts), texts
    out = rec.write(tmp_path / "golden.toml")
    loaded = opcontracts.load_contracts(out)
    probs = next(c for c in loaded if c.op == "npu_moe_token_unpermute").args["probs"]
    assert probs.dtype == ("bfloat16",)

    rec2 = Recorder(record_violations=True)
    with rec2, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        npu.npu_moe_token_unpermute(*_unpermute_args(torch.float32))
    loaded = opcontracts.load_contracts(rec2.write(tmp_path / "all.toml"))
    assert loaded[0].args["probs"].dtype == ("float32",)


def test_item01_run_takes_record_violations(capsys: Any) -> None:
    _run = _private("_tools.run", "_run")

    assert _run.parse(["--record", "g.toml", "--record-violations", "x.py"]).record_violations


# --------------------------------------------------------------------------- item 2
def _scalar_contract(op: str) -> Contract:
    return Contract(op, {"x": Arg("fp32"), "mode": Arg(allowed=[0, 1])},
                    cases=[Case.model_validate({"if": {"mode": 1},
                                                "args": {"x": {"rank": 1}}})])


@pytest.mark.parametrize("mode", ["warn", "strict", "fix"])
def test_item02_tensor_in_allowed_or_case_argument_is_a_violation(mode: str) -> None:
    c = _scalar_contract(f"trust3_item02_{mode}")

    @opcontracts.enforce(c)
    def f(x: torch.Tensor, mode: Any = 0) -> torch.Tensor:
        return x

    opcontracts.set_mode(mode)
    bad = torch.tensor([0, 1])
    if mode != "warn":  # fix mode cannot repair a value: it refuses the call as strict does
        with pytest.raises(ContractViolation, match="mode"):
            f(torch.ones(2), bad)
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f(torch.ones(2), bad)
        assert any("mode" in str(w.message) for w in caught)
    with pytest.raises(ContractViolation, match="mode"):
        opcontracts.check(c, torch.ones(2), bad)


# --------------------------------------------------------------------------- item 3
def test_item03_targets_differing_in_defaults_get_their_own_checker() -> None:
    c = Contract("trust3_item03", {"x": Arg("fp32", rank=[1, 2]), "mode": Arg(allowed=[0, 1])},
                 cases=[Case.model_validate({"if": {"mode": 1}, "args": {"x": {"rank": 1}}})])
    opcontracts.set_mode("strict")
    guard = opcontracts.enforce(c)

    def zero(x: torch.Tensor, mode: int = 0) -> torch.Tensor:
        return x

    def one(x: torch.Tensor, mode: int = 1) -> torch.Tensor:
        return x

    z, o = guard(zero), guard(one)
    z(torch.ones(2, 2))  # mode 0: rank 2 is fine
    with pytest.raises(ContractViolation, match="rank"):
        o(torch.ones(2, 2))  # mode 1 (its default): rank 1 only


# --------------------------------------------------------------------------- item 4
class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the kernel's backward failed")


def test_item04_a_backward_that_raises_leaves_no_stale_outer_record() -> None:
    first = Contract("trust3_item04a", {"x": Arg("bf16")})
    second = Contract("trust3_item04b", {"y": Arg("bf16")})

    @opcontracts.enforce(first)
    def a(x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(x)

    @opcontracts.enforce(second)
    def b(y: torch.Tensor) -> torch.Tensor:
        return y

    opcontracts.set_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = a(torch.ones(2, requires_grad=True))
    with pytest.raises(RuntimeError, match="backward failed"):
        out.sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b(torch.ones(2))
    assert any("trust3_item04b" in str(w.message) for w in caught)
    assert any(r.op == "trust3_item04b" for r in opcontracts.report().records)


# --------------------------------------------------------------------------- item 5
def test_item05_allowed_listing_none_accepts_none() -> None:
    c = Contract("trust3_item05", {"flag": Arg(allowed=[False, None])})
    opcontracts.check(c, None)
    opcontracts.check(c, False)
    with pytest.raises(ContractViolation):
        opcontracts.check(c, True)
    from_file = opcontracts.spec.contracts_from_toml(
        '[[contract]]\nop = "t5"\n[contract.args.flag]\nallowed = [false]\noptional = true\n')
    opcontracts.check(from_file[0], None)


# --------------------------------------------------------------------------- item 6
@pytest.mark.parametrize("mode", ["fix", "strict"])
def test_item06_run_report_says_the_run_mode(mode: str, tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    report = tmp_path / "r.json"
    rc, _, _ = cli(capsys, "run", "--mode", mode, "--report", str(report), str(script))
    assert rc == 0
    assert json.loads(report.read_text())["metadata"]["mode"] == mode


# --------------------------------------------------------------------------- item 8
def _wheel(tmp_path: Path, version: str = "9.1.0", **kw: Any) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_wheel_digest import make_wheel
    finally:
        sys.path.pop(0)
    return make_wheel(tmp_path / "w", version, **kw)  # type: ignore[no-any-return]


def _rewrite_member(whl: Path, member: str, data: bytes) -> None:
    with zipfile.ZipFile(whl) as z:
        items = {i.filename: z.read(i) for i in z.infolist()}
    items[member] = data
    with zipfile.ZipFile(whl, "w") as z:
        for k, v in items.items():
            z.writestr(k, v)


def test_item08_member_failing_its_crc_is_a_clean_error(tmp_path: Path, capsys: Any) -> None:
    from opcontracts.wheel import _source

    w = _wheel(tmp_path)
    raw = bytearray(w.read_bytes())
    name = _source.PATHS["docs"].encode()
    at = raw.index(name, raw.index(name) + 1) if raw.count(name) > 1 else raw.index(name)
    # the local header's file name is followed by the data: flip a byte of the data
    first = raw.index(name)
    raw[first + len(name) + 5] ^= 0xFF
    w.write_bytes(bytes(raw))
    del at
    rc, _, err = cli(capsys, "wheel", "digest", str(w), "-o", str(tmp_path / "d.json.gz"))
    assert rc == 2
    _one_error_line(err, str(w))


@pytest.mark.parametrize("what", ["syntax", "nul"])
def test_item08_docs_that_do_not_parse_are_a_clean_error(what: str, tmp_path: Path,
                                                         capsys: Any) -> None:
    from opcontracts.wheel import _source

    w = _wheel(tmp_path)
    bad = b"def (:\n" if what == "syntax" else b"x = 1\x00\n"
    _rewrite_member(w, _source.PATHS["docs"], bad)
    rc, _, err = cli(capsys, "wheel", "digest", str(w), "-o", str(tmp_path / "d.json.gz"))
    assert rc == 2
    _one_error_line(err, str(w))


def test_item08_metadata_version_that_is_no_version(tmp_path: Path, capsys: Any) -> None:
    w = _wheel(tmp_path)
    _rewrite_member(w, "torch_npu-9.1.0.dist-info/METADATA",
                    b"Metadata-Version: 2.1\nName: torch_npu\nVersion: banana\n")
    rc, _, err = cli(capsys, "wheel", "digest", str(w), "-o", str(tmp_path / "d.json.gz"))
    assert rc == 2
    _one_error_line(err, "banana")


def test_item08_digest_into_a_missing_folder_and_json_to_unwritable(tmp_path: Path,
                                                                   capsys: Any) -> None:
    w = _wheel(tmp_path)
    out = tmp_path / "new" / "folder" / "d.json.gz"
    rc, _, err = cli(capsys, "wheel", "digest", str(w), "-o", str(out))
    assert rc == 0 and out.exists(), err
    rc, _, err = cli(capsys, "wheel", "verify", "--digest", str(out), "--no-shipped",
                     "--json", str(tmp_path / "missing" / "x" / "\0bad.json"))
    assert rc == 2


def test_item08_draft_onto_a_file_is_a_clean_error(tmp_path: Path, capsys: Any) -> None:
    w = _wheel(tmp_path)
    target = tmp_path / "a_file"
    target.write_text("x")
    rc, _, err = cli(capsys, "wheel", "draft", str(w), "-o", str(target))
    assert rc == 2
    _one_error_line(err, str(target))


def test_item08_digest_with_a_bad_release(tmp_path: Path, capsys: Any) -> None:
    w = _wheel(tmp_path)
    d = tmp_path / "d.json.gz"
    assert cli(capsys, "wheel", "digest", str(w), "-o", str(d))[0] == 0
    for spec in (f"{d}@7.7.7", f"{d}@", f"{d}@not-a-version"):
        rc, _, err = cli(capsys, "wheel", "diff", spec, f"{d}@9.1.0")
        assert rc == 2, (spec, err)
        _one_error_line(err)


def test_item08_verify_op_matching_nothing_is_not_a_pass(capsys: Any) -> None:
    rc, out, err = cli(capsys, "wheel", "verify", "--op", "no_such_op_anywhere*")
    assert rc == 2
    assert "pass" not in out
    _one_error_line(err, "no_such_op_anywhere")


def test_item08_doc_line_with_a_control_character_drafts_a_loading_file(tmp_path: Path,
                                                                       capsys: Any) -> None:
    w = _wheel(tmp_path, dtypes="float16、bfloat16\x1b\x7f")
    out = tmp_path / "drafts"
    rc, _, err = cli(capsys, "wheel", "draft", str(w), "-o", str(out), "--all-ops")
    assert rc == 0, err
    files = sorted(out.glob("*.toml"))
    assert files
    for f in files:
        opcontracts.load_contracts(f)


# --------------------------------------------------------------------------- item 9
def test_item09_probe_typo_lists_near_matches(capsys: Any) -> None:
    rc, _, err = cli(capsys, "probe", "npu_moe_token_unpermte")
    assert rc == 2
    assert "npu_moe_token_unpermute" in err
    assert err.count(",") < 10  # near matches, not all 59 names


def test_item09_probe_outputs_to_unwritable_paths_exit_2(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "file"
    bad.write_text("x")
    for flag in ("--write-contract", "--json"):
        rc, _, err = cli(capsys, "probe", "npu_swiglu", flag, str(bad / "sub" / "out"))
        assert rc == 2, (flag, err)
        _one_error_line(err, flag)


def test_item09_probe_contract_loads_and_names_what_its_when_pins(tmp_path: Path,
                                                                  capsys: Any) -> None:
    out = tmp_path / "m.toml"
    rc, _, err = cli(capsys, "probe", "npu_swiglu", "--write-contract", str(out))
    assert rc in (0, 1), err
    (c,) = opcontracts.load_contracts(out)
    assert c.when is not None and c.when.torch_npu
    assert "torch_npu unknown" not in (c.source or "")


def test_item09_contract_with_no_correct_dtype_still_loads(tmp_path: Path) -> None:
    dumps_contracts = _private("_observers.contract_out", "_contract_out").dumps_contracts

    text = dumps_contracts([{"op": "x", "targets": ["m.f"], "source": "s", "args": {}}])
    assert opcontracts.spec.contracts_from_toml(text) == [] and "x: not written" in text


# --------------------------------------------------------------------------- item 10
def test_item10_record_var_positional_and_ruleless_ops_load(npu: Any, tmp_path: Path) -> None:
    _observe = _private("_observers.layer", "_observe")
    from opcontracts.record import Recorder

    mod = type(sys)("trust3_item10_mod")

    def f(x: Any, *args: Any, **kwargs: Any) -> Any:
        return x

    def g(obj: Any) -> Any:
        return obj

    mod.f, mod.g = f, g  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        rec = Recorder(watch={"rf": "trust3_item10_mod.f", "rg": "trust3_item10_mod.g"})
        with rec:
            mod.f(torch.ones(2), torch.ones(2, dtype=torch.int64), flag=True)
            mod.g(object())
        assert rec.calls() == {"rf": 1, "rg": 1}
        text = rec.write(tmp_path / "g.toml").read_text()
        (c,) = opcontracts.load_contracts(tmp_path / "g.toml")
        assert c.op == "rf" and set(c.args) == {"x"}  # not *args' elements, not **kwargs'
        assert "rg: not written" in text
    finally:
        sys.modules.pop(mod.__name__, None)
        del _observe


def test_item10_record_target_that_cannot_resolve_is_said(tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "s.py"
    script.write_text("def route(x):\n    return x\nroute(1)\n")
    rc, _, err = cli(capsys, "run", "--record", str(tmp_path / "g.toml"), "--record-target",
                     "__main__.route", str(script))
    assert "__main__.route" in err and ("cannot" in err or "not" in err), err


# --------------------------------------------------------------------------- item 11
@pytest.mark.parametrize("when", ['{torch_npu = ">=2.1 ||"}', '{torch_npu = "|| >=2.1"}',
                                  '{soc = []}', '{cann = []}'])
def test_item11_empty_alternatives_are_load_errors(when: str) -> None:
    text = f'[[contract]]\nop = "t11"\nwhen = {when}\n[contract.args.x]\ndtype = "bf16"\n'
    with pytest.raises(ContractFileError, match="when"):
        opcontracts.spec.contracts_from_toml(text, "f.toml")


# --------------------------------------------------------------------------- item 12
def test_item12_register_replace_cycles_keep_bounded_caches() -> None:
    import linecache

    _enforce = _private("_engine.enforce", "_enforce")

    c0 = Contract("trust3_item12", {"x": Arg("fp32")})
    opcontracts.register(c0, replace=True)

    @opcontracts.enforce("trust3_item12")
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    f(torch.ones(1))
    lines0, cache0 = len(linecache.cache), len(_enforce._compiled_cache)
    for i in range(400):
        opcontracts.register(Contract("trust3_item12", {"x": Arg("fp32")}, source=f"v{i}"),
                             replace=True)
        f(torch.ones(1))
        opcontracts.check("trust3_item12", torch.ones(1))
    gc.collect()
    assert len(_enforce._compiled_cache) - cache0 < 20
    assert len(linecache.cache) - lines0 < 20


# --------------------------------------------------------------------------- item 13
def test_item13_run_report_unwritable_is_said_before_the_work(tmp_path: Path,
                                                              capsys: Any) -> None:
    script = tmp_path / "s.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for flag in ("--report", "--record"):
        rc, _, err = cli(capsys, "run", flag, str(blocker / "r.json"), str(script))
        assert rc == 2, err
        _one_error_line(err, flag)
        assert not marker.exists()


def test_item13_demo_json_unwritable_is_said_before_the_work(tmp_path: Path,
                                                             capsys: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, out, err = cli(capsys, "demo", "--json", str(blocker / "d.json"))
    assert rc == 2
    _one_error_line(err, "--json")
    assert "step" not in out  # nothing ran


def test_item13_compare_rate_out_of_range_is_a_usage_error() -> None:
    _run = _private("_tools.run", "_run")

    with pytest.raises(_run.UsageError, match="1.5"):
        _run.parse(["--compare", "1.5", "train.py"])
    assert _run.parse(["--compare", "0.5", "train.py"]).compare == 0.5
    assert _run.parse(["--compare", "train.py"]).script == "train.py"


def test_item13_report_merge_names_a_broken_file_in_the_folder(tmp_path: Path,
                                                               capsys: Any) -> None:
    opcontracts.reset_report()
    good = tmp_path / "report.rank0.json"
    _report = _private("_engine.records", "_report")

    _report.write_report(str(good))
    (tmp_path / "report.rank1.json.partial").write_text("{")
    (tmp_path / "notes.json").write_text("{not json")
    rc, _, err = cli(capsys, "report", "merge", str(tmp_path))
    assert "notes.json" in err and "report.rank1.json.partial" in err, err


# --------------------------------------------------------------------------- item 14
def _strict_json(text: str) -> Any:
    def bad(name: str) -> Any:
        raise AssertionError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=bad)


@pytest.mark.parametrize("argv", [["list", "swiglu"], ["env"]])
def test_item14_json_file_or_stdout_for_list_and_env(argv: list[str], tmp_path: Path,
                                                     capsys: Any) -> None:
    rc, out, _ = cli(capsys, *argv, "--json")
    assert rc == 0 and _strict_json(out)
    rc, out, _ = cli(capsys, *argv, "--json", "-")
    assert rc == 0 and _strict_json(out)
    f = tmp_path / "o.json"
    rc, out, _ = cli(capsys, *argv, "--json", str(f))
    assert rc == 0 and _strict_json(f.read_text())


def test_item14_json_dash_is_stdout_for_report_merge(tmp_path: Path, capsys: Any,
                                                     monkeypatch: Any) -> None:
    _report = _private("_engine.records", "_report")

    opcontracts.reset_report()
    f = tmp_path / "report.rank0.json"
    _report.write_report(str(f))
    monkeypatch.chdir(tmp_path)
    rc, out, _ = cli(capsys, "report", "merge", str(f), "--json", "-")
    assert rc == 0 and not (tmp_path / "-").exists()
    _strict_json(out[out.index("{"):])


def test_item14_run_takes_json(tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    f = tmp_path / "run.json"
    rc, _, _ = cli(capsys, "run", "--json", str(f), str(script))
    data = _strict_json(f.read_text())
    assert rc == 0 and "records" in data and "checked" in data


def test_item14_no_bare_nan_in_json_output() -> None:
    import io

    from opcontracts.cli import write_json

    buf = io.StringIO()
    write_json("-", {"a": float("nan"), "b": [float("inf"), -float("inf")]}, stdout=buf)
    data = _strict_json(buf.getvalue())
    assert data == {"a": "nan", "b": ["inf", "-inf"]}


# --------------------------------------------------------------------------- item 15
def _bad_call_script(tmp_path: Path, op: str) -> Path:
    """A script whose one guarded call passes fp32 where bf16 is required (line 4)."""
    script = tmp_path / "s.py"
    script.write_text(
        "import torch, opcontracts\n"
        "from opcontracts import Arg, Contract\n"
        f"f = opcontracts.enforce(Contract({op!r}, {{'x': Arg('bf16')}}))(lambda x: x)\n"
        "f(torch.ones(2))\n")
    return script


def test_item15_quiet_prints_one_summary_line_with_violations(tmp_path: Path,
                                                              capsys: Any) -> None:
    script = _bad_call_script(tmp_path, "trust3_q")
    for flag in ("--quiet", "-q"):
        opcontracts.reset_report()
        rc, out, err = cli(capsys, "run", flag, str(script))
        lines = [x for x in err.splitlines() if x.strip() and "Warning" not in x
                 and "warn" not in x.split(":")[0]]
        summary = [x for x in lines if x.startswith("opcontracts")]
        assert len(summary) == 1 and "1 contract violation" in summary[0], err


# --------------------------------------------------------------------------- item 16
def test_item16_strict_traceback_ends_at_the_users_call() -> None:
    c = Contract("trust3_item16", {"x": Arg("bf16")})
    f = opcontracts.enforce(c)(lambda x: x)
    opcontracts.set_mode("strict")
    try:
        f(torch.ones(2))
    except ContractViolation as exc:
        frames = traceback.extract_tb(exc.__traceback__)
    else:  # pragma: no cover
        raise AssertionError("no violation")
    ours = [fr for fr in frames if os.sep + "opcontracts" + os.sep in fr.filename]
    assert len(ours) <= 1, frames
    assert frames[0].filename == __file__


def test_item16_run_prints_the_violation_once_with_no_opcontracts_frame(tmp_path: Path,
                                                                       capsys: Any) -> None:
    script = _bad_call_script(tmp_path, "trust3_tb")
    rc = cli_main(["run", "--mode", "strict", str(script)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("rule:      dtype") == 1, err  # the full message once
    assert os.sep + "opcontracts" + os.sep not in err.split("Traceback", 1)[-1].split(
        "ContractViolation", 1)[0]


# --------------------------------------------------------------------------- item 17
def test_item17_list_prints_a_summary_unless_verbose(capsys: Any) -> None:
    from opcontracts._engine import registry

    rc, out, _ = cli(capsys, "list")
    ops = {c.op for c in registry.all_contracts()}
    assert rc == 0 and len(out.splitlines()) <= len(ops) + 12  # a line per op and a few more
    rc, long, _ = cli(capsys, "list", "--verbose")
    assert rc == 0 and len(long.splitlines()) > 3 * len(out.splitlines())


def test_item17_wheel_verify_summary_unless_verbose(capsys: Any) -> None:
    rc, out, _ = cli(capsys, "wheel", "verify")
    assert len(out.splitlines()) < 80, len(out.splitlines())


# --------------------------------------------------------------------------- item 19
def test_item19_run_help_and_every_subcommand_has_help(capsys: Any) -> None:
    import argparse

    from opcontracts.cli import build_parser

    rc, out, _ = cli(capsys, "run", "--help")
    assert rc == 0 and out.startswith("usage: opcontracts run")
    assert "\noptions:\n" in out and "positional arguments:" in out and "--contracts" in out

    def walk(p: argparse.ArgumentParser, where: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for choice in a._choices_actions:
                    assert choice.help, f"{where} {choice.dest}"
                for name, sp in a.choices.items():
                    walk(sp, f"{where} {name}")
            elif not a.option_strings and a.dest != "help":
                assert a.help, f"{where}: positional {a.dest}"

    walk(build_parser(), "opcontracts")


def test_item19_run_contracts_loads_a_file(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[[contract]]\nop = "trust3_rc"\ntargets = ["trust3_rc_mod.f"]\n'
                 '[contract.args.x]\ndtype = "bf16"\n')
    script = tmp_path / "s.py"
    script.write_text("import opcontracts\nprint(opcontracts.get_contract('trust3_rc').op)\n")
    rc, out, err = cli(capsys, "run", "--contracts", str(f), str(script))
    assert rc == 0 and "trust3_rc" in out, err


# --------------------------------------------------------------------------- item 20
def _pyproject() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_item20_torch_floor_is_what_the_code_needs() -> None:
    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = [Requirement(d) for d in _pyproject()["project"]["dependencies"]]
    torch_req = next(r for r in deps if r.name == "torch")
    assert not torch_req.specifier.contains(Version("2.3.1"))  # no torch.library.register_fake
    assert torch_req.specifier.contains(Version("2.4.0"))


def test_item20_npu_extra_cannot_replace_torch() -> None:
    """An unpinned torch-npu extra let pip swap the job's torch for the one torch_npu pins."""
    extras = _pyproject()["project"].get("optional-dependencies", {})
    assert all("torch-npu" not in d.replace("_", "-") for ds in extras.values() for d in ds)


def test_item20_metadata_pip_shows(tmp_path: Path) -> None:
    project = _pyproject()["project"]
    classifiers = project.get("classifiers", [])
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # PEP 639: the expression
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=300)
    meta = (tmp_path / out.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta and "Classifier: Typing :: Typed" in meta
    assert "Requires-Dist: torch>=2.4" in meta


def test_item20_fsdp2_demo_says_what_torch_it_needs(monkeypatch: Any, capsys: Any) -> None:
    import torch.distributed.fsdp as fsdp

    monkeypatch.delattr(fsdp, "fully_shard")  # torch 2.4 / 2.5: only the private one
    rc, _, err = cli(capsys, "demo", "--ranks", "2", "--fsdp", "2")
    assert rc == 2
    _one_error_line(err, "torch >= 2.6", "--fsdp 1")


# --------------------------------------------------------------------------- the sweep
@pytest.mark.parametrize("argv", [
    ["list", "--contracts", "/no/such/file.toml"],
    ["list", "--coverage", "/no/such/wheel.whl"],
    ["report", "merge", "/no/such/report.json"],
    ["wheel", "verify", "/no/such/wheel.whl"],
    ["wheel", "diff", "/no/such/a.whl", "2.14.0"],
    ["wheel", "digest", "/no/such/a.whl", "-o", "x.json.gz"],
    ["wheel", "draft", "/no/such/a.whl"],
    ["run", "/no/such/script.py"],
    ["run", "-m", "no_such_module_trust3"],
    ["run", "--frobnicate", "x.py"],
    ["list", "--frobnicate"],
    ["probe", "--frobnicate"],
])
def test_sweep_bad_paths_and_flags_exit_2_in_one_line(argv: list[str], capsys: Any,
                                                      tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _, err = cli(capsys, *argv)
    assert rc == 2, (argv, err)
    assert err.strip()


@pytest.mark.parametrize("argv", [
    ["list", "--json", "{d}/f/x.json"],
    ["env", "--json", "{d}/f/x.json"],
    ["report", "merge", "{r}", "--json", "{d}/f/x.json"],
    ["wheel", "diff", "2.13.0", "2.14.0", "--json", "{d}/f/x.json"],
])
def test_sweep_unwritable_output_exit_2(argv: list[str], capsys: Any, tmp_path: Path) -> None:
    _report = _private("_engine.records", "_report")

    opcontracts.reset_report()
    (tmp_path / "f").write_text("a file, not a folder")
    r = tmp_path / "report.rank0.json"
    _report.write_report(str(r))
    words = [a.format(d=tmp_path, r=r) for a in argv]
    rc, _, err = cli(capsys, *words)
    assert rc == 2, (words, err)
    _one_error_line(err, "x.json")


def test_sweep_malformed_contract_file_exit_2(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[contract]\nop = ")
    for argv in (["list", "--contracts", str(bad)],
                 ["wheel", "verify", "--no-shipped", "--contracts", str(bad)]):
        rc, _, err = cli(capsys, *argv)
        assert rc == 2 and str(bad) in err, (argv, err)


def test_sweep_python_m_opcontracts_bad_input_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "f"
    bad.write_text("x")
    p = subprocess.run([sys.executable, "-m", "opcontracts", "report", "merge", str(bad / "x")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr


def test_item09_cross_entropy_backward_probe_finds_no_claimed_but_wrong(capsys: Any) -> None:
    """`probe --all` exited 1 on a fresh install: grad_loss had no dtype rule, so fp64 (which
    the kernel gets wrong) counted as allowed."""
    rc, out, err = cli(capsys, "probe", "npu_cross_entropy_loss_backward")
    assert rc == 0, out + err


def test_item08_unreadable_schema_line_is_a_clean_error(tmp_path: Path, capsys: Any) -> None:
    from opcontracts.wheel import _source

    w = _wheel(tmp_path)
    _rewrite_member(w, _source.PATHS["schema"],
                    b"backend: NPU\ncustom:\n- func: npu_toy(Tensor x, *, Tensor(a! out -> ((\n")
    rc, _, err = cli(capsys, "wheel", "digest", str(w), "-o", str(tmp_path / "d.json.gz"))
    assert rc == 2
    _one_error_line(err, str(w), "schema")


def test_item01_list_says_a_contract_replaces_the_shipped_ones(tmp_path: Path,
                                                               capsys: Any) -> None:
    f = _user_file(tmp_path, WIDER_PROBS.replace("[[contract]]\n", "[[contract]]\nreplace = true\n"))
    rc, out, _ = cli(capsys, "list", MS_UNPERMUTE, "--contracts", str(f))
    assert rc == 0 and "replace: true" in out
