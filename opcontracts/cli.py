"""The ``opcontracts`` command line: ``list``, ``env`` (and more subcommands as they land)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._versions import Env
    from .spec import Arg, Contract, When

__all__ = ["main"]


def _dt(names: Sequence[str]) -> str:
    from ._dtypes import parse_dtype, short_name

    return "/".join(short_name(parse_dtype(n)) for n in names)


def _rules(arg: Arg) -> str:
    """One line per argument: every rule the checker will run, in the contract's own words."""
    parts = []
    if arg.tensor_list:
        parts.append("list" + (f" (<= {arg.max_len})" if arg.max_len is not None else ""))
    if arg.dtype:
        parts.append(_dt(arg.dtype))
    if arg.same_dtype_as:
        text = f"dtype of {arg.same_dtype_as}"
        for k, v in (arg.same_dtype_except or {}).items():
            text += f" (or {_dt(v)} when it is {_dt([k])})"
        parts.append(text)
    if arg.shape:
        parts.append(" | ".join(f"({s})" for s in arg.shape))
    if arg.rank:
        parts.append("rank " + "/".join(map(str, arg.rank)))
    for name, b in (arg.dims or {}).items():
        for op_name, sym in (("ge", ">="), ("le", "<="), ("lt", "<")):
            if getattr(b, op_name) is not None:
                parts.append(f"{name} {sym} {getattr(b, op_name)}")
    if arg.numel_lt is not None:
        parts.append(f"numel < {arg.numel_lt}")
    if arg.same_shape_as:
        parts.append(f"shape of {arg.same_shape_as}")
    if arg.int_list:
        parts.append("or a list of ints")
    if arg.contiguous:
        parts.append("contiguous")
    if arg.allowed is not None:
        parts.append("one of " + ", ".join(map(repr, arg.allowed)))
    for op_name, sym in (("ge", ">="), ("le", "<="), ("lt", "<")):
        if getattr(arg, op_name) is not None:
            parts.append(f"{sym} {getattr(arg, op_name)}")
    if arg.optional:
        parts.append("optional")
    if arg.values is not None:
        from ._values import describe

        parts.append("values: " + describe(arg.values))
    return ", ".join(parts) or "-"


def _when_text(when: When) -> str:
    out = []
    for k, v in when.model_dump().items():
        if v:
            out.append(f"soc {' or '.join(v)}" if k == "soc" else f"{k} {v}")
    return ", ".join(out)


def _target_status(target: str) -> str:
    """Whether a target can be reached here, without importing anything: a module target whose
    top-level package is not installed, or a ``torch.ops`` op not registered, is reported (the
    patch would leave it pending; a job never fails on it)."""
    import importlib.util
    import sys

    parts = target.split(".")
    if parts[:2] == ["torch", "ops"] and len(parts) == 4:
        import torch

        try:
            getattr(getattr(torch.ops, parts[2]), parts[3])
        except (AttributeError, RuntimeError):
            return " (not registered here)"
        return ""
    if parts[0] in sys.modules:
        return ""
    try:
        found = importlib.util.find_spec(parts[0]) is not None
    except (ImportError, ValueError):
        found = False
    return "" if found else " (not installed here)"


def _print_contract(c: Contract, status: str, indent: str = "  ") -> None:
    print(f"{indent}[{status}]")
    if c.when is not None:
        print(f"{indent}  when:    {_when_text(c.when)}")
    targets = [t + _target_status(t) for t in c.targets]
    print(f"{indent}  targets: {', '.join(targets) or '-'}")
    print(f"{indent}  source:  {c.source or '-'}")
    width = max((len(n) for n in c.args), default=0)
    for name, a in c.args.items():
        print(f"{indent}  {name:<{width}}  {_rules(a)}")


def _env_line(env: Env) -> str:
    from . import _versions

    parts = []
    for name in _versions.FIELDS:
        v = getattr(env, name)
        text = f"{name} {v or 'unknown'}"
        if name in env.emulated:
            text += " (emulation)"
        parts.append(text)
    return ", ".join(parts)


def _cmd_list(ns: argparse.Namespace) -> int:
    """Contracts grouped by op.  Per op: each contract with whether it applies here and why
    (``explain``), then, when several apply (a version is unknown, or a chip-specific table
    adds to a version table), the strictest merge that is actually enforced."""
    from . import _registry, _versions
    from .errors import OpContractsError

    try:
        _registry.load_shipped()
        for path in ns.contracts or ():
            from .spec import load_contracts

            _registry.register(load_contracts(path), replace=True)
    except OpContractsError as exc:
        print(f"opcontracts: {exc}", file=sys.stderr)
        return 2
    env = _versions.current()
    contracts = _registry.all_contracts()
    by_op: dict[str, list[Contract]] = {}
    for c in sorted(contracts, key=lambda c: (c.op, c.file or "")):
        by_op.setdefault(c.op, []).append(c)
    verdicts_by_op = {op: [(c, _versions.applies(c.when, env)) for c in lst]
                      for op, lst in by_op.items()}
    print(f"environment: {_env_line(env)}")
    if any(ok is None for v in verdicts_by_op.values() for _, ok in v):
        print("  a version some contracts need is unknown: those contracts may apply and are "
              "merged into the strictest reading (see `opcontracts env`)")
    print()
    shown = hidden = 0
    for op, verdicts in verdicts_by_op.items():
        visible = [(c, ok) for c, ok in verdicts if ns.all or ok is not False]
        hidden += len(verdicts) - len(visible)
        if not visible:
            continue
        print(op)
        for c, ok in visible:
            shown += 1
            why = _versions.explain(c.when, env)
            status = {True: "applies", None: "may apply", False: "does not apply"}[ok]
            if c.when is not None:
                status += f": {why}"
            _print_contract(c, status)
        applying = [c for c, ok in verdicts if ok is not False]
        if len(applying) > 1:
            merged = _registry.resolve(op)
            if merged is not None:
                print(f"  => enforced: the strictest merge of these {len(applying)} contracts")
                width = max((len(n) for n in merged.args), default=0)
                for name, a in merged.args.items():
                    print(f"       {name:<{width}}  {_rules(a)}")
        print()
    tail = f"{shown} contract(s) shown for {len(by_op)} op(s), {len(contracts)} loaded"
    if hidden and not ns.all:
        tail += f"; {hidden} do not apply here (--all shows them and why)"
    print(tail)
    return 0


def _cmd_env(ns: argparse.Namespace) -> int:
    """The versions that decide which contracts apply, and where each was found, so a wrong
    guess (a stand-in, a stale ``ASCEND_TOOLKIT_HOME``) is visible."""
    from . import _versions

    rows = _versions.rows(_versions.current())
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for name, value, origin in rows:
        print(f"{name:<{w0}}  {value:<{w1}}  {origin}")
    print()
    print("Overrides: OPCONTRACTS_TORCH_NPU_VERSION, OPCONTRACTS_CANN_VERSION, "
          "OPCONTRACTS_MINDSPEED_VERSION, OPCONTRACTS_SOC, or opcontracts.set_versions(...).")
    return 0


def _cmd_report_merge(ns: argparse.Namespace) -> int:
    """Merge per-rank report files (``report.rank{R}.json``) and say which ranks saw what."""
    from ._dist import cmd_merge

    return cmd_merge(ns)


def _cmd_demo(ns: argparse.Namespace) -> int:
    """Reproduce the first-step NaN of the incident on the CPU emulation, catch it, fix it."""
    from . import demo

    return demo.run(ns)


def _cmd_run(ns: argparse.Namespace) -> int:
    """Run a script or module under ``opcontracts.patch`` (``opcontracts run --help``)."""
    from . import _run

    return _run.main(ns.argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opcontracts",
                                description="Contracts for custom accelerator operators.")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("list", help="show the contracts that apply here")
    pl.add_argument("--all", action="store_true", help="also those that do not apply, and why")
    pl.add_argument("--contracts", action="append", help="extra contract file or folder")
    pl.set_defaults(func=_cmd_list)
    pe = sub.add_parser("env", help="show detected torch_npu / CANN / MindSpeed versions")
    pe.set_defaults(func=_cmd_env)
    pd = sub.add_parser("demo", help="reproduce the first-step NaN of the incident, catch it, "
                        "fix it (CPU emulation)",
                        description="One training step of a small MoE transformer, four ways, on "
                        "the CPU emulation of the NPU kernels: reference (plain PyTorch), "
                        "unguarded (mode off), strict, fix. Exit status 0 when each outcome is "
                        "the described one.")
    pd.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    pd.add_argument("--seed", type=int, default=0, help="seed of the weights and data (default 0)")
    pd.add_argument("--nan-check", action="store_true",
                    help="also run the NaN sentinel on the unguarded and fix runs")
    pd.add_argument("--ranks", type=int, metavar="N",
                    help="run it as the incident ran: N processes (gloo, CPU), the model sharded "
                    "per block with FSDP, the sentinel on; rank 0 prints the merged result "
                    "(under torchrun the job's own processes are used)")
    pd.add_argument("--fsdp", type=int, choices=(1, 2),
                    help="with --ranks: FSDP1 (FullyShardedDataParallel, flat parameters; the "
                    "default) or FSDP2 (fully_shard, DTensor parameters)")
    pd.set_defaults(func=_cmd_demo)
    # everything after `run` belongs to opcontracts run's own parser (then to the script):
    # no prefix characters, so argparse hands every word over untouched
    prun = sub.add_parser("run", help="run a script (or -m module) with opcontracts.patch "
                          "applied; `opcontracts run --help` for options",
                          add_help=False, prefix_chars="\x00",
                          usage="opcontracts run [--mode MODE] [--nan-check] [--report FILE] "
                                "(script.py | -m module) [args ...]")
    prun.add_argument("argv", nargs=argparse.REMAINDER)
    prun.set_defaults(func=_cmd_run)
    pr = sub.add_parser("report", help="work with saved report files")
    rsub = pr.add_subparsers(dest="report_command", required=True)
    prm = rsub.add_parser("merge", help="merge per-rank report files; show which ranks saw "
                          "each violation")
    prm.add_argument("files", nargs="+", metavar="FILE",
                     help="report files (report.rank0.json ...) or a folder of them")
    prm.add_argument("--json", metavar="OUT", help="also write the merged report as JSON")
    prm.set_defaults(func=_cmd_report_merge)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns))
    except BrokenPipeError:  # `opcontracts list | head`: the reader left, nothing to report
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
