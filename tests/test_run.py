"""``opcontracts run``: a user's script under the patch, run as python would run it.

The examples run in subprocesses (``python -m opcontracts run ...``), as a user runs them;
argument parsing and state restoration are checked in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

import opcontracts
from opcontracts._tools import run as _run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run_cli(*args: str, cwd: Path = ROOT, timeout: float = 120
             ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::opcontracts.ContractWarning"}
    env.pop("OPCONTRACTS_MODE", None)
    return subprocess.run([sys.executable, "-m", "opcontracts", "run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


# --------------------------------------------------------------------------- the examples
def test_strict_stops_the_buggy_step_with_traceback_and_report(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    p = _run_cli("--mode", "strict", "--report", str(report), "examples/moe_step.py",
                 "--tokens", "64")
    assert p.returncode == 1, p.stderr
    err = p.stderr
    assert "Traceback (most recent call last)" in err and "ContractViolation" in err
    assert "<frozen runpy>" not in err and "run.py" not in err  # the user's frames only
    assert 'File "examples/moe_step.py"' in err
    # the report, after the traceback
    table = err[err.index("opcontracts: 1 contract violation(s)"):]
    assert "mindspeed.npu_moe_token_unpermute  probs  dtype  strict" in table
    assert "examples/moe_step.py:" in table
    data = json.loads(report.read_text())
    assert data["total"] == 1 and data["records"][0]["arg"] == "probs"
    assert "nan_sentinel" not in data


def test_fix_mode_repairs_the_step_and_argv_reaches_the_script(tmp_path: Path) -> None:
    report = tmp_path / "out" / "fix.json"
    p = _run_cli("--mode=fix", f"--report={report}", "examples/moe_step.py", "--tokens", "96")
    assert p.returncode == 0, p.stderr
    assert "step 1 (96 tokens)" in p.stdout  # the script parsed its own --tokens
    assert "fix (1 fixed)" in p.stderr
    assert json.loads(report.read_text())["records"][0]["fixed"] == 1


def test_nan_check_names_the_unpermute_backward(tmp_path: Path) -> None:
    report = tmp_path / "nan.json"
    p = _run_cli("--mode", "off", "--nan-check", "--report", str(report),
                 "examples/moe_step.py")
    assert p.returncode == 1, p.stderr  # the script's own status: its grad norm is NaN
    assert "grad norm is not finite" in p.stderr
    # MindSpeed's unpermute is C++ calling aclnn: the sentinel names the MindSpeed call whose
    # backward produced the NaN (by its input's gradient), as on the real stack
    assert "first non-finite value: backward, in mindspeed.npu_moe_token_unpermute" in p.stderr
    assert "call site: examples/moe_step.py:" in p.stderr
    first = json.loads(report.read_text())["nan_sentinel"]["first"]
    assert "npu_moe_token_unpermute" in first["op"] and first["direction"] == "backward"
    assert first["module_type"] == "MoE"


def test_fixed_example_is_clean_in_strict_mode() -> None:
    p = _run_cli("--mode", "strict", "--compare", "examples/moe_step_fixed.py")
    assert p.returncode == 0, p.stderr
    assert "opcontracts: no contract violations." in p.stderr
    # what was checked, not only what was not violated (issue 13, item 20)
    assert "opcontracts: checked 2 of 2 guarded call(s); 2 of " in p.stderr  # MindSpeed's two
    assert "mindspeed.npu_moe_token_unpermute x1" in p.stderr
    assert "shadow compare: 2 call(s) compared with their reference (2 with gradients); " \
           "no divergence" in p.stderr
    quiet = _run_cli("--quiet", "--mode", "strict", "--compare", "examples/moe_step_fixed.py")
    assert quiet.returncode == 0, quiet.stderr
    assert "opcontracts:" not in quiet.stderr and "shadow compare" not in quiet.stderr


def test_compare_catches_the_finite_garbage_the_sentinel_misses(tmp_path: Path) -> None:
    report = tmp_path / "c.json"
    p = _run_cli("--mode", "off", "--nan-check", "--compare", "--report", str(report),
                 "examples/moe_step.py", "--seed", "0")
    assert p.returncode == 1, p.stderr  # the script's own: its grad norm overflows
    err = p.stderr
    assert "NaN sentinel: no guarded op produced NaN or inf" in err  # finite garbage
    assert "divergence from the reference: backward, in mindspeed.npu_moe_token_unpermute" in err
    assert "call site:  examples/moe_step.py:" in err
    assert "checked 0 of 2 guarded call(s)" in err and "skipped by mode off: 2 call(s)" in err
    data = json.loads(report.read_text())
    cmp = data["shadow_compare"]
    assert cmp["first"]["op"] == "mindspeed.npu_moe_token_unpermute" and cmp["checked"] == 2
    assert cmp["first"]["kind"] == "input_grad"  # the grad kernel is inside MindSpeed's C++
    assert data["checked"]["skipped"] == 2 and data["nan_sentinel"]["first"] is None


def test_raising_script_status_1_traceback_and_report_still_printed(tmp_path: Path) -> None:
    report = tmp_path / "raises.json"
    p = _run_cli("--report", str(report), str(EXAMPLES / "raises.py"))
    assert p.returncode == 1
    err = p.stderr
    assert "RuntimeError: the data loader died after the first step" in err
    assert err.index("Traceback") < err.index("contract violation(s)")
    assert "mindspeed.npu_moe_token_unpermute  probs  dtype  warn" in err
    assert "unpermuted: (4, 16)" in p.stdout
    assert json.loads(report.read_text())["total"] >= 1


def test_module_with_args_exit_status_and_sys_path(tmp_path: Path) -> None:
    pkg = tmp_path / "octool"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text(textwrap.dedent("""
        import json, sys
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0]}))
        sys.exit(3)
    """))
    p = _run_cli("-m", "octool.cli", "a", "--mode", "b", cwd=tmp_path)
    assert p.returncode == 3, p.stderr
    seen = json.loads(p.stdout)
    assert seen["argv"] == [str(pkg / "cli.py"), "a", "--mode", "b"]  # as python -m gives
    assert seen["name"] == "__main__" and Path(seen["path0"]) == tmp_path
    assert "opcontracts: nothing was checked" in p.stderr  # and no "no violations" claim
    assert "no contract violations" not in p.stderr


# --------------------------------------------------------------------------- in-process
def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_script_sees_argv_name_path_and_mode_then_state_is_restored(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, """
        import json, sys
        import opcontracts
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                          "mode": str(opcontracts.get_mode())}))
        sys.exit(5)
    """)
    argv, path0, mode = list(sys.argv), sys.path[0], opcontracts.get_mode()
    env = os.environ.get("OPCONTRACTS_MODE")
    patch = sys.modules.get("opcontracts.patch")
    patched = patch is not None and patch.is_applied()
    assert _run.main(["--mode", "strict", str(script), "x", "-m", "--report"]) == 5
    out, err = capsys.readouterr()
    seen = json.loads(out)
    assert seen == {"argv": [str(script), "x", "-m", "--report"], "name": "__main__",
                    "path0": str(tmp_path), "mode": "strict"}
    assert "opcontracts: nothing was checked" in err
    assert sys.argv == argv and sys.path[0] == path0 and opcontracts.get_mode() == mode
    assert sys.modules["opcontracts.patch"].is_applied() == patched
    assert os.environ.get("OPCONTRACTS_MODE") == env


@pytest.mark.parametrize(("body", "status", "stderr"), [
    ("raise KeyboardInterrupt\n", 130, "KeyboardInterrupt"),
    ("import sys; sys.exit('bye')\n", 1, "bye"),
    ("import sys; sys.exit()\n", 0, ""),
    ("pass\n", 0, ""),
])
def test_exit_statuses(tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str,
                       status: int, stderr: str) -> None:
    assert _run.main([str(_script(tmp_path, body))]) == status
    err = capsys.readouterr().err
    assert stderr in err and "opcontracts: nothing was checked" in err


def test_report_is_per_rank_under_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert _run.main(["--report", str(tmp_path / "report.json"),
                      str(_script(tmp_path, "pass\n"))]) == 0
    assert (tmp_path / "report.rank1.json").exists()
    assert "report.rank1.json" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    ([], "a script or -m module is required"),
    (["--mode", "loud", "x.py"], "unknown mode 'loud'"),
    (["--report"], "--report needs a value"),
    (["--verbose", "x.py"], "unknown option '--verbose'"),
])
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("usage: opcontracts run")


def test_missing_script_and_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run.main([str(tmp_path / "nope.py")]) == 2
    assert "can't open file" in capsys.readouterr().err
    assert _run.main(["-m", "no_such_module_here"]) == 2  # as a script that cannot be opened
    assert "No module named no_such_module_here" in capsys.readouterr().err


def test_quiet_prints_only_violations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = _script(tmp_path, "print('hi')\n")
    assert _run.main(["--quiet", "--nan-check", "--compare", str(clean)]) == 0
    assert capsys.readouterr().err == ""
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        import opcontracts
        from opcontracts import Arg, Contract
        f = opcontracts.enforce(Contract("t.q", {"x": Arg("bf16")}))(lambda x: x)
        import torch
        f(torch.ones(2))
    """))
    assert _run.main(["--quiet", str(bad)]) == 0
    err = capsys.readouterr().err
    assert "1 contract violation(s)" in err and "t.q" in err


def test_parse_compare_rate_record_and_quiet() -> None:
    o = _run.parse(["--compare", "0.25", "--record", "g.toml", "--record-target", "m.f",
                    "--quiet", "s.py", "x"])
    assert (o.compare, o.record, o.record_targets, o.quiet, o.script, o.args) == (
        0.25, "g.toml", ["m.f"], True, "s.py", ["x"])
    assert _run.parse(["--compare", "s.py"]).compare == 1.0  # no rate given: every call
    assert _run.parse(["--compare=0.5", "s.py"]).compare == 0.5
    assert _run.parse(["s.py"]).compare is None
    with pytest.raises(_run.UsageError, match="rate must be a number in"):
        _run.parse(["--compare=2", "s.py"])


def test_parse_stops_at_the_script_name() -> None:
    o = _run.parse(["--nan-check", "--mode", "FIX", "s.py", "--mode", "strict", "-m", "x"])
    assert (o.script, o.module, o.mode, o.nan_check) == ("s.py", None, "fix", True)
    assert o.args == ["--mode", "strict", "-m", "x"]
    o = _run.parse(["-mpkg.mod", "--help"])
    assert (o.module, o.args, o.help) == ("pkg.mod", ["--help"], False)
    o = _run.parse(["--", "-weird.py", "a"])
    assert (o.script, o.args) == ("-weird.py", ["a"])
    assert _run.parse(["--help", "s.py"]).help


def test_help_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from opcontracts.cli import main

    assert main(["run", "--help"]) == 0
    assert "everything after it goes to the script" in capsys.readouterr().out


# --------------------------------------------------------------------------- torchrun
DIST_JOB = """
import sys
import torch
import torch.distributed as dist
from opcontracts import emulation
emulation.install("wide")
import torch_npu  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
x = torch.randn(8, 16, dtype=torch.bfloat16)
idx = torch.stack([torch.randperm(4)[:2] for _ in range(8)])
tokens, si = torch_npu.npu_moe_token_permute(x, idx)
probs = torch.rand(8, 2).to(torch.float32 if rank == 1 else torch.bfloat16)
torch_npu.npu_moe_token_unpermute(tokens, si, probs)
if sys.argv[1] == "destroy":  # the summary then travels through torchrun's agent store
    dist.destroy_process_group()
"""


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("end", ["keep", "destroy"])
def test_torchrun_prints_one_merged_summary_on_rank0(tmp_path: Path, end: str) -> None:
    import socket

    script = tmp_path / "job.py"
    script.write_text(DIST_JOB, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env.update(OMP_NUM_THREADS="1", OPCONTRACTS_CANN_VERSION="8.0.RC3",
               PYTHONWARNINGS="ignore")
    for _attempt in range(2):  # a second try with a new port: a free port can be taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
             "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "opcontracts",
             "run", "--compare", str(script), end],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
        if p.returncode == 0:
            break
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr
    assert err.count("opcontracts: summary of 2 of 2 rank(s)") == 1
    assert err.count("guarded call(s)") == 1  # one summary, not one per rank
    assert "checked 4 of 4 guarded call(s) on rank(s) 0,1" in err
    table = err[err.index("opcontracts: 1 contract violation(s)"):]
    assert "npu_moe_token_unpermute  probs  dtype  warn  1      1 " in table  # rank 1 only
    assert "shadow compare on rank(s) 0,1: 4 call(s) compared" in err
    assert "no divergence on any rank" in err
