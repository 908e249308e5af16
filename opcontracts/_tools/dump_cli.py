"""``opcontracts check-dump PATH`` and ``opcontracts record --from-dump PATH -o FILE``.

``add_parser(subparsers, load)`` adds both commands to ``opcontracts``' parser (one call in
``cli.build_parser``; ``load(extra_files)`` is the CLI's own loading of every contract a job
would load: shipped, ``OPCONTRACTS_CONTRACTS``, ``--contracts``).  Nothing heavier than
argparse is imported until a command runs.

Exit status of ``check-dump``: 0 when no recorded call violates a contract that applies (also
when the dump holds no call of an op with a contract, which it says), 1 when one does, 2 for a
usage error or a PATH that is not an msprobe dump (one line naming the file and the entry), 3
when calls of ops with a contract were recorded and none could be judged whole (no dtypes, no
inputs recorded...): no clean bill.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_parser"]

Loader = Callable[[Sequence[str]], Any]


def _versions_args(p: Any) -> None:
    p.add_argument("--torch-npu", metavar="V", help="the torch_npu version the dump was made "
                   "with (default: what `opcontracts env` detects; 'unknown' forces unknown)")
    p.add_argument("--cann", metavar="V", help="the CANN version (8.0.RC3, 8.5.0)")
    p.add_argument("--soc", metavar="S", help="the chip (Ascend910B3)")
    p.add_argument("--contracts", action="append", metavar="FILE",
                   help="extra contract file or folder (as `opcontracts list --contracts`)")


def add_parser(sub: Any, load: Loader) -> None:
    p = sub.add_parser(
        "check-dump", help="check an msprobe dump's recorded calls against the contracts, "
        "offline",
        description="Judge every call an msprobe dump recorded of an op with a contract "
        "(torch_npu's NPU.*, MindSpeed's MindSpeed.*, custom APIs) with the recorded dtypes and "
        "shapes; PyTorch's own APIs are counted and skipped, value rules skipped. Exit status "
        "0: no violation; 1: violations; 2: usage error or not an msprobe dump; 3: nothing "
        "could be judged (the report says what and why).")
    p.add_argument("path", metavar="PATH", help="an msprobe dump folder (step*/rank*/dump.json),"
                   " one step or rank folder, or one dump.json")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write the findings as JSON to FILE (bare or '-': to stdout, instead "
                   "of the table)")
    _versions_args(p)
    p.set_defaults(func=lambda ns: _cmd_check_dump(ns, load))
    r = sub.add_parser(
        "record", help="draft contracts from a known-good run's msprobe dump",
        description="Draft a contract file from what a known-good run passed, as recorded in "
        "its msprobe dump (the recorder of `opcontracts run --record`): per op, the dtypes and "
        "ranks seen, constant arguments; calls that violate a shipped contract are warned "
        "about and left out.")
    r.add_argument("--from-dump", required=True, metavar="PATH",
                   help="the golden run's msprobe dump (folder, step or rank folder, dump.json)")
    r.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the contract file to write (.toml)")
    r.add_argument("--record-violations", action="store_true",
                   help="keep the calls that violate a contract (warned about all the same)")
    _versions_args(r)
    r.set_defaults(func=lambda ns: _cmd_record(ns, load))


def _env(ns: Any) -> Any:
    from .check_dump import environment

    return environment(torch_npu=ns.torch_npu, cann=ns.cann, soc=ns.soc)


def _cmd_check_dump(ns: Any, load: Loader) -> int:
    from . import check_dump

    load(ns.contracts or ())
    result = check_dump.check_path(ns.path, _env(ns))
    from .._jsonout import json_text

    data = json_text(check_dump.to_json(result)) if ns.json else ""
    if ns.json == "-":
        print(data)
    else:
        print(check_dump.render(result))
        if ns.json:
            from .._jsonout import OutputError, write_text

            try:
                write_text(ns.json, data + "\n", "--json")
            except OutputError as exc:
                print(f"opcontracts check-dump: {exc}", file=sys.stderr)
                return 2
    return result.status


def _cmd_record(ns: Any, load: Loader) -> int:
    from .dump_record import record_dump

    load(ns.contracts or ())
    with warnings.catch_warnings(record=True) as seen:  # one line each, not warnings' format
        warnings.simplefilter("always", RuntimeWarning)
        res = record_dump(ns.from_dump, ns.output, _env(ns),
                          record_violations=ns.record_violations)
    for w in seen:
        print(f"{w.message}", file=sys.stderr)
    total = sum(res.recorded.values())
    broke = (f"{sum(res.left_out.values())} call(s) that broke a contract "
             + ("recorded too" if ns.record_violations else "left out")) if res.left_out else ""
    unread = (f"{sum(res.unread.values())} call(s) left out: an argument's record cannot be "
              "read (check-dump says which and why)") if res.unread else ""
    if not res.written:  # an empty golden file would make every compare against it vacuous
        why = "; ".join(x for x in (broke, unread) if x) or "no call of an op with a contract"
        print(f"opcontracts record: nothing recorded from {ns.from_dump} ({why}); "
              f"{res.path} not written"
              + (" (--record-violations keeps the calls that broke a contract)"
                 if res.left_out and not ns.record_violations else ""), file=sys.stderr)
        return 3
    print(f"opcontracts record: {total} call(s) of {len(res.recorded)} op(s) recorded from "
          f"{ns.from_dump} into {res.path}" + "".join(f"; {x}" for x in (broke, unread) if x),
          file=sys.stderr)
    return 0
