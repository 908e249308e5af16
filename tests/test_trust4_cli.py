"""The command line and the NaN sentinel under bad input, and what a new user trips on: an op
blamed for the NaN it was handed, ``python -OO``, ``run`` on a folder, a script that changes
folder, outputs that cannot be written, ``run -q``, help texts, near matches, settings checked
first, ``probe``'s own calls, the warnings' call sites, ``report merge`` without torch, and
``run --json`` next to the script's prints.  Each test failed on the code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _guarded_module import guarded_module

from opcontracts import Arg, Contract
from opcontracts.cli import main as cli_main
from opcontracts.nan import NanSentinel

ROOT = Path(__file__).resolve().parent.parent
MOD = "trust4_nan_ops"


def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``opcontracts ARGV`` in this process: (exit status, stdout, stderr); no traceback."""
    try:
        rc = cli_main(list(argv))
    except SystemExit as exc:  # argparse's usage errors and --help
        rc = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _sub(*args: str, cwd: Path | None = None, timeout: int = 300,
         **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=_env(**env), timeout=timeout)


# --------------------------------------------------------------------------- the sentinel
class _Mul(torch.autograd.Function):
    """A one-node fused op: ``x * w``, whose backward uses the saved inputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, g * x


def _fused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _Mul.apply(x, w)


def _composite(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w  # plain torch ops: several nodes


def _nan_grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from _broken_kernels import NanGrad

    return NanGrad.apply(x) * w  # finite forward, a NaN made in backward


@pytest.fixture
def mulops() -> Iterator[types.ModuleType]:
    fns = {"fused": _fused, "composite": _composite, "nan_grad": _nan_grad}
    with guarded_module(MOD, fns, [Contract(f"t4.{n}", {"x": Arg("fp32")},
                                            targets=[f"{MOD}.{n}"], source="test")
                                   for n in fns]) as mod:
        yield mod


@pytest.mark.parametrize("always_on", [False, True])
@pytest.mark.parametrize("op", ["fused", "composite"])
def test_the_backward_of_an_op_handed_a_nan_is_not_blamed(mulops: types.ModuleType, op: str,
                                                          always_on: bool) -> None:
    x = torch.tensor([1.0, float("nan")], requires_grad=True)
    w = torch.tensor([2.0, 3.0], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # always_on warns at a culprit: there is none
        with NanSentinel(always_on=always_on, watch=True) as s:
            getattr(mulops, op)(x, w).sum().backward()  # the gradient flowing in is finite
    r = s.result()
    assert r.first is None and r.events == [], r.summary()
    assert r.received is not None
    assert (r.received.op, r.received.direction, r.received.kind, r.received.arg) == (
        f"t4.{op}", "forward", "received", "x")
    assert w.grad is not None and torch.isnan(w.grad).any()  # the NaN did reach w's gradient


@pytest.mark.parametrize("always_on", [False, True])
def test_after_a_received_nan_the_first_op_that_makes_one_is_still_named(
        mulops: types.ModuleType, always_on: bool) -> None:
    x = torch.tensor([1.0, float("nan")], requires_grad=True)
    w = torch.tensor([2.0, 3.0], requires_grad=True)
    v = torch.tensor([1.0, 1.0], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with NanSentinel(always_on=always_on, watch=True) as s:
            a = mulops.fused(x, w)                  # handed a NaN: received
            b = mulops.nan_grad(v, w)               # finite in, NaN made in its backward
            (a.sum() + b.sum()).backward()
    r = s.result()
    assert r.first is not None, r.summary()
    assert (r.first.op, r.first.direction, r.first.kind) == ("t4.nan_grad", "backward",
                                                             "input_grad")
    assert [e.op for e in r.events] == ["t4.nan_grad"]


@pytest.mark.parametrize("always_on", [False, True])
def test_a_backward_handed_a_non_finite_gradient_is_received(mulops: types.ModuleType,
                                                             always_on: bool) -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    w = torch.tensor([2.0, 3.0], requires_grad=True)
    with NanSentinel(always_on=always_on, watch=True) as s:
        (mulops.fused(x, w) * float("nan")).sum().backward()  # NaN made by plain torch
    r = s.result()
    assert r.first is None and r.received is not None
    assert (r.received.op, r.received.direction, r.received.kind) == ("t4.fused", "backward",
                                                                      "received")


# --------------------------------------------------------------------------- python -OO
@pytest.mark.parametrize("argv", [["--version"], ["env"], ["selftest", "--help"],
                                  ["list", "npu_moe_token_unpermute"], ["run", "--help"]])
def test_commands_work_under_python_OO(argv: list[str]) -> None:
    p = _sub("-OO", "-m", "opcontracts", *argv)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and p.stdout.strip()


def test_no_module_of_the_package_uses_a_docstring_as_text() -> None:
    # -OO drops docstrings: `__doc__` is None there, so `__doc__.split(...)` crashes
    import re

    use = re.compile(r"__doc__\s*(\.|\[|\+|%)")
    for path in (ROOT / "opcontracts").rglob("*.py"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not use.search(line), f"{path.relative_to(ROOT)}:{n}: {line.strip()}"


def test_selftest_help_lists_every_check(capsys: Any) -> None:
    from opcontracts._tools import selftest

    rc, out, _ = cli(capsys, "selftest", "--help")
    assert rc == 0
    names = [c.__name__.removeprefix("check_").replace("_", "-") for c in selftest.CHECKS]
    lines = out.splitlines()
    for name in names:
        assert any(line.startswith(name + " ") for line in lines), (name, out)
    assert "Exit status" in out


# --------------------------------------------------------------------------- help, near matches
def test_env_help_has_a_description(capsys: Any) -> None:
    rc, out, _ = cli(capsys, "env", "--help")
    assert rc == 0
    assert "versions that decide which contracts apply" in out and "Exit status 2" in out


def test_list_offers_near_matches_for_a_typo(capsys: Any) -> None:
    rc, out, err = cli(capsys, "list", "unpremute")
    assert rc == 1 and out == ""
    assert "no op matches 'unpremute'; near matches: npu_moe_token_unpermute" in err
    rc, out, err = cli(capsys, "list", "--json", "-", "unpremute")
    assert rc == 1 and json.loads(out)["ops"] == []
    assert "near matches: npu_moe_token_unpermute" in err


def test_probe_and_enforce_and_list_share_one_near_match_helper(capsys: Any) -> None:
    from opcontracts._engine.registry import UnknownOpError, near_names

    assert near_names("unpremute", ["npu_moe_token_unpermute", "npu_rms_norm"]) == [
        "npu_moe_token_unpermute"]
    assert near_names("rmsnrom", ["npu_moe_token_unpermute", "npu_rms_norm"]) == ["npu_rms_norm"]
    assert near_names("xyzzy", ["npu_moe_token_unpermute"]) == []
    assert "npu_moe_token_unpermute" in UnknownOpError("unknown op", op="unpremute").near
    rc, _, err = cli(capsys, "probe", "unpremute")
    assert rc == 2 and "near matches: npu_moe_token_unpermute" in err


@pytest.mark.parametrize("setting", [{"OPCONTRACTS_MODE": "strcit"},
                                     {"OPCONTRACTS_TARGETS": "bogus"}])
def test_demo_checks_its_settings_before_printing_anything(setting: dict[str, str]) -> None:
    p = _sub("-m", "opcontracts", "demo", **setting)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("opcontracts demo: " + next(iter(setting))), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- warnings' lines
def test_probe_does_not_warn_about_its_own_trial_calls(capsys: Any) -> None:
    from opcontracts import ContractConditionalWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc, out, err = cli(capsys, "probe", "npu_moe_token_unpermute")
    assert rc in (0, 1) and "npu_moe_token_unpermute" in out
    assert not [w for w in seen if issubclass(w.category, ContractConditionalWarning)]
    assert "Warning" not in err


def _line(fn: Any, marker: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def _sentinel_warnings_at_the_users_lines(mod: types.ModuleType) -> list[tuple[str, int]]:
    w = torch.tensor([2.0, 3.0], requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    out = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with NanSentinel(always_on=True, watch=True):  # read and warned at optimizer.step()
            mod.nan_grad(torch.ones(2, requires_grad=True), w).sum().backward()
            opt.step()  # STEP
        with NanSentinel(on_nan="warn"):  # read and warned in the backward hook
            mod.nan_grad(torch.ones(2, requires_grad=True), w).sum().backward()  # BACKWARD
    out = [(os.path.basename(x.filename), x.lineno) for x in seen
           if issubclass(x.category, RuntimeWarning)]
    return out


def test_the_sentinels_warnings_point_at_the_users_line(mulops: types.ModuleType) -> None:
    here = os.path.basename(__file__)
    fn = _sentinel_warnings_at_the_users_lines
    assert _sentinel_warnings_at_the_users_lines(mulops) == [
        (here, _line(fn, "# STEP")), (here, _line(fn, "# BACKWARD"))]


def test_the_recorders_warning_points_at_the_users_call(mulops: types.ModuleType) -> None:
    from opcontracts.record import Recorder

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Recorder():
            mulops.fused(torch.ones(2, dtype=torch.float64), torch.ones(2))  # RECORDED
    rec = [x for x in seen if "opcontracts.record" in str(x.message)]
    assert rec and (os.path.basename(rec[0].filename), rec[0].lineno) == (
        os.path.basename(__file__),
        _line(test_the_recorders_warning_points_at_the_users_call, "# RECORDED"))


def test_a_warning_with_no_user_frame_is_not_shown_at_an_opcontracts_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opcontracts._engine import callsite

    monkeypatch.setattr(callsite, "_ours", lambda filename: True)  # every frame is ours
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        callsite.warn_at_caller("x", RuntimeWarning)
    assert [(w.filename, w.lineno) for w in seen] == [("<opcontracts>", 0)]


# --------------------------------------------------------------------------- report merge
def _report_file(path: Path, rank: int, *, violation: bool = False, nan_first: bool = False,
                 diverged: bool = False) -> str:
    from opcontracts._observers.sections import NanEvent

    rec = {"op": "npu_moe_token_unpermute", "arg": "probs", "rule": "dtype",
           "call_site": "train.py:3 in step", "mode": "warn", "count": 1, "fixed": 0,
           "message": "npu_moe_token_unpermute: argument 'probs' ...", "ranks": [rank]}
    event = NanEvent("op_a", "backward", "output", "output[0]", "bfloat16", (2, 2), 1, 0,
                     "train.py:11 in forward", "layers.1", "Block").to_dict()
    first = {"op": "op_b", "direction": "forward", "kind": "output", "argument": "output",
             "reason": "cosine 0.5", "call_site": "train.py:12 in forward"}
    data: dict[str, Any] = {
        "rank": rank, "total": int(violation), "dropped": 0, "records": [rec] if violation else [],
        "checked": {"targets": 3, "guarded_ops": 3, "calls": {"op_a": 2}, "off": {},
                    "no_contract": {}, "ranks": [rank]},
        "nan_sentinel": {"first": event if nan_first else None, "events": [event] * nan_first,
                         "received": None, "calls": 2, "dropped": 0},
        "shadow_compare": {"checked": 2, "grads_checked": 0, "skipped": 0,
                           "first": first if diverged else None},
    }
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_report_merge_imports_no_torch(tmp_path: Path) -> None:
    _report_file(tmp_path / "report.rank0.json", 0, violation=True, nan_first=True)
    _report_file(tmp_path / "report.rank1.json", 1, diverged=True)
    code = ("import sys; from opcontracts.cli import main; rc = main(['report', 'merge', "
            f"{str(tmp_path)!r}, '--json', {str(tmp_path / 'm.json')!r}]); "
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', rc)")
    p = _sub("-c", code)
    assert p.stdout.strip().splitlines()[-1] == "NO TORCH 1", p.stdout + p.stderr
    assert "first non-finite value: backward, in op_a" in p.stdout  # the sentinel's wording
    assert "shadow compare on rank(s) 0,1" in p.stdout and "checked 4 of 4" in p.stdout


@pytest.mark.parametrize(("found", "status"), [
    ({}, 0), ({"violation": True}, 1), ({"nan_first": True}, 1), ({"diverged": True}, 1)])
def test_report_merge_exits_1_when_the_files_found_problems(
        tmp_path: Path, capsys: Any, found: dict[str, bool], status: int) -> None:
    files = [_report_file(tmp_path / "report.rank0.json", 0),
             _report_file(tmp_path / "report.rank1.json", 1, **found)]
    rc, out, _ = cli(capsys, "report", "merge", *files)
    assert rc == status and "merged 2 report file(s)" in out


# --------------------------------------------------------------------------- opcontracts run
def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return _sub("-m", "opcontracts", "run", *args, cwd=cwd,
                PYTHONWARNINGS="ignore::opcontracts.ContractWarning")


_VIOLATION = """\
import torch
from opcontracts import emulation
emulation.install()
import torch_npu
print("the script's own line")
x = torch.randn(4, 8, dtype=torch.bfloat16)
idx = torch.arange(4, dtype=torch.int32)
torch_npu.npu_moe_token_unpermute(x, idx, probs=torch.ones(4, 1, dtype=torch.float64))
"""


def test_run_a_folder_with_a_main_module_as_python_does(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("VALUE = 42\n")
    (app / "__main__.py").write_text(
        "import os, sys, helper\n"
        "print('main', __name__, helper.VALUE, sys.argv[1:], os.path.abspath(sys.path[0]))\n")
    p = _run("app", "--flag", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"main __main__ 42 ['--flag'] {app}" in p.stdout
    (tmp_path / "empty").mkdir()
    p = _run("empty", cwd=tmp_path)
    assert p.returncode == 2
    assert "can't find '__main__' module in 'empty'" in p.stderr
    assert "No such file or directory" not in p.stderr


def test_outputs_stay_where_the_user_meant_when_the_script_changes_folder(
        tmp_path: Path) -> None:
    (tmp_path / "outputs").mkdir()
    (tmp_path / "job.py").write_text("import os\nos.chdir('outputs')\n")
    p = _run("--report", "r.json", "--record", "g.toml", "job.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "r.json").is_file() and (tmp_path / "g.toml").is_file()
    assert not (tmp_path / "outputs" / "r.json").exists()
    assert f"report written to {tmp_path / 'r.json'}" in p.stderr
    assert f"recorded to {tmp_path / 'g.toml'}" in p.stderr


def test_an_existing_report_file_that_cannot_be_opened_stops_the_run_before_the_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from opcontracts import _jsonout

    report = tmp_path / "r.json"
    report.write_text("kept")
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    real_open = open

    def read_only(path: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if str(path) == str(report) and mode != "r":  # what a 0444 file is to a user
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(_jsonout, "open", read_only, raising=False)
    rc, _, err = cli(capsys, "run", "--report", str(report), str(script))
    assert rc == 2 and not marker.exists()
    assert f"--report {report}: cannot write: Permission denied" in err
    assert report.read_text() == "kept"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes a read-only file")
def test_a_read_only_report_file_stops_the_run_before_the_script(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    report.write_text("kept")
    report.chmod(0o444)
    (tmp_path / "s.py").write_text("open('ran', 'w').close()\n")
    p = _run("--report", "r.json", "s.py", cwd=tmp_path)
    assert p.returncode == 2 and not (tmp_path / "ran").exists()
    assert "cannot write" in p.stderr and report.read_text() == "kept"


def test_the_writability_check_leaves_nothing_behind(tmp_path: Path) -> None:
    from opcontracts._jsonout import OutputError, check_writable

    check_writable(str(tmp_path / "new" / "deeper" / "r.json"), "--report")
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    check_writable(str(existing), "--report")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert existing.read_text() == "kept"
    with pytest.raises(OutputError, match="it is a folder"):
        check_writable(str(tmp_path), "--report")
    with pytest.raises(OutputError, match="not a folder"):
        check_writable(str(existing / "r.json"), "--report")


def test_a_report_lost_after_the_script_is_exit_status_2(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("import os, sys\nos.mkdir(sys.argv[1])\n")
    p = _run("--report", "r.json", "job.py", "r.json", cwd=tmp_path)  # a folder took its place
    assert p.returncode == 2
    assert f"--report {tmp_path / 'r.json'}: cannot write" in p.stderr
    (tmp_path / "fails.py").write_text("import os, sys\nos.mkdir(sys.argv[1])\nsys.exit(3)\n")
    p = _run("--report", "q.json", "fails.py", "q.json", cwd=tmp_path)
    assert p.returncode == 3  # the script's own failure is what it exits with


def test_quiet_says_nothing_of_the_files_and_points_at_the_report(tmp_path: Path) -> None:
    (tmp_path / "clean.py").write_text("pass\n")
    p = _run("-q", "--report", "r.json", "--record", "g.toml", "clean.py", cwd=tmp_path)
    assert p.returncode == 0 and p.stderr.strip() == "", p.stderr
    assert (tmp_path / "r.json").is_file() and (tmp_path / "g.toml").is_file()
    (tmp_path / "bad.py").write_text(_VIOLATION)
    p = _run("-q", "--report", "r.json", "bad.py", cwd=tmp_path)
    lines = [x for x in p.stderr.splitlines() if x.startswith("opcontracts")]
    assert len(lines) == 1, p.stderr
    assert "1 contract violation(s)" in lines[0]
    assert f"details in {tmp_path / 'r.json'}" in lines[0] and "--report FILE" not in lines[0]
    assert "written to" not in p.stderr
    p = _run("-q", "bad.py", cwd=tmp_path)
    assert "run without --quiet, or --report FILE, for the details" in p.stderr


def test_run_json_on_stdout_is_the_json_alone(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(
        _VIOLATION + "import os, sys\nos.system('echo from a subprocess')\n"
        "sys.stdout.write('no newline at the end')\n")
    p = _run("--json", "bad.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)  # nothing else on stdout
    assert data["total"] == 1 and data["records"][0]["arg"] == "probs"
    assert "the script's own line" in p.stderr and "from a subprocess" in p.stderr
    assert "no newline at the end" in p.stderr
    p = _run("--json", "out.json", "bad.py", cwd=tmp_path)  # a file: stdout is the script's
    assert "the script's own line" in p.stdout
    assert json.loads((tmp_path / "out.json").read_text())["total"] == 1


# --------------------------------------------------------------------------- missing folders
@pytest.mark.parametrize("argv", [["env", "--json", "{out}"], ["list", "--json", "{out}"],
                                  ["run", "--report", "{out}", "{script}"]])
def test_an_outputs_missing_folder_is_created_and_one_that_cannot_be_is_exit_2(
        tmp_path: Path, capsys: Any, argv: list[str]) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    out = tmp_path / "runs" / "today" / "out.json"
    rc, _, err = cli(capsys, *(a.format(out=out, script=script) for a in argv))
    assert rc == 0, err
    assert json.loads(out.read_text())
    blocked = tmp_path / "s.py" / "out.json"  # its folder would have to be a file
    rc, _, err = cli(capsys, *(a.format(out=blocked, script=script) for a in argv))
    assert rc == 2 and f"{blocked}: cannot write" in err and len(err.strip().splitlines()) == 1
