"""``opcontracts run``: run a user's script or module with ``opcontracts.patch`` applied.

    opcontracts run [--mode MODE] [--nan-check] [--compare [RATE]] [--record FILE
                    [--record-target mod.fn ...]] [--report FILE] [--quiet]
                    [--emulate[=PROFILE] [--devices N] [--soc NAME]] script.py [args ...]
    opcontracts run [options] -m module [args ...]

Why: guarding a job should not need an edit of the job.  The script runs as ``python`` would
run it (as ``coverage run`` does): ``sys.argv`` is ``[script, *args]``, ``__name__`` is
``"__main__"``, ``sys.path[0]`` is the script's folder (the current folder for ``-m``).  Options
are read up to the script name; every word after it belongs to the script.

At exit (also after an exception or Ctrl-C) the violation report is printed to stderr, then
what was checked (guarded targets, calls checked, ops seen, calls skipped by mode: a report with
no violations means something only next to it), the NaN sentinel's finding (``--nan-check``) and
the shadow compare's (``--compare``); ``--record FILE`` writes the golden run's contract file;
``--report FILE`` also writes everything as JSON (``report.rank{R}.json`` per rank under
torchrun).  Under torchrun the summary is printed once, by rank 0, merged over the ranks
(``_ranks.rankmerge``).  ``--quiet`` prints nothing at exit unless there is a violation, a NaN finding
or a divergence.  The exit status is the script's: its ``SystemExit`` code, 1 (with the
traceback) for an uncaught exception, 130 for Ctrl-C; 2 for run's own errors, an output that
cannot be written among them (checked before the script starts; one lost after a script that
exited 0 makes it 2).  Output paths are made absolute before the script starts (a script that
changes folder does not move them); with ``--json`` on stdout the script's stdout goes to
stderr while it runs, so stdout holds the JSON alone.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._jsonout import check_writable
from ..errors import OpContractsError
from .scriptargs import UsageError, Words

if TYPE_CHECKING:
    from .._observers.stats import CallStats
    from ..compare import ShadowCompare
    from ..nan import NanSentinel
    from ..record import Recorder

__all__ = ["RunOptions", "UsageError", "main", "parse", "run"]

USAGE = ("usage: opcontracts run [-h] [--mode MODE] [--contracts PATH] [--nan-check] "
         "[--compare [RATE]] [--record FILE [--record-target mod.fn] [--record-violations]] "
         "[--report FILE] [--json [FILE]] [-q] [--emulate[=PROFILE] [--devices N] [--soc NAME]] "
         "(script.py | -m module) [args ...]")
HELP = f"""{USAGE}

Run a Python script (or a module with -m) with opcontracts.patch applied, as python would run it,
and print the contract violation report to stderr when it ends.  The options go before the
script name; everything after it goes to the script.

positional arguments:
  script.py        the script to run (a file, or a folder or zip file with __main__.py; or
                   -m module); every word after it goes to the script
  args             the script's own arguments

options:
  -h, --help       show this help message and exit
  --mode MODE      strict, warn, fix or off (default: OPCONTRACTS_MODE, else warn)
  --contracts PATH also load the contracts of this file or folder (repeatable; added to the
                   shipped ones, as OPCONTRACTS_CONTRACTS is, and passed on to the processes
                   the script starts); a file with a problem stops the run (exit status 2)
  --nan-check      the always-on NaN sentinel (opcontracts.nan): each optimizer step checked
                   (one host read), a non-finite one skipped and the guarded ops watched
                   from the next step until the NaN recurs (and until the first optimizer
                   step); its finding is printed with the report
  --compare [RATE] compare guarded calls with their plain-PyTorch references (forward and
                   backward, msprobe's thresholds; opcontracts.compare); RATE is the fraction
                   of calls compared (seeded; default 1)
  --record FILE    record the dtypes, ranks and constant arguments of every guarded call and
                   write them as a contract file (a golden run: use it later with
                   OPCONTRACTS_CONTRACTS=FILE to flag any drift)
  --record-target mod.fn
                   also record calls of this callable (no contract needed; repeatable)
  --record-violations
                   also record the calls that break a contract (by default each is warned
                   about and left out: a golden file never pins a dtype the rules reject)
  --report FILE    also write the report as JSON (FILE.rank{{R}}.json per rank when distributed)
  --json [FILE]    the report as JSON: in FILE (as --report), or on stdout (bare --json, or
                   --json -: the JSON alone, after the script, rank 0 only; the script's own
                   stdout goes to stderr meanwhile)
  -q, --quiet      at exit, one line when there is a contract violation, a NaN finding or a
                   divergence, nothing otherwise (the files are still written, silently)
  --emulate[=PROFILE]
                   run on the CPU emulation of torch_npu 2.13 with an emulated npu device
                   (opcontracts.emulation, device=True; PROFILE: narrow (default), incident,
                   wide), so an unmodified torch_npu script runs on a machine without an NPU
  --devices N      with --emulate: emulate N npu devices (npu:0 ... npu:N-1; default 1, or
                   OPCONTRACTS_EMULATE_DEVICES, which the processes the script starts inherit)
  --soc NAME       with --emulate: the chip the emulated device reports (default Ascend910B3, or
                   OPCONTRACTS_EMULATE_SOC, which the script's processes inherit): Ascend950PR
                   takes the Ascend 950 paths of torch_npu's glue, the contracts and the tests
  -m module        run a library module as a script (like python -m)

exit status: the script's own (SystemExit code; 1 on an uncaught exception; 130 on Ctrl-C);
2 for a usage error, a script or module that cannot be opened, a --contracts file with a
problem, or an output (--report, --record, --json) that cannot be written (checked before the
script starts; output paths are taken from the folder run starts in, even if the script
changes folder).
"""

_MODES = ("strict", "warn", "fix", "off")
DEVICES_ENV = "OPCONTRACTS_EMULATE_DEVICES"  # emulation._device.DEVICES_ENV (imported lazily)
SOC_ENV = "OPCONTRACTS_EMULATE_SOC"  # emulation._device.SOC_ENV
CHILD_ENV = "OPCONTRACTS_EMULATE_CHILD"  # the profile the script's Python children install
_CHILD_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child_site")


@dataclass
class RunOptions:
    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    mode: str | None = None
    nan_check: bool = False
    compare: float | None = None  # the sample rate, None: off
    record: str | None = None
    record_targets: list[str] = field(default_factory=list)
    record_violations: bool = False
    quiet: bool = False
    report: str | None = None
    json: str | None = None  # "-": stdout
    contracts: list[str] = field(default_factory=list)
    emulate: str | None = None  # the emulation's profile, None: no emulation
    devices: int | None = None  # --devices N: npu devices to emulate
    soc: str | None = None  # --soc NAME: the chip the emulated device reports
    help: bool = False


def parse(argv: Sequence[str]) -> RunOptions:
    """Options up to the script name (or ``-m module``); the rest are the script's."""
    opts = RunOptions()
    words = Words(argv)
    value = words.value
    for w in words:
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
        elif w == "--compare" or w.startswith("--compare="):
            opts.compare = 1.0
            raw = w.split("=", 1)[1] if "=" in w else None
            nxt = words.peek()
            if raw is None and nxt is not None and _is_number(nxt):
                raw = words.take_next()  # a number after --compare is its rate (1.5: a wrong one)
            if raw is not None:
                if not _is_rate(raw):
                    raise UsageError(f"--compare: the rate must be a number in [0, 1], "
                                     f"got {raw!r}")
                opts.compare = float(raw)
        elif w == "--record-violations":
            opts.record_violations = True
        elif w == "--record" or w.startswith("--record="):
            opts.record = value("--record", w)
        elif w == "--record-target" or w.startswith("--record-target="):
            t = value("--record-target", w)
            if "." not in t or not all(part.isidentifier() for part in t.split(".")):
                raise UsageError(f"--record-target: expected a dotted path such as "
                                 f"'mypkg.model.route', got {t!r}")
            if t.split(".")[0] == "__main__":
                raise UsageError(f"--record-target {t}: the script's own functions cannot be "
                                 "watched (it is not a module that can be patched before it "
                                 "runs); move the function into a module the script imports")
            opts.record_targets.append(t)
        elif w in ("--quiet", "-q"):
            opts.quiet = True
        elif w == "--emulate" or w.startswith("--emulate="):
            opts.emulate = w.split("=", 1)[1] if "=" in w else "narrow"
            _check_profile(opts.emulate)
        elif w == "--devices" or w.startswith("--devices="):
            opts.devices = _check_devices(value("--devices", w))
        elif w == "--soc" or w.startswith("--soc="):
            opts.soc = _check_soc(value("--soc", w))
        elif w == "--report" or w.startswith("--report="):
            opts.report = value("--report", w)
        elif w == "--json" or w.startswith("--json="):
            raw = w.split("=", 1)[1] if "=" in w else None
            nxt = words.peek()
            # --json FILE, unless the next word is the script (a .py file), an option or the
            # last word (then bare --json: stdout)
            if raw is None and nxt is not None and words.peek(2) is not None \
                    and not nxt.endswith(".py") and (nxt == "-" or not nxt.startswith("-")):
                raw = words.take_next()
            opts.json = raw or "-"
        elif w == "--contracts" or w.startswith("--contracts="):
            opts.contracts.append(value("--contracts", w))
        elif words.ends_here(w, opts, script_required=True):
            return opts
    raise UsageError("a script or -m module is required")


def _check_profile(name: str) -> None:
    from ..emulation import PROFILES  # the emulation's names (its install is lazy)

    if name not in PROFILES:
        raise UsageError(f"--emulate: unknown profile {name!r}; expected one of "
                         f"{', '.join(PROFILES)}")


def _check_soc(word: str) -> str:
    from ..emulation import _device
    from ..errors import SettingError

    try:
        return _device.soc_setting(word)
    except SettingError as exc:
        raise UsageError(f"--soc: {exc}") from None


def _check_devices(word: str) -> int:
    from ..emulation import _device
    from ..errors import SettingError

    try:
        return _device.devices_setting(word)
    except SettingError as exc:
        raise UsageError(f"--devices: {exc}") from None


def _is_rate(word: str) -> bool:
    return _is_number(word) and 0.0 <= float(word) <= 1.0


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _check(opts: RunOptions) -> RunOptions:
    if opts.record_targets and opts.record is None:
        raise UsageError("--record-target needs --record FILE (where to write the golden run)")
    if opts.record_violations and opts.record is None:
        raise UsageError("--record-violations needs --record FILE")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = _check(parse(sys.argv[1:] if argv is None else argv))
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
    """The traceback without this module's and runpy's frames, as python shows it; for a
    contract violation, without opcontracts' frames at its end either (the guard's raise): it
    ends at the user's call."""
    from ..errors import ContractViolation

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    if not isinstance(exc, ContractViolation):
        return tb
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    while len(frames) > 1 and str(frames[-1].tb_frame.f_globals.get("__name__", "")) \
            .startswith("opcontracts."):
        frames.pop()
    out: TracebackType | None = None
    for t in reversed(frames):
        out = TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


def _print_exception(exc: BaseException) -> None:
    if getattr(exc, "opcontracts_not_emulated", False):  # an import the emulation lacks
        print(_not_emulated_line(exc), file=sys.stderr)
        return
    traceback.print_exception(type(exc), exc, _user_traceback(exc), file=sys.stderr)


def _not_emulated_line(exc: BaseException) -> str:
    """One line for an import of a module the emulation does not have: where the script
    imports it, then what is missing and what the emulation has."""
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "importlib" not in frame.filename and not frame.filename.startswith("<frozen") \
                and "/opcontracts/" not in frame.filename.replace("\\", "/"):
            where = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}: "
            break
    return f"opcontracts run: {where}{exc}"


def _execute(opts: RunOptions) -> int:
    """Run the script in this process; its exit status."""
    try:
        if opts.module is not None:
            sys.argv = [opts.module, *opts.args]  # run_module puts the file in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(opts.module, run_name="__main__", alter_sys=True)
        else:
            assert opts.script is not None
            sys.argv = [opts.script, *opts.args]
            # python puts a script's folder first on sys.path; for a folder or zip file with a
            # __main__ module, the folder or zip itself (run_path puts it first too)
            script = os.path.abspath(opts.script)
            sys.path[0] = script if not os.path.isfile(script) or \
                _is_zip(script) else os.path.dirname(script)
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


def _is_zip(path: str) -> bool:
    import zipfile

    try:
        return zipfile.is_zipfile(path)
    except OSError:  # pragma: no cover - unreadable: run_path says so
        return False


def _module_found(name: str) -> bool:
    """Whether ``-m name`` names a module (looked up from the current folder, as python -m)."""
    import importlib.util

    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        if added:
            sys.path.remove(os.getcwd())


def run(opts: RunOptions) -> int:
    """Apply the patch and the mode, run the script, report; process state is restored
    afterwards (``sys.argv``, ``sys.path[0]``, the mode, the patch if it was not applied)."""
    if opts.script is not None and (why := _unrunnable(opts.script)) is not None:
        print(f"opcontracts run: {why}", file=sys.stderr)
        return 2
    if opts.module is not None and not _module_found(opts.module):
        print(f"opcontracts run: No module named {opts.module}", file=sys.stderr)
        return 2
    try:  # an output that cannot be written is said now, not after hours of work
        for path, flag in ((opts.report, "--report"), (opts.record, "--record"),
                           (opts.json, "--json")):
            if path is not None:
                check_writable(path, flag)
    except OpContractsError as exc:
        print(f"opcontracts run: {exc}", file=sys.stderr)
        return 2
    # where the user meant them, even if the script changes folder (hydra does)
    opts.report, opts.record, opts.json = (
        p if p is None or p == "-" else os.path.abspath(p)
        for p in (opts.report, opts.record, opts.json))
    if opts.contracts:  # named on the command line: a bad file stops the run here
        from .._attach.use import use

        try:
            use(*opts.contracts)
        except OpContractsError as exc:
            print(f"opcontracts run: --contracts: {exc}", file=sys.stderr)
            return 2
    saved_devices, saved_soc = os.environ.get(DEVICES_ENV), os.environ.get(SOC_ENV)
    saved_child = (os.environ.get(CHILD_ENV), os.environ.get("PYTHONPATH"))
    emulated = _emulate(opts.emulate, opts.devices, opts.soc)
    if emulated is None:
        return 2
    patch_mod = sys.modules.get("opcontracts.patch")
    was_patched = patch_mod is not None and patch_mod.is_applied()
    import opcontracts.patch as patch

    from .._lang import modes

    patch.apply()
    saved_contracts = os.environ.get("OPCONTRACTS_CONTRACTS")
    if opts.contracts:  # the processes the script starts (torchrun workers) load them too
        os.environ["OPCONTRACTS_CONTRACTS"] = os.pathsep.join(
            [*(os.path.abspath(p) for p in opts.contracts), *filter(None, [saved_contracts])])
    saved_argv, saved_path0 = list(sys.argv), (sys.path[0] if sys.path else None)
    if not sys.path:
        sys.path.append("")
    saved_env = os.environ.get("OPCONTRACTS_MODE")
    prev_mode = None
    if opts.mode is not None:
        prev_mode = modes.set_mode(opts.mode)
        os.environ["OPCONTRACTS_MODE"] = opts.mode  # for processes the script starts
    watchers = _Watchers(opts)
    status = 1
    written = True
    try:
        watchers.start()
        with _script_stdout(opts):
            status = _execute(opts)
    finally:
        results = watchers.stop()
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        written = _finish(opts, results)  # in the run's mode: the report file says which it was
        if prev_mode is not None:
            modes.set_mode(prev_mode)
            if saved_env is None:
                os.environ.pop("OPCONTRACTS_MODE", None)
            else:
                os.environ["OPCONTRACTS_MODE"] = saved_env
        if opts.contracts:
            if saved_contracts is None:
                os.environ.pop("OPCONTRACTS_CONTRACTS", None)
            else:
                os.environ["OPCONTRACTS_CONTRACTS"] = saved_contracts
        if not was_patched:
            patch.unpatch()
        if emulated:
            from .. import emulation

            emulation.uninstall()
        if opts.devices is not None:
            _restore_env(DEVICES_ENV, saved_devices)
        if opts.soc is not None:
            _restore_env(SOC_ENV, saved_soc)
        if opts.emulate is not None:
            _restore_env(CHILD_ENV, saved_child[0])
            _restore_env("PYTHONPATH", saved_child[1])
    if not written and status == 0:  # the script did its part; an asked-for file is lost
        return 2
    return status


@contextlib.contextmanager
def _script_stdout(opts: RunOptions) -> Iterator[None]:
    """With ``--json`` on stdout, the script's own stdout goes to stderr while it runs (its
    ``print``s, a subprocess's or a C library's writes to file descriptor 1), so that stdout
    holds the JSON alone, written after the script; otherwise nothing changes."""
    if opts.json != "-":
        yield
        return
    try:
        sys.stdout.flush()
    except Exception:  # pragma: no cover - a closed stdout
        pass
    saved = None
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # pragma: no cover - no descriptor 1 or 2: Python's own streams only
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # pragma: no cover - the script closed them
            pass
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _unrunnable(script: str) -> str | None:
    """Why ``script`` cannot be run, in python's words, or None: a file, or a folder or zip
    file with a ``__main__`` module (as ``python app/`` and ``runpy.run_path`` run it)."""
    if os.path.isfile(script):
        return None
    if os.path.isdir(script):
        if any(os.path.isfile(os.path.join(script, "__main__" + ext))
               for ext in (".py", ".pyc")):
            return None
        return f"can't find '__main__' module in {script!r}"
    return f"can't open file {os.path.abspath(script)!r}: [Errno 2] No such file or directory"


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _emulate(profile: str | None, devices: int | None = None, soc: str | None = None
             ) -> bool | None:
    """Install the emulation with its npu device for ``--emulate`` (``devices`` of them,
    reporting ``soc``, which the processes the script starts inherit through the environment):
    True when this run installed it, False when there is nothing to do, None (and a line on
    stderr) when it cannot be installed (a real torch_npu is present, ``--devices`` or ``--soc``
    without ``--emulate``, a bad ``OPCONTRACTS_EMULATE_DEVICES`` or ``_SOC``)."""
    if profile is None:
        for flag, given in (("--devices", devices), ("--soc", soc)):
            if given is not None:
                print(f"opcontracts run: {flag} needs --emulate (a machine's real NPUs are the "
                      "devices it has)", file=sys.stderr)
                return None
        return False
    from .. import emulation
    from ..errors import SettingError

    if devices is not None:
        os.environ[DEVICES_ENV] = str(devices)
    if soc is not None:
        os.environ[SOC_ENV] = soc
    was_installed = emulation.installed()
    try:
        emulation.install(profile, device=True)
    except (RuntimeError, SettingError) as exc:
        print(f"opcontracts run: --emulate: {exc}", file=sys.stderr)
        return None
    # the Python processes the script starts (spawned workers, torchrun's ranks) install the
    # same emulation at start-up (_child_site/sitecustomize.py)
    os.environ[CHILD_ENV] = profile
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_CHILD_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])
    return not was_installed


# --------------------------------------------------------------------------- observers
@dataclass
class _Results:
    stats: Any = None       # RunStats
    nan: Any = None         # NanResult
    compare: Any = None     # CompareResult
    recorder: Recorder | None = None
    problems: list[str] = field(default_factory=list)


class _Watchers:
    """The observers of the guarded calls a run attaches (``_observers.layer``): the call statistics
    always, the sentinel, the compare and the recorder when asked."""

    def __init__(self, opts: RunOptions) -> None:
        self.opts = opts
        self.stats: CallStats | None = None
        self.sentinel: NanSentinel | None = None
        self.compare: ShadowCompare | None = None
        self.recorder: Recorder | None = None
        self.problems: list[str] = []

    def start(self) -> None:
        from .._observers import layer
        from .._observers.stats import CallStats

        self.stats = CallStats()
        layer.attach(self.stats, who="opcontracts run")
        if self.opts.nan_check:
            from ..nan import NanSentinel

            # always-on: each optimizer.step() checked (one fused reduction, one host read),
            # a non-finite one skipped and the watch armed from the next step (the step's
            # function is not known here: no replay); the watch is on until the first
            # optimizer.step() (a first-step NaN, a script without an optimizer)
            self.sentinel = NanSentinel(always_on=True, on_nan="record",
                                        watch_first=True).enable()
        if self.opts.compare is not None:
            from ..compare import ShadowCompare

            # judged at each optimizer.step() (one host read per step) and at the end
            self.compare = ShadowCompare(sample=self.opts.compare, step_hook=True).enable()
        if self.opts.record is not None:
            from ..record import Recorder

            watch = {t: t for t in self.opts.record_targets}
            rv = self.opts.record_violations
            try:
                self.recorder = Recorder(watch=watch, record_violations=rv).enable()
            except layer.WatchError as exc:
                self.problems.append(f"--record-target: {exc}")
                self.recorder = Recorder(record_violations=rv).enable()

    def stop(self) -> _Results:
        from .._observers import layer

        out = _Results(problems=self.problems)
        if self.sentinel is not None:
            out.nan = self.sentinel.disable()
        if self.compare is not None:
            out.compare = self.compare.disable()
        if self.recorder is not None:
            out.recorder = self.recorder.disable()
        if self.stats is not None:
            layer.detach(self.stats)
            out.stats = self.stats.snapshot()
        return out


# --------------------------------------------------------------------------- the end of a run
def _world() -> tuple[int | None, int]:
    from .._engine.records import current_rank

    rank = current_rank()
    ws = os.environ.get("WORLD_SIZE", "")
    world = int(ws) if ws.isdigit() else 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
    except Exception:  # pragma: no cover - a broken backend must not hide the report
        pass
    return rank, world


def _payload(rep: Any, res: _Results) -> dict[str, Any]:
    return {
        "report": rep.to_dict(),
        "checked": res.stats.to_dict() if res.stats is not None else None,
        "nan_sentinel": res.nan.to_dict() if res.nan is not None else None,
        "shadow_compare": res.compare.to_dict() if res.compare is not None else None,
    }


def _finish(opts: RunOptions, res: _Results) -> bool:
    """Write the files (report JSON, golden run), then print the summary to stderr: rank 0
    alone, merged over the ranks, under torchrun.  Whether every file asked for was written."""
    from .._engine import records as _report

    try:
        sys.stdout.flush()
    except Exception:  # pragma: no cover - a closed stdout must not hide the report
        pass
    err = sys.stderr
    rep = _report.report()
    rank, world = _world()
    if res.stats is not None and rank is not None:
        res.stats.ranks = [rank]
    notes: list[str] = []
    written = True
    if res.recorder is not None and opts.record:
        seen = res.recorder.calls()
        patch = sys.modules.get("opcontracts.patch")
        missing = patch.missing() if patch is not None else {}
        for t in opts.record_targets:
            if not seen.get(t):  # named, never recorded: say why rather than nothing
                why = missing.get(t) or "never called (or reached through a name bound " \
                    "before the patch)"
                res.problems.append(f"--record-target {t}: no call recorded: {why}")
        try:
            golden = res.recorder.write(_report.report_path_for_rank(opts.record, rank),
                                        script=opts.script or f"-m {opts.module}")
            n = len(res.recorder.calls())
            notes.append(f"opcontracts: golden run recorded to {golden} ({n} op(s)); use it "
                         f"with OPCONTRACTS_CONTRACTS={golden}")
        except OSError as exc:
            res.problems.append(f"--record: cannot write {opts.record}: {exc}")
            written = False
    payload = _payload(rep, res)
    extra = {k: v for k, v in payload.items() if k != "report" and v is not None}
    for target, flag in ((opts.report, "--report"), (opts.json, "--json")):
        if target is None or (target == "-" and rank not in (None, 0)):
            continue
        try:
            path = _report.write_report(target, rep, extra=extra, option=flag)
        except OpContractsError as exc:  # checked before the run; a disk that filled since
            res.problems.append(str(exc))
            written = False
            continue
        if path != "-":
            notes.append(f"opcontracts: report written to {path}")
    parts: list[dict[str, Any]] | None = None
    if world > 1 and rank is not None:
        from .._ranks.rankmerge import exchange

        parts = exchange(payload, rank, world)
    if parts == []:  # another rank: rank 0 prints for everyone
        lines: list[str] = []
    elif parts:
        lines = _merged_lines(parts, world, opts.quiet, _details(opts))
    else:
        lines = _summary_lines(rep, res, opts.quiet, _details(opts))
    if not opts.quiet:  # --quiet: the files asked for are written without a word
        lines += notes
    lines += [f"opcontracts run: {p}" for p in res.problems]
    if lines:
        print("", file=err)
        print("\n".join(lines), file=err)
    err.flush()
    return written


def _details(opts: RunOptions) -> str | None:
    """The report file this run writes (``--report``, or ``--json FILE``), where ``--quiet``'s
    line points for the details; None when none is written."""
    return opts.report or (opts.json if opts.json not in (None, "-") else None)


def _quiet_line(violations: int, records: Any, nan: bool, diverged: bool,
                details: str | None = None) -> list[str]:
    """``--quiet``: one line, only when there is something to look at; it points at the
    report file when one is written (``details``), else says how to get one."""
    parts = []
    if violations:
        ops = sorted({r.op for r in records})
        parts.append(f"{violations} contract violation(s) at {len(records)} site(s) ("
                     + ", ".join(ops[:3]) + (", ..." if len(ops) > 3 else "") + ")")
    if nan:
        parts.append("a NaN/inf finding")
    if diverged:
        parts.append("a divergence from the reference")
    if not parts:
        return []
    where = f"details in {details}" if details else \
        "run without --quiet, or --report FILE, for the details"
    return ["opcontracts: " + ", ".join(parts) + f" ({where})"]


def _summary_lines(rep: Any, res: _Results, quiet: bool,
                   details: str | None = None) -> list[str]:
    """This process's summary: violations, what was checked, the findings."""
    if quiet:
        nan, cmp = res.nan, res.compare
        return _quiet_line(rep.total, rep.records,
                           nan is not None and (nan.first is not None or nan.received is not None),
                           cmp is not None and cmp.first is not None, details)
    lines: list[str] = []
    stats = res.stats
    if rep.records:
        lines.append(rep.table())
    elif stats is None or stats.checked:
        lines.append("opcontracts: no contract violations.")
    if stats is not None:
        lines += stats.lines()
    if res.nan is not None:
        lines += ["", res.nan.summary()]
    if res.compare is not None:
        lines += ["", res.compare.summary()]
    return lines


def _merged_lines(parts: list[dict[str, Any]], world: int, quiet: bool,
                  details: str | None = None) -> list[str]:
    """Rank 0's summary for the whole job, from every rank's part."""
    from .._engine.records import Report, merge_reports
    from .._observers.sections import RunStats, merge_stats

    ranks = sorted(int(p["rank"]) for p in parts)
    reports = []
    for p in parts:
        r = Report.from_dict(p["report"])
        for rec in r.records:
            if not rec.ranks:
                rec.ranks = [int(p["rank"])]
        reports.append(r)
    merged = merge_reports(reports)
    stats = merge_stats([RunStats.from_dict({**p["checked"], "ranks": [p["rank"]]})
                         for p in parts if p.get("checked")])
    if quiet:
        return _quiet_line(merged.total, merged.records,
                           any(p.get("nan_sentinel") and p["nan_sentinel"].get("first")
                               for p in parts),
                           any(p.get("shadow_compare") and p["shadow_compare"].get("first")
                               for p in parts), details)
    lines = [f"opcontracts: summary of {len(parts)} of {world} rank(s)"
             + ("" if len(parts) == world else
                f" (no summary from rank(s) {','.join(str(r) for r in range(world) if r not in ranks)}"
                " in time: see their report files)")]
    if merged.records:
        lines.append(merged.table())
    elif stats.checked:
        lines.append("opcontracts: no contract violations.")
    lines += stats.lines()
    nan_parts = [p for p in parts if p.get("nan_sentinel") is not None]
    if nan_parts:
        hits = [(p["rank"], p["nan_sentinel"]["first"]) for p in nan_parts
                if p["nan_sentinel"].get("first")]
        lines.append("NaN sentinel: " + ("first non-finite value per rank" if hits
                                         else "nothing found on any rank"))
        for r, e in sorted(hits):
            where = e.get("module") or e.get("module_type") or "?"
            lines.append(f"  rank {r}: {e['direction']}, {e['op']}, {e.get('arg', '?')} "
                         f"[{where}] at {e.get('call_site') or '?'}")
    cmp_parts = [(p["rank"], p["shadow_compare"]) for p in parts
                 if p.get("shadow_compare") is not None]
    if cmp_parts:
        from .._observers.sections import merge_sections, merged_lines

        lines += merged_lines(merge_sections(cmp_parts))
    return lines
