"""pytest plugin: run a test suite with every guarded op checked, and fail tests that violate.

Registered through the ``pytest11`` entry point, so pytest loads it in *every* session of an
environment where opcontracts is installed, including suites that have nothing to do with it.
It therefore does nothing unless asked: without ``--opcontracts=MODE`` or the ``opcontracts_mode``
ini option no hook below touches opcontracts, torch or the report; the per-test hooks live on a
separate object (``_Session``) that is only registered when the plugin is enabled, so an
unrelated suite pays for two option definitions, a marker line and a fixture definition.  (The
entry point still imports the ``opcontracts`` package first, as Python imports a parent package
before its module: that package's ``__init__`` has to stay light for this to be cheap.)

When enabled (``--opcontracts=strict|warn|fix|off`` or ``opcontracts_mode = strict`` in the ini
file) it applies ``opcontracts.patch`` and the mode for the whole session, and restores both at
the end.  In ``strict`` mode a test fails when any contract was violated while it ran (setup and
call), *even if the test caught the ContractViolation*: a ``pytest.raises(TypeError)`` or a broad
``except`` in the code under test must not hide a bad kernel call.  Detection compares the
violation report before and after each test (see ``_Tracker``), so it sees every recorded
violation whatever code path raised, caught or merely warned about it.

``@pytest.mark.opcontracts("off")`` (or any mode) runs one test in another mode; the
``opcontracts_env`` fixture gives a test the CPU emulation of the NPU ops (when no real torch_npu
is present), the patch and a clean report; the terminal summary lists the session's violations
by op and call site; ``--opcontracts-dispatch`` also runs each test under
``opcontracts.dispatch.ContractDispatchMode`` for code that calls captured op overloads.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ._engine.records import Record, Report

__all__ = ["OpcontractsEnv", "opcontracts_env"]

_MODES = ("strict", "warn", "fix", "off")
_MARKER = "opcontracts"
_OUTSIDE = "(outside tests)"
_SESSION_PLUGIN = "opcontracts-session"
_INI_MODE = "opcontracts_mode"
_INI_DISPATCH = "opcontracts_dispatch"

Key = tuple[str, "str | None", str, str, str]


# --------------------------------------------------------------------------- always loaded
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opcontracts", "opcontracts: operator dtype/shape contracts")
    group.addoption(
        "--opcontracts", dest="opcontracts_mode", metavar="MODE", default=None,
        choices=_MODES,
        help="check every guarded op in MODE (strict, warn, fix, off) for the whole session; "
             "in strict mode a test that violated a contract fails even if it caught the "
             "ContractViolation. Default: the ini option opcontracts_mode, else disabled.",
    )
    group.addoption(
        "--opcontracts-dispatch", dest="opcontracts_dispatch", action="store_true",
        default=None,
        help="also run each test under opcontracts.dispatch.ContractDispatchMode (catches ops "
             "called through captured overloads or from C++; slow). Needs --opcontracts.",
    )
    parser.addini(_INI_MODE, "opcontracts mode for the session (strict, warn, fix, off); "
                  "empty: the plugin is disabled", default="")
    parser.addini(_INI_DISPATCH, "run each test under ContractDispatchMode (like "
                  "--opcontracts-dispatch)", type="bool", default=False)


def pytest_configure(config: pytest.Config) -> None:
    # registered even when disabled, so `--strict-markers` suites may carry the marker
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(mode): run this test in the given opcontracts mode (strict, warn, fix, off) "
        "when the opcontracts plugin is enabled (--opcontracts=MODE or opcontracts_mode)",
    )
    mode = _session_mode(config)
    if mode is None:
        if config.getoption("opcontracts_dispatch"):
            raise pytest.UsageError("--opcontracts-dispatch needs --opcontracts=MODE (or the ini "
                                    f"option {_INI_MODE})")
        return
    dispatch = config.getoption("opcontracts_dispatch")
    if dispatch is None:
        dispatch = bool(config.getini(_INI_DISPATCH))
    config.pluginmanager.register(_Session(config, mode, bool(dispatch)), _SESSION_PLUGIN)


def _session_mode(config: pytest.Config) -> str | None:
    """The session's mode (the command line wins over the ini file), or None: disabled."""
    value = config.getoption("opcontracts_mode")
    where = "--opcontracts"
    if value is None:
        value = str(config.getini(_INI_MODE) or "").strip()
        where = f"ini option {_INI_MODE}"
        if not value:
            return None
    value = str(value).strip().lower()
    if value not in _MODES:
        raise pytest.UsageError(
            f"{where}: unknown opcontracts mode {value!r}; expected one of {', '.join(_MODES)}")
    return value


# --------------------------------------------------------------------------- per-test tracking
@dataclass
class _Seen:
    """One violation (op, argument, rule, call site, mode) accumulated over the session."""

    record: Record
    count: int = 0
    fixed: int = 0
    tests: list[str] = field(default_factory=list)


class _Tracker:
    """New violations since the last look, from report snapshots.

    Why snapshots and not a hook in the enforcer: the report is the one place every path writes
    to (strict raises after recording, warn and fix record before calling the kernel, cached
    repeats bump the same counters), so a diff of per-record counts sees every violation, caught
    or not, without coupling the plugin to the enforcer.  A ``reset_report()`` during a test
    (the ``opcontracts_env`` fixture does one) is noticed through the report's reset callbacks:
    after one, everything in the report is new.
    """

    def __init__(self) -> None:
        from ._engine import records as _report

        self._report_mod = _report
        self._resets = 0
        self._base: dict[Key, tuple[int, int]] = {}
        self._base_total = 0
        self._base_resets = 0
        _report._reset_callbacks.append(self._on_reset)

    def close(self) -> None:
        try:
            self._report_mod._reset_callbacks.remove(self._on_reset)
        except ValueError:  # pragma: no cover - removed by someone else
            pass

    def _on_reset(self) -> None:
        self._resets += 1

    def _snapshot(self) -> Report:
        return self._report_mod.report()

    def begin(self) -> None:
        rep = self._snapshot()
        self._base = {r.key: (r.count, r.fixed) for r in rep.records}
        self._base_total = rep.total
        self._base_resets = self._resets

    def delta(self) -> tuple[list[Record], int]:
        """Records with their new counts since ``begin`` (or the last ``delta``), and how many
        further violations were counted but not kept (the report's distinct-record limit)."""
        rep = self._snapshot()
        if self._resets != self._base_resets:
            base: dict[Key, tuple[int, int]] = {}
            base_total = 0
        else:
            base, base_total = self._base, self._base_total
        self._base = {r.key: (r.count, r.fixed) for r in rep.records}
        self._base_total = rep.total
        new: list[Record] = []
        for r in rep.records:  # the snapshot's records are copies: adjusted in place
            count, fixed = base.get(r.key, (0, 0))
            if r.count > count:
                r.count -= count
                r.fixed = max(0, r.fixed - fixed)
                new.append(r)
        unkept = max(0, (rep.total - base_total) - sum(r.count for r in new))
        self._base_resets = self._resets
        return new, unkept


_phase_records = pytest.StashKey[list["Record"]]()
_phase_unkept = pytest.StashKey[int]()
_marker_restore = pytest.StashKey[Any]()
_test_mode = pytest.StashKey[str]()


class _Session:
    """The plugin's per-test hooks; registered only when the plugin is enabled."""

    def __init__(self, config: pytest.Config, mode: str, dispatch: bool) -> None:
        import opcontracts

        # `import opcontracts.patch` applies the patch on first import; remember whether it was
        # already active (a conftest may have imported it) so the session end restores that
        from . import patch

        self.config = config
        self.mode = mode
        self.dispatch = dispatch
        self.was_patched = patch.is_applied()
        patch.apply()
        self.prev_mode = opcontracts.set_mode(mode)
        self.tracker = _Tracker()
        self.tracker.begin()
        self.seen: dict[Key, _Seen] = {}
        self.unkept = 0
        self.tests_with_violations: set[str] = set()

    # ---------------------------------------------------------------- session end
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        import opcontracts

        from . import patch

        self.tracker.close()
        opcontracts.set_mode(self.prev_mode)
        if not self.was_patched:
            patch.unpatch()

    # ---------------------------------------------------------------- per test
    def _test_mode(self, item: pytest.Item) -> tuple[str, str | None]:
        """The test's mode (its marker's, else the session's) and, for a bad marker, why."""
        marker = item.get_closest_marker(_MARKER)
        if marker is None:
            return self.mode, None
        value = marker.args[0] if marker.args else marker.kwargs.get("mode")
        if not isinstance(value, str) or value.strip().lower() not in _MODES:
            return self.mode, (f"@pytest.mark.{_MARKER}({value!r}): unknown mode; expected one "
                               f"of {', '.join(_MODES)}")
        return value.strip().lower(), None

    def _note(self, item: pytest.Item | None) -> tuple[list[Record], int]:
        """Add what was recorded since the last look to the session, and to ``item`` (None:
        between tests: collection, module-level code, session fixtures' teardown)."""
        new, unkept = self.tracker.delta()
        label = item.nodeid if item is not None else _OUTSIDE
        if (new or unkept) and item is not None:
            self.tests_with_violations.add(label)
        for r in new:
            s = self.seen.get(r.key)
            if s is None:
                s = self.seen[r.key] = _Seen(r)
            s.count += r.count
            s.fixed += r.fixed
            if label not in s.tests:
                s.tests.append(label)
        self.unkept += unkept
        if item is not None:
            item.stash[_phase_records] = item.stash.get(_phase_records, []) + new
            item.stash[_phase_unkept] = item.stash.get(_phase_unkept, 0) + unkept
        return new, unkept

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        item.stash[_phase_records] = []
        item.stash[_phase_unkept] = 0
        self._note(None)  # anything since the last test is not this test's
        mode, bad_marker = self._test_mode(item)
        item.stash[_test_mode] = mode
        if mode != self.mode:
            # both: the global default for threads the test starts, and a mode() block for this
            # thread, which also replaces per-op overrides (the marker means "this test, all ops")
            import opcontracts

            prev = opcontracts.set_mode(mode)
            block = opcontracts.mode(mode)
            block.__enter__()
            item.stash[_marker_restore] = (prev, block)
        try:
            result = yield
        finally:
            self._note(item)
        if bad_marker is not None:
            # after the yield: failing before it would skip the other plugins' setup wrappers,
            # whose teardown halves then break; this way only this test errors
            pytest.fail(bad_marker, pytrace=False)
        return result

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        strict = item.stash.get(_test_mode, self.mode) == "strict"
        with _dispatch_block(self.dispatch):
            try:
                result = yield
            except BaseException as exc:
                self._note(item)
                self._add_section(item, exc)
                raise
        self._note(item)
        recs, unkept = item.stash[_phase_records], item.stash[_phase_unkept]
        if strict and (recs or unkept):
            pytest.fail(_failure_text(recs, unkept, self.config), pytrace=False)
        return result

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item,
                                nextitem: pytest.Item | None) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            self._note(item)
            restore = item.stash.get(_marker_restore, None)
            if restore is not None:
                import opcontracts

                prev, block = restore
                block.__exit__(None, None, None)
                opcontracts.set_mode(prev)
                del item.stash[_marker_restore]

    def _add_section(self, item: pytest.Item, exc: BaseException) -> None:
        """The test failed on its own: show its violations next to its traceback, unless the
        failure is that one violation, raised (its traceback says it all)."""
        recs, unkept = item.stash[_phase_records], item.stash[_phase_unkept]
        only_this = (not unkept and len(recs) == 1 and recs[0].count == 1
                     and getattr(exc, "op", None) == recs[0].op
                     and getattr(exc, "arg", None) == recs[0].arg
                     and getattr(exc, "rule", None) == recs[0].rule)
        if (recs or unkept) and not only_this:
            item.add_report_section("call", "opcontracts",
                                    _failure_text(recs, unkept, self.config))

    # ---------------------------------------------------------------- summary
    def pytest_report_header(self, config: pytest.Config) -> str:
        extra = ", dispatch mode on" if self.dispatch else ""
        return f"opcontracts: mode {self.mode}, patch applied{extra}"

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int,
                                config: pytest.Config) -> None:
        tr = terminalreporter
        self._note(None)
        title = f"opcontracts ({self.mode})"
        from ._engine import conditional

        if not self.seen and not self.unkept:
            tr.write_sep("=", title, green=True)
            if config.pluginmanager.hasplugin("dsession"):  # pytest-xdist's controller
                tr.write_line("no contract violations in this process; the tests ran in "
                              "pytest-xdist workers, whose violations are not gathered here "
                              "(strict mode still fails their tests)")
            else:
                tr.write_line("no contract violations")
            for line in conditional.summary():
                tr.write_line(line)
            return
        tr.write_sep("=", title, yellow=True)
        for line in _summary_lines(self.seen, self.unkept, len(self.tests_with_violations),
                                   config):
            tr.write_line(line)
        for line in conditional.summary():
            tr.write_line(line)


class _dispatch_block:  # noqa: N801 - used like a context manager function
    """``ContractDispatchMode()`` around a test call when asked, nothing otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.mode: Any = None

    def __enter__(self) -> None:
        if self.enabled:
            from .dispatch import ContractDispatchMode

            self.mode = ContractDispatchMode()
            self.mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.mode is not None:
            self.mode.__exit__(*exc)
            self.mode = None


# --------------------------------------------------------------------------- text
def _short_site(site: str, config: pytest.Config) -> str:
    """``/abs/path/test_x.py:12 in f`` -> ``test_x.py:12 in f`` under the rootdir."""
    path, sep, rest = site.partition(":")
    try:
        rel = os.path.relpath(path, str(config.rootpath))
    except ValueError:  # another drive on Windows
        return site
    if rel.startswith(".."):
        return site
    return rel + sep + rest


def _failure_text(recs: list[Record], unkept: int, config: pytest.Config) -> str:
    n = sum(r.count for r in recs) + unkept
    lines = [f"opcontracts (strict): {n} contract violation(s) in this test, caught or not:"]
    for r in recs:
        times = f" ({r.count} calls)" if r.count > 1 else ""
        lines.append("")
        lines.append(f"{r.op} at {_short_site(r.call_site, config)} [{r.mode}]{times}")
        lines.extend("  " + ln for ln in r.message.splitlines())
    if unkept:
        lines.append(f"({unkept} further violation(s) not kept: the report's record limit)")
    lines.append("")
    lines.append(f"Fix the call, or exempt the test: @pytest.mark.{_MARKER}(\"warn\")")
    return "\n".join(lines)


def _summary_lines(seen: dict[Key, _Seen], unkept: int, n_tests: int,
                   config: pytest.Config) -> list[str]:
    """The session's violations grouped by op, then call site, with the tests that hit each."""
    total = sum(s.count for s in seen.values()) + unkept
    sites = {(s.record.op, s.record.call_site) for s in seen.values()}
    outside = any(_OUTSIDE in s.tests for s in seen.values())
    where = f"in {n_tests} test(s)" + (" and outside tests" if outside else "")
    lines = [f"{total} contract violation(s) at {len(sites)} call site(s) {where}"]
    by_op: dict[str, list[_Seen]] = {}
    for s in seen.values():
        by_op.setdefault(s.record.op, []).append(s)
    for op in sorted(by_op):
        lines.append("")
        lines.append(op)
        for s in sorted(by_op[op], key=lambda s: (s.record.call_site, s.record.arg or "")):
            r = s.record
            what = f"{r.arg}: {r.rule}" if r.arg else r.rule
            fixed = f", {s.fixed} fixed" if s.fixed else ""
            lines.append(f"  {_short_site(r.call_site, config)}  {what}  "
                         f"[{r.mode}] x{s.count}{fixed}")
            head = r.message.splitlines()[0] if r.message else ""
            if head:
                lines.append(f"      {head}")
            shown = s.tests[:3]
            more = f" and {len(s.tests) - 3} more" if len(s.tests) > 3 else ""
            lines.append(f"      in {', '.join(shown)}{more}")
    if unkept:
        lines.append("")
        lines.append(f"({unkept} further violation(s) not kept: the report's record limit)")
    return lines


# --------------------------------------------------------------------------- fixture
@dataclass
class OpcontractsEnv:
    """What ``opcontracts_env`` gives a test.

    ``emulated``: the CPU emulation of the NPU ops was installed for this test (False when a
    real torch_npu is present, or the emulation was already installed by someone else).
    """

    emulated: bool

    def report(self) -> Report:
        """The violations recorded since the fixture set up (it starts with a clean report)."""
        import opcontracts

        return opcontracts.report()

    def reset(self) -> None:
        """Forget recorded violations and the warn-once memory."""
        _reset_state()


def _reset_state() -> None:
    import opcontracts

    from ._engine import violations

    opcontracts.reset_report()
    violations.reset_warnings()


@pytest.fixture
def opcontracts_env() -> Iterator[OpcontractsEnv]:
    """The NPU ops as the code under test will see them, on any machine.

    Installs the CPU emulation (``torch_npu`` / ``mindspeed.ops`` stand-ins and
    ``torch.ops.npu``) unless a real torch_npu is present, applies ``opcontracts.patch`` and
    starts from a clean report; afterwards everything is put back as it was: the patch removed if
    it was not applied before, the emulation uninstalled if this fixture installed it.
    """
    from . import emulation, patch

    was_patched = patch.is_applied()
    installed_here = False
    if not emulation.installed():
        try:
            emulation.install()
            installed_here = True
        except RuntimeError:  # a real torch_npu: test against the real ops
            pass
    patch.apply()  # wraps what the install just registered
    _reset_state()
    try:
        yield OpcontractsEnv(emulated=installed_here)
    finally:
        _reset_state()
        if installed_here:
            # unpatch while the emulated ops still exist (restoring onto live objects), then
            # re-apply for the session: uninstall drops the op packets the patch had wrapped
            patch.unpatch()
            emulation.uninstall()
            if was_patched:
                patch.apply()
        elif not was_patched:
            patch.unpatch()
