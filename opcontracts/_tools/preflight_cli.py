"""``opcontracts preflight``: a script's training step checked at full size on fake tensors.

    opcontracts preflight [--targets T ...] [--steps N] [--ranks N] [--json [FILE]]
                          [script.py [args ...] | -m module [args ...]]

The script runs as ``python`` would run it (``sys.argv``, ``__name__ == "__main__"``,
``sys.path[0]``) inside :class:`~opcontracts._tools.preflight.preflight`; without a script, the
demo's model at DeepSeek-V3 size (``preflight_demo``).  ``--ranks N`` runs rank 0 of an N-rank
job: torch's fake process group (``backend="fake"``, a ``FakeStore``) is the default group, and
the script's own ``init_process_group`` joins it whatever backend it names, so collectives
return at once with their shapes (an all-to-all's output is the shape the script gave it).
Exit status: 0 when every call holds, 1 when a call violates a contract, the step stopped on
something fake tensors cannot do or the script failed, 2 for a usage error.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._jsonout import check_writable, to_stdout, write_json
from ..errors import OpContractsError
from .scriptargs import UsageError, Words

__all__ = ["USAGE", "add_parser", "main"]

USAGE = ("usage: opcontracts preflight [-h] [--targets T] [--steps N] [--ranks N] "
         "[--json [FILE]] [script.py [args ...] | -m module [args ...]]")
HELP = f"""{USAGE}

Run a training script's real model code at full size on fake tensors (torch's FakeTensorMode:
shapes and dtypes, no memory, no compute) on the emulated npu device, every guarded call
judged against the declared targets.  Every violation is collected (none stops the step);
the report names each failing call, lists every guarded call site with its shapes and
verdict, and the step's peak device memory.  Without a script: the demo's MoE model at
DeepSeek-V3 size (hidden 7168, 256 experts, top-8, 61 layers, 4096 tokens), one step.

options:
  -h, --help      show this help message and exit
  --targets T     the stacks to judge on, in OPCONTRACTS_TARGETS' form
                  ('cann=8.0.RC3,soc=Ascend910B3'; repeatable); default: OPCONTRACTS_TARGETS,
                  else [tool.opcontracts] targets in pyproject.toml (for the demo: its
                  incident's stack)
  --steps N       stop after N optimizer steps (default 1)
  --ranks N       run rank 0 of an N-rank job on torch's fake process group
  --json [FILE]   the report as JSON in FILE (bare or -: on stdout, the text on stderr)
  -m module       run a library module as a script (like python -m)

exit status: 0 every guarded call holds; 1 a call violates a contract, the step stopped at a
line fake tensors cannot run (named), or the script failed; 2 a usage error.
"""


@dataclass
class Options:
    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    steps: int = 1
    ranks: int | None = None
    json: str | None = None
    help: bool = False


def _int(flag: str, raw: str, low: int) -> int:
    try:
        n = int(raw)
    except ValueError:
        raise UsageError(f"{flag}: expected a whole number, got {raw!r}") from None
    if n < low:
        raise UsageError(f"{flag}: expected at least {low}, got {n}")
    return n


def parse(argv: Sequence[str]) -> Options:
    """Options up to the script name (or ``-m module``); the rest are the script's."""
    opts = Options()
    words = Words(argv)
    value = words.value
    for w in words:
        if w in ("-h", "--help"):
            opts.help = True
            return opts
        if w == "--targets" or w.startswith("--targets="):
            opts.targets.append(value("--targets", w))
        elif w == "--steps" or w.startswith("--steps="):
            opts.steps = _int("--steps", value("--steps", w), 1)
        elif w == "--ranks" or w.startswith("--ranks="):
            opts.ranks = _int("--ranks", value("--ranks", w), 1)
        elif w == "--json" or w.startswith("--json="):
            raw = w.split("=", 1)[1] if "=" in w else None
            nxt = words.peek()
            # --json FILE unless the next word is the script (.py), an option, or -m
            if raw is None and nxt is not None and not nxt.endswith(".py") \
                    and (nxt == "-" or not nxt.startswith("-")):
                raw = words.take_next()
            opts.json = raw or "-"
        elif words.ends_here(w, opts, script_required=False):  # no script: the demo's model
            return opts
    return opts


def add_parser(sub: Any) -> None:
    import argparse

    p = sub.add_parser("preflight", help="check a training step at full size on fake tensors "
                       "(no memory, no compute) against the declared targets; `opcontracts "
                       "preflight --help` for options", add_help=False, prefix_chars="\x00",
                       usage=USAGE.removeprefix("usage: "))
    p.add_argument("argv", nargs=argparse.REMAINDER,
                   help="preflight's options, the script (or -m module) and its arguments")
    p.set_defaults(func=lambda ns: main(ns.argv))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{USAGE}\nopcontracts preflight: error: {exc}", file=sys.stderr)
        return 2
    if opts.help:
        print(HELP, end="")
        return 0
    if opts.script is not None and not os.path.isfile(opts.script):
        print(f"opcontracts preflight: can't open file {os.path.abspath(opts.script)!r}: "
              "[Errno 2] No such file or directory", file=sys.stderr)
        return 2
    try:
        if opts.json is not None:
            check_writable(opts.json, "--json")
        return _run(opts)
    except OpContractsError as exc:  # a bad --targets, an output that cannot be written
        print(f"opcontracts preflight: {exc}", file=sys.stderr)
        return 2


@contextmanager
def _fake_ranks(world: int | None) -> Iterator[None]:
    """Rank 0 of a ``world``-rank job on torch's fake process group; the script's own
    ``init_process_group`` joins it (whatever backend it names)."""
    if world is None:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    original = dist.init_process_group

    def init_process_group(*_: Any, **__: Any) -> None:  # the job's: already joined
        return None

    dist.init_process_group = init_process_group  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.init_process_group = original
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _execute(opts: Options) -> None:
    if opts.module is not None:
        sys.argv = [opts.module, *opts.args]
        sys.path[0] = os.getcwd()
        runpy.run_module(opts.module, run_name="__main__", alter_sys=True)
    else:
        assert opts.script is not None
        sys.argv = [opts.script, *opts.args]
        sys.path[0] = os.path.dirname(os.path.abspath(opts.script))
        runpy.run_path(opts.script, run_name="__main__")


def _script_error(exc: BaseException) -> str:
    """The script's own error, as python shows it, without this module's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


def _run(opts: Options) -> int:
    from .preflight import PreflightReport, PreflightStop, preflight

    report: PreflightReport | None = None
    failure: str | None = None
    intro = ""
    saved_argv, saved_path0 = list(sys.argv), (sys.path[0] if sys.path else None)
    if not sys.path:
        sys.path.append("")
    try:
        with _fake_ranks(opts.ranks):
            if opts.script is None and opts.module is None:
                from .preflight_demo import DEEPSEEK_V3, run_demo

                intro = (f"opcontracts preflight: the demo's MoE model at DeepSeek-V3 size "
                         f"({DEEPSEEK_V3.text()}), {opts.steps} training step(s)\n")
                report = run_demo(DEEPSEEK_V3, opts.targets or None, opts.steps).report
            else:
                pf = preflight(opts.targets or None, steps=opts.steps)
                try:
                    with pf:
                        _execute(opts)
                except SystemExit as exc:  # the script ended itself
                    code = exc.code
                    if code not in (None, 0):
                        failure = f"the script exited with status {code}"
                report = pf.report
    except PreflightStop as exc:
        report = exc.report
    except OpContractsError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the script's own error, shown as python does
        if isinstance(exc, KeyboardInterrupt):
            raise
        failure = "the script failed:\n" + _script_error(exc)
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
    if report is None:
        report = PreflightReport()
    if opts.ranks is not None:
        intro += f"rank 0 of {opts.ranks} (torch's fake process group)\n"
    text = intro + report.text() + (f"\n\n{failure}" if failure else "")
    out = sys.stderr if opts.json is not None and to_stdout(opts.json) else sys.stdout
    print(text, file=out)
    if opts.json is not None:
        data = report.to_dict()
        data.update(ranks=opts.ranks, script=opts.script, module=opts.module, failure=failure)
        write_json(opts.json, data, option="--json")
        if not to_stdout(opts.json):
            print(f"opcontracts preflight: report written to {opts.json}", file=out)
    return 0 if report.ok and failure is None else 1
