"""``opcontracts wheel verify | draft | diff | digest``: the command line of the wheel tools.

``add_parser(subparsers)`` adds the ``wheel`` command to ``opcontracts``' parser; nothing is
imported until a subcommand runs.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path
from typing import Any

from .._jsonout import add_json_option, to_stdout

__all__ = ["add_parser"]

_DOWNLOAD = ("pip download --no-deps --only-binary=:all: --python-version 3.11 --platform "
             "manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d DIR torch-npu==VERSION")


def _err(msg: str) -> int:
    print(f"opcontracts wheel: {msg}", file=sys.stderr)
    return 2


def _digest_of(ns: argparse.Namespace, sources: list[str]) -> Any:
    """The digest to work from: built from ``sources`` (wheels, folders, trees) when given,
    else ``--digest FILE``, else the one shipped in the package."""
    from . import _source, digest

    if sources:
        wheels = _source.read_wheels(sources)
        return digest.Digest(digest.build(wheels), ", ".join(sources))
    return digest.load(ns.digest)


def _write_json(target: str, data: Any) -> None:
    from .._jsonout import write_json

    write_json(target, data)


def _contracts(ns: argparse.Namespace) -> list[Any]:
    from .._engine.registry import shipped_contracts_dir
    from ..spec import load_contracts

    out = [] if getattr(ns, "no_shipped", False) else load_contracts(shipped_contracts_dir())
    for path in ns.contracts or ():
        out.extend(load_contracts(path))
    return out


def _versions(ns: argparse.Namespace) -> list[str] | None:
    if not ns.versions:
        return None
    return [v.strip() for part in ns.versions for v in part.split(",") if v.strip()]


# --------------------------------------------------------------------------- verify
def _cmd_verify(ns: argparse.Namespace) -> int:
    from ..errors import OpContractsError
    from . import _source, digest, verify

    t0 = time.perf_counter()
    try:
        d = _digest_of(ns, ns.sources)
        contracts = _contracts(ns)
        versions = _versions(ns)
        if ns.op and not any(fnmatch.fnmatchcase(c.op, ns.op) for c in contracts):
            return _err(f"verify: no contract matches --op {ns.op!r} (of {len(contracts)} "
                        "loaded; `opcontracts list` shows the ops)")
        # the shipped packs are a complete set: every route of their ops must be guarded
        results = verify.verify(contracts, d, versions, ns.op,
                                routes=not getattr(ns, "no_shipped", False))
    except (OpContractsError, _source.WheelReadError, digest.DigestError, KeyError) as exc:
        return _err(str(exc).strip("'\""))
    n = len(versions) if versions is not None else len(d.versions)
    failed = any(r.fails for r in results)
    if ns.json:
        data = verify.to_json(results, n)
        data["summary"]["seconds"] = round(time.perf_counter() - t0, 3)
        data["summary"]["source"] = d.origin
        _write_json(ns.json, data)
    if not to_stdout(ns.json):
        print(verify.render(results, n, verbose=ns.verbose))
        print(f"({d.origin}; {time.perf_counter() - t0:.2f} s)")
    return 1 if failed else 0


# --------------------------------------------------------------------------- draft
def _cmd_draft(ns: argparse.Namespace) -> int:
    from ..errors import OpContractsError
    from . import _source, digest, draft

    out = Path(ns.output)
    if out.exists() and not out.is_dir():
        return _err(f"draft: -o {out}: is a file, not a folder (the drafts are one file per op)")
    try:
        base = digest.load(ns.digest)
        p = Path(ns.source)
        if p.exists():
            w = _source.read_one(p)
            own = digest.Digest(digest.build([w]), str(p))
            r = own.release(w.version)
            others = [base.release(v) for v in base.versions if v != w.version]
            pool = sorted([*others, r], key=lambda x: _vkey(x.version))
        else:
            r = base.release(ns.source)
            pool = [base.release(v) for v in base.versions]
        skip: set[str] = set()
        if not ns.all_ops:
            skip = {c.op for c in _contracts(ns)}
        drafts, skipped = draft.draft_release(pool, r, ns.op, skip_ops=skip)
    except (OpContractsError, _source.WheelReadError, digest.DigestError, KeyError) as exc:
        return _err(str(exc).strip("'\""))
    if not drafts:
        print(f"no op of torch_npu {r.version} matches {ns.op!r} without a contract "
              f"({len(skipped)} skipped: {'; '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''})")
        return 0
    paths = draft.write(drafts, ns.output)
    for dr, path in zip(drafts, paths):
        print(f"{dr.status:<10}  {path}" + (f"  ({len(dr.todo)} TODO)" if dr.todo else ""))
    print(draft.summary_line(drafts) + f" (torch_npu {r.version}; {len(skipped)} op(s) skipped: "
          "already contracted or undocumented)")
    return 0


def _vkey(v: str) -> Any:
    from packaging.version import Version

    return Version(v)


# --------------------------------------------------------------------------- diff
def _release_of(ns: argparse.Namespace, name: str) -> Any:
    from . import digest

    return digest.resolve_release(name, ns.digest)


def _cmd_diff(ns: argparse.Namespace) -> int:
    from . import _source, diff, digest

    try:
        a, b = _release_of(ns, ns.old), _release_of(ns, ns.new)
    except (_source.WheelReadError, digest.DigestError, KeyError) as exc:
        return _err(str(exc).strip("'\""))
    res = diff.diff(a, b, ns.op)
    if ns.json:
        _write_json(ns.json, res.to_json())
    if not to_stdout(ns.json):
        print(diff.render(res))
    return 0


# --------------------------------------------------------------------------- digest
def _cmd_digest(ns: argparse.Namespace) -> int:
    from .._jsonout import check_writable
    from . import _source, digest

    if ns.output and not ns.check:
        check_writable(ns.output, "-o")  # before reading the wheels (OutputError: exit 2)
    try:
        wheels = _source.read_wheels(ns.sources)
        data = digest.build(wheels)
    except (_source.WheelReadError, OSError) as exc:
        return _err(str(exc))
    groups = digest.Digest(data).groups("docs")
    if ns.check:
        try:
            ref = digest.load(None if ns.check == "shipped" else ns.check)
        except digest.DigestError as exc:
            return _err(str(exc))
        missing = [w.version for w in wheels if w.version not in ref.versions]
        diffs = digest.compare(ref.restrict([w.version for w in wheels]), data)
        if missing or diffs:
            print(f"the digest of these {len(wheels)} wheel(s) differs from {ref.origin}:")
            for line in diffs:
                print(f"  {line}")
            return 1
        print(f"the digest of these {len(wheels)} wheel(s) equals {ref.origin} "
              "(restricted to their versions)")
        return 0
    if not ns.output:
        return _err("give -o FILE (or --check FILE to compare with an existing digest)")
    size = digest.save(data, ns.output)
    print(f"{ns.output}: {len(wheels)} release(s), {len(groups)} docstring group(s), "
          f"{size} bytes")
    for fid, vs in groups.items():
        print(f"  docs {fid}: {', '.join(vs)}")
    return 0


# --------------------------------------------------------------------------- parser
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wheel`` (with ``verify``, ``draft``, ``diff``, ``digest``) to ``subparsers``."""
    pw = subparsers.add_parser(
        "wheel", help="check contracts against the real torch_npu wheels, draft, diff, digest",
        description="The torch_npu wheels read as zip files (never imported). Download them "
                    f"with: {_DOWNLOAD}")
    sub = pw.add_subparsers(dest="wheel_command", required=True)

    pv = sub.add_parser(
        "verify", help="check contracts against each release their `when` covers",
        description="Exit status 1 on an unmarked (a) (a dtype the contract allows and the doc "
                    "does not list), a false alarm (c) (a documented dtype the contract forbids, "
                    "on a contract decided by the torch_npu version alone), a missing op, target "
                    "or argument, a schema disagreement (optional, list, order) or a rank/dtype "
                    "the meta kernel rejects. doc_conflict on an argument marks a deliberate "
                    "disagreement. Without WHEEL, the digest shipped in the package is used.")
    pv.add_argument("sources", nargs="*", metavar="WHEEL_OR_DIR",
                    help="torch_npu .whl files, folders of them, or unpacked trees")
    pv.add_argument("--digest", metavar="FILE", help="a digest instead of wheels "
                    "(default: the one shipped in the package)")
    pv.add_argument("--contracts", action="append", metavar="PATH",
                    help="also check the contracts in this file or folder (repeatable)")
    pv.add_argument("--no-shipped", action="store_true",
                    help="check only the --contracts files, not the shipped packs")
    pv.add_argument("--versions", action="append", metavar="V[,V...]",
                    help="only these releases (default: every release read)")
    pv.add_argument("--op", metavar="PATTERN", help="only ops matching this glob")
    add_json_option(pv, "the results")
    pv.add_argument("-v", "--verbose", action="store_true",
                    help="every table, meta-kernel outputs, releases not covered")
    pv.set_defaults(func=_cmd_verify)

    pd = sub.add_parser(
        "draft", help="draft TOML contracts for ops that have none",
        description="One file per op, every rule with the doc line it came from, # TODO for what "
                    "could not be read; prints how many ops were drafted completely, partly, not "
                    "at all.")
    pd.add_argument("source", metavar="WHEEL_OR_VERSION",
                    help="a torch_npu .whl (or unpacked tree), or a version in the digest")
    pd.add_argument("--op", default="*", metavar="PATTERN",
                    help="ops matching this glob (default: every documented op)")
    pd.add_argument("-o", "--output", default="drafts", metavar="DIR",
                    help="folder for the drafts (default: ./drafts)")
    pd.add_argument("--digest", metavar="FILE", help="the digest the `when` ranges are read "
                    "from (default: the shipped one)")
    pd.add_argument("--contracts", action="append", metavar="PATH",
                    help="ops contracted here are skipped too")
    pd.add_argument("--all-ops", action="store_true",
                    help="also draft ops that already have a contract")
    pd.set_defaults(func=_cmd_draft)

    pf = sub.add_parser("diff", help="what changed between two releases, per op",
                        description="OLD and NEW: a version in the digest, a .whl or unpacked "
                                    "tree, or a digest file (FILE@VERSION picks a release).")
    pf.add_argument("old", metavar="OLD", help="the older release (version, wheel, tree or "
                    "FILE@VERSION)")
    pf.add_argument("new", metavar="NEW", help="the newer release, spelled as OLD")
    pf.add_argument("--digest", metavar="FILE", help="where versions are looked up "
                    "(default: the shipped digest)")
    pf.add_argument("--op", metavar="PATTERN", help="only ops matching this glob")
    add_json_option(pf, "the changes")
    pf.set_defaults(func=_cmd_diff)

    pg = sub.add_parser("digest", help="build the compact digest of wheels (what verify, draft "
                        "and diff need)")
    pg.add_argument("sources", nargs="+", metavar="WHEEL_OR_DIR",
                    help="torch_npu .whl files, folders of them, or unpacked trees")
    pg.add_argument("-o", "--output", metavar="FILE", help="write the digest here (gzip'd JSON)")
    pg.add_argument("--check", metavar="FILE", help="compare with this digest instead "
                    "('shipped': the package's), restricted to the wheels' versions; exit 1 "
                    "when they differ")
    pg.set_defaults(func=_cmd_digest)
    return pw
