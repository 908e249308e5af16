"""The ``opcontracts`` command line: ``list``, ``env`` (and more subcommands as they land)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _rules(arg: object) -> str:
    from .spec import Arg

    assert isinstance(arg, Arg)
    parts = []
    if arg.dtype:
        parts.append("/".join(arg.dtype))
    if arg.shape:
        parts.append(" | ".join(f"({s})" for s in arg.shape))
    if arg.rank:
        parts.append("rank " + "/".join(map(str, arg.rank)))
    if arg.same_dtype_as:
        parts.append(f"dtype of {arg.same_dtype_as}")
    if arg.tensor_list:
        parts.append("list")
    if arg.optional:
        parts.append("optional")
    if arg.allowed is not None:
        parts.append("in " + ", ".join(map(repr, arg.allowed)))
    if arg.values is not None:
        from ._values import describe

        parts.append("values: " + describe(arg.values))
    return ", ".join(parts) or "-"


def _cmd_list(ns: argparse.Namespace) -> int:
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
    contracts = sorted(_registry.all_contracts(), key=lambda c: (c.op, c.file or ""))
    shown = 0
    for c in contracts:
        ok = _versions.applies(c.when, env)
        if ok is False and not ns.all:
            continue
        shown += 1
        status = {True: "applies", None: "applies (version unknown: strictest reading)",
                  False: "does not apply: " + _versions.explain(c.when, env)}[ok]
        print(f"{c.op}  [{status}]")
        if c.when is not None:
            w = ", ".join(f"{k} {v}" for k, v in c.when.model_dump().items() if v)
            print(f"  when:    {w}")
        print(f"  targets: {', '.join(c.targets) or '-'}")
        for name, a in c.args.items():
            print(f"  {name}: {_rules(a)}")
        print(f"  source:  {c.source or '-'}")
        print()
    print(f"{shown} contract(s) shown, {len(contracts)} loaded"
          + ("" if ns.all else " (use --all to see those that do not apply)"))
    return 0


def _cmd_env(ns: argparse.Namespace) -> int:
    from . import _versions

    env = _versions.current()
    for k, v in _versions.describe(env).items():
        print(f"{k:10s} {v}")
    return 0


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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
