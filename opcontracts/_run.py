"""``opcontracts run``: run a user's script or module with ``opcontracts.patch`` applied.

    opcontracts run [--mode MODE] [--nan-check] [--report FILE] script.py [args ...]
    opcontracts run [--mode MODE] [--nan-check] [--report FILE] -m module [args ...]

Why: guarding a job should not need an edit of the job.  The script runs as ``python`` would
run it (as ``coverage run`` does): ``sys.argv`` is ``[script, *args]``, ``__name__`` is
``"__main__"``, ``sys.path[0]`` is the script's folder (the current folder for ``-m``).  Options
are read up to the script name; every word after it belongs to the script.

At exit (also after an exception or Ctrl-C) the violation report is printed to stderr, with the
NaN sentinel's finding when ``--nan-check`` is on; ``--report FILE`` also writes it as JSON
(``report.rank{R}.json`` per rank under torchrun).  The exit status is the script's: its
``SystemExit`` code, 1 (with the traceback) for an uncaught exception, 130 for Ctrl-C.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .nan import NanSentinel

__all__ = ["RunOptions", "UsageError", "main", "parse", "run"]

USAGE = ("usage: opcontracts run [--mode MODE] [--nan-check] [--report FILE] "
         "(script.py | -m module) [args ...]")
HELP = f"""{USAGE}

Run a Python script (or a module with -m) with opcontracts.patch applied, as python would run it,
and print the contract violation report to stderr when it ends.

options (before the script name; everything after it goes to the script):
  --mode MODE      strict, warn, fix or off (default: OPCONTRACTS_MODE, else warn)
  --nan-check      watch the guarded ops for the first one that produces NaN/inf
                   (opcontracts.nan); its finding is printed with the report
  --report FILE    also write the report as JSON (FILE.rank{{R}}.json per rank when distributed)
  -m module        run a library module as a script (like python -m)
  -h, --help       show this help

exit status: the script's own (SystemExit code; 1 on an uncaught exception; 130 on Ctrl-C);
2 for a usage error or a script that cannot be opened.
"""

_MODES = ("strict", "warn", "fix", "off")


class UsageError(Exception):
    """Bad ``opcontracts run`` arguments (exit status 2)."""


@dataclass
class RunOptions:
    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    mode: str | None = None
    nan_check: bool = False
    report: str | None = None
    help: bool = False


def parse(argv: Sequence[str]) -> RunOptions:
    """Options up to the script name (or ``-m module``); the rest are the script's."""
    opts = RunOptions()
    words = list(argv)
    i = 0

    def value(flag: str, word: str) -> str:
        nonlocal i
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
        if i + 1 >= len(words):
            raise UsageError(f"{flag} needs a value")
        i += 1
        return words[i]

    while i < len(words):
        w = words[i]
        if w in ("-h", "--help"):
            opts.help = True
            return opts
        if w == "--mode" or w.startswith("--mode="):
            m = value("--mode", w).strip().lower()
            if m not in _MODES:
                raise UsageError(f"--mode: unknown mode {m!r}; expected one of {', '.join(_MODES)}")
            opts.mode = m
        elif w == "--nan-check":
            opts.nan_check = True
        elif w == "--report" or w.startswith("--report="):
            opts.report = value("--report", w)
        elif w == "-m" or (w.startswith("-m") and len(w) > 2 and not w.startswith("--")):
            opts.module = w[2:] if len(w) > 2 else value("-m", w)
            opts.args = words[i + 1:]
            return opts
        elif w == "--":
            if i + 1 >= len(words):
                raise UsageError("a script or -m module is required")
            opts.script, opts.args = words[i + 1], words[i + 2:]
            return opts
        elif w.startswith("-"):
            raise UsageError(f"unknown option {w!r} (options go before the script name)")
        else:
            opts.script, opts.args = w, words[i + 1:]
            return opts
        i += 1
    raise UsageError("a script or -m module is required")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{USAGE}\nopcontracts run: error: {exc}", file=sys.stderr)
        return 2
    if opts.help:
        print(HELP, end="")
        return 0
    return run(opts)


# --------------------------------------------------------------------------- running
def _exit_status(exc: SystemExit) -> int:
    """What the interpreter would exit with for ``sys.exit(code)``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _user_traceback(exc: BaseException) -> TracebackType | None:
    """The traceback without this module's and runpy's frames, as python shows it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return tb


def _print_exception(exc: BaseException) -> None:
    traceback.print_exception(type(exc), exc, _user_traceback(exc), file=sys.stderr)


def _execute(opts: RunOptions) -> int:
    """Run the script in this process; its exit status."""
    try:
        if opts.module is not None:
            import importlib.util

            sys.argv = [opts.module, *opts.args]  # run_module puts the file in argv[0]
            sys.path[0] = os.getcwd()
            try:
                found = importlib.util.find_spec(opts.module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                print(f"opcontracts run: No module named {opts.module}", file=sys.stderr)
                return 1
            runpy.run_module(opts.module, run_name="__main__", alter_sys=True)
        else:
            assert opts.script is not None
            sys.argv = [opts.script, *opts.args]
            sys.path[0] = os.path.dirname(os.path.abspath(opts.script))
            runpy.run_path(opts.script, run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc)
    except KeyboardInterrupt as exc:
        _print_exception(exc)
        return 130
    except BaseException as exc:  # noqa: BLE001 - the script's error, reported as python does
        _print_exception(exc)
        return 1
    return 0


def run(opts: RunOptions) -> int:
    """Apply the patch and the mode, run the script, report; process state is restored
    afterwards (``sys.argv``, ``sys.path[0]``, the mode, the patch if it was not applied)."""
    if opts.script is not None and not os.path.isfile(opts.script):
        print(f"opcontracts run: can't open file {os.path.abspath(opts.script)!r}: "
              "[Errno 2] No such file or directory", file=sys.stderr)
        return 2
    import opcontracts

    patch_mod = sys.modules.get("opcontracts.patch")
    was_patched = patch_mod is not None and patch_mod.is_applied()
    import opcontracts.patch as patch

    patch.apply()
    saved_argv, saved_path0 = list(sys.argv), (sys.path[0] if sys.path else None)
    if not sys.path:
        sys.path.append("")
    saved_env = os.environ.get("OPCONTRACTS_MODE")
    prev_mode = None
    if opts.mode is not None:
        prev_mode = opcontracts.set_mode(opts.mode)
        os.environ["OPCONTRACTS_MODE"] = opts.mode  # for processes the script starts
    sentinel: NanSentinel | None = None
    if opts.nan_check:
        from .nan import NanSentinel

        sentinel = NanSentinel().enable()
    status = 1
    try:
        status = _execute(opts)
    finally:
        nan_result = sentinel.disable() if sentinel is not None else None
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        if prev_mode is not None:
            opcontracts.set_mode(prev_mode)
            if saved_env is None:
                os.environ.pop("OPCONTRACTS_MODE", None)
            else:
                os.environ["OPCONTRACTS_MODE"] = saved_env
        _finish(opts, nan_result)
        if not was_patched:
            patch.unpatch()
    return status


def _finish(opts: RunOptions, nan_result: Any) -> None:
    """Print the report (and the sentinel's finding) to stderr; write the JSON if asked."""
    from . import _report

    try:
        sys.stdout.flush()
    except Exception:  # pragma: no cover - a closed stdout must not hide the report
        pass
    rep = _report.report()
    err = sys.stderr
    print("", file=err)
    print(rep.table(), file=err)
    if nan_result is not None:
        print("", file=err)
        print(nan_result.summary(), file=err)
    if opts.report:
        path = _report.write_report(opts.report, rep)
        if nan_result is not None:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            data["nan_sentinel"] = nan_result.to_dict()
            with open(path, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, indent=2))
        print(f"opcontracts: report written to {path}", file=err)
    err.flush()
