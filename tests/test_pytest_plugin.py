"""The pytest plugin (``opcontracts.pytest_plugin``, loaded through the ``pytest11`` entry point).

Inner sessions run in a subprocess (``runpytest_subprocess``): the plugin applies the patch and a
process-wide mode, and the ``opcontracts_env`` fixture installs the emulation, all of which would
leak into this session if run in-process.  Each inner session calls the emulated
``torch_npu.npu_moe_token_unpermute`` with fp32 ``probs``; with CANN 8.0.RC3 (set through the
environment, so the outcome does not depend on the machine) the kernel takes bf16 only.
"""

from __future__ import annotations

import sys
import time

import pytest

import opcontracts
from opcontracts._engine import records
from opcontracts.pytest_plugin import _Tracker

pytest_plugins = ["pytester"]

HELPER = '''import pytest
import torch

import opcontracts


def unpermute(probs_dtype):
    import torch_npu

    n, k, h = 4, 2, 8
    tokens = torch.randn(n * k, h, dtype=torch.bfloat16)
    order = torch.randperm(n * k).to(torch.int32)
    probs = torch.rand(n, k).to(probs_dtype)
    return torch_npu.npu_moe_token_unpermute(tokens, order, probs)  # the call site
'''
CALL_LINE = next(i for i, line in enumerate(HELPER.splitlines(), 1) if "# the call site" in line)

STRICT_TESTS = HELPER + '''

def test_caught_by_pytest_raises(opcontracts_env):
    with pytest.raises(opcontracts.ContractViolation):
        unpermute(torch.float32)


def test_caught_by_except(opcontracts_env):
    try:
        unpermute(torch.float32)
    except TypeError:
        pass


@pytest.mark.opcontracts("off")
def test_exempt(opcontracts_env):
    unpermute(torch.float32)


@pytest.mark.opcontracts("warn")
def test_marked_warn(opcontracts_env):
    with pytest.warns(opcontracts.ContractWarning):
        unpermute(torch.float32)


def test_conforming(opcontracts_env):
    unpermute(torch.bfloat16)


@pytest.mark.opcontracts("loud")
def test_bad_marker():
    pass


def test_captured_overload_passes_without_dispatch(opcontracts_env):
    op = torch.ops.npu.npu_moe_token_unpermute.default  # bypasses the patched names
    try:
        op(torch.randn(8, 8, dtype=torch.bfloat16), torch.randperm(8).to(torch.int32),
           torch.rand(4, 2))
    except TypeError:
        pass
'''


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose subprocesses see a fixed CANN version and no OPCONTRACTS_MODE."""
    monkeypatch.setenv("OPCONTRACTS_CANN_VERSION", "8.0.RC3")
    monkeypatch.delenv("OPCONTRACTS_MODE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return pytester


def _run(p: pytest.Pytester, *args: str) -> pytest.RunResult:
    t0 = time.perf_counter()
    res = p.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args,
                                 timeout=120)
    print(f"inner pytest {' '.join(args)}: {time.perf_counter() - t0:.1f}s")
    return res


def test_strict_fails_caught_violations_and_honours_markers(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_strict=STRICT_TESTS)
    res = _run(inner, "--opcontracts=strict", "-rA")
    res.assert_outcomes(failed=2, passed=4, errors=1)
    out = res.stdout.str()
    # the two tests that caught the ContractViolation fail anyway, with the violation's message
    res.stdout.fnmatch_lines([
        "FAILED test_strict.py::test_caught_by_pytest_raises - Failed: opcontracts*",
        "FAILED test_strict.py::test_caught_by_except - Failed: opcontracts*",
    ])
    assert "npu_moe_token_unpermute: argument 'probs' has dtype float32 (shape (4, 2)), " \
           "expected bfloat16" in out
    assert "PASSED test_strict.py::test_exempt" in out
    assert "PASSED test_strict.py::test_marked_warn" in out
    assert "PASSED test_strict.py::test_conforming" in out
    assert "ERROR test_strict.py::test_bad_marker" in out and "'loud'" in out
    # a captured overload never reaches the patched names (--opcontracts-dispatch catches it)
    assert "PASSED test_strict.py::test_captured_overload_passes_without_dispatch" in out
    # the summary: by op, then call site, with the tests that hit it
    res.stdout.fnmatch_lines([
        "*opcontracts (strict)*",
        "3 contract violation(s) at 1 call site(s) in 3 test(s)",
        "npu_moe_token_unpermute",
        f"  test_strict.py:{CALL_LINE} in unpermute  probs: dtype  [[]strict[]] x2",
        "*in test_strict.py::test_caught_by_pytest_raises, test_strict.py::test_caught_by_except",
        f"  test_strict.py:{CALL_LINE} in unpermute  probs: dtype  [[]warn[]] x1",
        "*in test_strict.py::test_marked_warn",
    ])
    assert "[rank " not in out  # not distributed: no rank prefix


def test_warn_mode_passes_and_summarises(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_warned=HELPER + '''

def test_bad_call(opcontracts_env):
    unpermute(torch.float32)
    assert len(opcontracts_env.report()) == 1


def test_good_call(opcontracts_env):
    unpermute(torch.bfloat16)
''')
    res = _run(inner, "--opcontracts=warn")
    res.assert_outcomes(passed=2, warnings=1)
    res.stdout.fnmatch_lines([
        "opcontracts: mode warn, patch applied",
        "*opcontracts (warn)*",
        "1 contract violation(s) at 1 call site(s) in 1 test(s)",
        "npu_moe_token_unpermute",
        f"  test_warned.py:{CALL_LINE} in unpermute  probs: dtype  [[]warn[]] x1",
        "      npu_moe_token_unpermute: argument 'probs' has dtype float32*",
        "      in test_warned.py::test_bad_call",
    ])


def test_no_option_leaves_the_session_alone(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_plain=HELPER + '''
import sys


def test_nothing_applied():
    assert "opcontracts.patch" not in sys.modules
    assert "opcontracts.emulation" not in sys.modules
    assert "opcontracts.dispatch" not in sys.modules
    assert opcontracts.get_mode() == "warn"


def test_caught_violation_passes(opcontracts_env):
    # the fixture works without the plugin enabled; a caught violation is the test's business
    with opcontracts.mode("strict"), pytest.raises(opcontracts.ContractViolation):
        unpermute(torch.float32)


def test_violation_only_warns(opcontracts_env):
    with pytest.warns(opcontracts.ContractWarning):
        unpermute(torch.float32)


@pytest.mark.opcontracts("strict")
def test_marker_registered_but_inert():
    pass
''')
    res = _run(inner, "--strict-markers")
    res.assert_outcomes(passed=4)
    out = res.stdout.str()
    assert "opcontracts (" not in out and "opcontracts: mode" not in out


def test_plugin_does_not_import_torch() -> None:
    # the pytest11 entry point imports the package in every pytest session of the environment
    import subprocess

    code = "import sys, opcontracts.pytest_plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "False"


def test_ini_option_and_command_line_override(inner: pytest.Pytester) -> None:
    inner.makeini("[pytest]\nopcontracts_mode = strict\n")
    inner.makepyfile(test_ini=HELPER + '''

def test_caught(opcontracts_env):
    try:
        unpermute(torch.float32)
    except TypeError:
        pass


def test_conforming(opcontracts_env):
    unpermute(torch.bfloat16)
''')
    res = _run(inner)
    res.assert_outcomes(failed=1, passed=1)
    res.stdout.fnmatch_lines(["FAILED test_ini.py::test_caught - Failed: opcontracts*"])
    # the command line wins over the ini file
    _run(inner, "--opcontracts=off").assert_outcomes(passed=2)


def test_bad_ini_mode_is_a_usage_error(pytester: pytest.Pytester) -> None:
    # in-process: the session stops in pytest_configure, before anything global is touched
    pytester.makeini("[pytest]\nopcontracts_mode = loud\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*ini option opcontracts_mode: unknown opcontracts mode 'loud'*"])


def test_dispatch_option_needs_a_mode(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--opcontracts-dispatch")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--opcontracts-dispatch needs --opcontracts=MODE*"])


def test_dispatch_option_catches_captured_overloads(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_overload=HELPER + '''

def test_captured_overload(opcontracts_env):
    op = torch.ops.npu.npu_moe_token_unpermute.default  # bypasses the patched names
    tokens = torch.randn(8, 8, dtype=torch.bfloat16)
    order = torch.randperm(8).to(torch.int32)
    try:
        op(tokens, order, torch.rand(4, 2))
    except TypeError:
        pass
''')
    res = _run(inner, "--opcontracts=strict", "--opcontracts-dispatch")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines([
        "opcontracts: mode strict, patch applied, dispatch mode on",
        "*test_overload.py::test_captured_overload - Failed: opcontracts*",
    ])


# --------------------------------------------------------------------------- in-process parts
def _violate(site: str = "t.py:1 in f", mode: str = "strict") -> None:
    records.record("op_a", "x", "dtype", site, mode, "op_a: argument 'x' ...")


def test_tracker_counts_only_what_is_new() -> None:
    _violate("t.py:1 in f")
    tracker = _Tracker()
    try:
        tracker.begin()
        assert tracker.delta() == ([], 0)
        _violate("t.py:1 in f")
        _violate("t.py:2 in g")
        new, unkept = tracker.delta()
        assert sorted((r.call_site, r.count) for r in new) == [("t.py:1 in f", 1),
                                                               ("t.py:2 in g", 1)]
        assert unkept == 0
        assert tracker.delta() == ([], 0)
    finally:
        tracker.close()
    assert tracker._on_reset not in records._reset_callbacks


def test_tracker_survives_a_reset_during_the_test() -> None:
    _violate()
    tracker = _Tracker()
    try:
        tracker.begin()
        opcontracts.reset_report()  # e.g. the opcontracts_env fixture's setup
        _violate()
        new, _ = tracker.delta()
        assert [(r.op, r.count) for r in new] == [("op_a", 1)]
    finally:
        tracker.close()


def test_tracker_counts_violations_beyond_the_record_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "MAX_RECORDS", 1)
    tracker = _Tracker()
    try:
        tracker.begin()
        _violate("t.py:1 in f")
        _violate("t.py:2 in g")  # distinct, over the limit: counted, not kept
        new, unkept = tracker.delta()
        assert len(new) == 1 and unkept == 1
    finally:
        tracker.close()


def test_plugin_module_imports_nothing_heavy() -> None:
    """The module itself (beyond the ``opcontracts`` package) must stay cheap to import."""
    import subprocess

    code = ("import sys, opcontracts; before = set(sys.modules); "
            "import opcontracts.pytest_plugin; "
            "new = sorted(m for m in set(sys.modules) - before if m.startswith(('opcontracts', "
            "'torch', 'pydantic'))); print(new)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "['opcontracts.pytest_plugin']"
