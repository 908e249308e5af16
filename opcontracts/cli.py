"""The ``opcontracts`` command line: ``list``, ``env``, ``demo``, ``run``, ``report merge``.

``list`` and ``env`` also speak JSON (``--json``) for scripts and CI; ``--version`` says which
opcontracts this is.  Each subcommand is one ``add_parser`` in ``build_parser`` and one
``_cmd_*`` function, imported lazily: ``opcontracts --version`` and ``env`` never import torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._jsonout import add_json_option, check_writable, settle, to_stdout, write_json

if TYPE_CHECKING:
    from ._lang.versions import Env
    from .spec import Arg, Contract, When

__all__ = ["main", "build_parser"]


def _dt(names: Sequence[str]) -> str:
    from ._lang.dtypes import parse_dtype, short_name

    return "/".join(short_name(parse_dtype(n)) for n in names)


def _rules(arg: Arg) -> str:
    """One line per argument: every rule the checker will run, in the contract's own words."""
    parts = []
    if arg.tensor_list:
        parts.append("list" + (f" (<= {arg.max_len})" if arg.max_len is not None else ""))
    if arg.dtype:
        parts.append(_dt(arg.dtype) + "".join(f" (or {_dt(v)} with {k})"
                                              for k, v in (arg.dtype_if_present or {}).items()))
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
        from ._lang.values import describe

        parts.append("values: " + describe(arg.values))
    if arg.layer is not None:
        parts.append(f"layer {arg.layer}")
    if arg.produced_by:
        parts.append("produced by " + " or ".join(arg.produced_by))
    return ", ".join(parts) or "-"


def _when_text(when: When) -> str:
    out = []
    for k, v in when.model_dump().items():
        if v:
            out.append(f"soc {' or '.join(v)}" if k == "soc" else f"{k} {v}")
    return ", ".join(out)


def _target_status(target: str) -> str | None:
    """Whether a target can be reached here, without importing anything: ``"not installed
    here"`` for a module target whose top-level package is not installed, ``"not registered
    here"`` for a ``torch.ops`` op that is not (the patch would leave it pending; a job never
    fails on it); None when it can be reached."""
    import importlib.util

    parts = target.split(".")
    if parts[:2] == ["torch", "ops"] and len(parts) == 4:
        import torch

        try:
            getattr(getattr(torch.ops, parts[2]), parts[3])
        except (AttributeError, RuntimeError):
            return "not registered here"
        return None
    if parts[0] in sys.modules:
        return None
    try:
        found = importlib.util.find_spec(parts[0]) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "not installed here"


def _print_contract(c: Contract, status: str, indent: str = "  ") -> None:
    print(f"{indent}[{status}]")
    if c.when is not None:
        print(f"{indent}  when:    {_when_text(c.when)}")
    targets = [t + (f" ({why})" if (why := _target_status(t)) else "") for t in c.targets]
    print(f"{indent}  targets: {', '.join(targets) or '-'}")
    print(f"{indent}  source:  {c.source or '-'}")
    if c.layer is not None:
        print(f"{indent}  layer:   {c.layer}")
    if c.replace:
        print(f"{indent}  replace: true (stands for the shipped contracts of {c.op} here)")
    width = max((len(n) for n in c.args), default=0)
    for name, a in c.args.items():
        print(f"{indent}  {name:<{width}}  {_rules(a)}")
    for case in c.cases:
        print(f"{indent}  when {case.condition_text}:" + (f" (layer {case.layer})" if case.layer else ""))
        for name, a in case.args.items():
            print(f"{indent}    {name:<{width}}  {_rules(a)}")


def _env_line(env: Env) -> str:
    from ._lang import versions as _versions

    parts = []
    for name in _versions.FIELDS:
        v = getattr(env, name)
        text = f"{name} {v or 'unknown'}"
        if name in env.emulated:
            text += " (emulation)"
        parts.append(text)
    return ", ".join(parts)


_STATUS = {True: "applies", None: "may apply", False: "does not apply"}


def _matches(op: str, pattern: str | None) -> bool:
    """``list OP_PATTERN``: a glob (``fnmatch``: ``*``, ``?``, ``[...]``) when the pattern has
    one of those, else a substring; either way case-insensitive, on the op name."""
    if not pattern:
        return True
    import fnmatch

    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(op.lower(), pattern.lower())
    return pattern.lower() in op.lower()


def _contract_paths() -> list[str]:
    """The files and folders named in ``OPCONTRACTS_CONTRACTS`` (``os.pathsep``-separated, as
    ``opcontracts.patch`` reads it)."""
    raw = os.environ.get("OPCONTRACTS_CONTRACTS", "")
    return [p.strip() for p in raw.split(os.pathsep) if p.strip()]


def _load_for_list(extra: Sequence[str]) -> list[Contract]:
    """Every contract a job would load: the shipped ones, the files of
    ``OPCONTRACTS_CONTRACTS`` (loaded by ``_attach.use.env_contracts``, as the patch loads them: a
    bad file is skipped with its warning, as in a job), then ``--contracts`` (a bad file is an
    error: asked for by name on this command line)."""
    from ._engine import registry
    from .spec import load_contracts

    registry.load_shipped()
    if _contract_paths():
        from ._attach.use import env_contracts, register_each  # as a job loads them, no patch

        register_each(env_contracts(), "OPCONTRACTS_CONTRACTS")
    for path in extra:
        registry.register(load_contracts(path), replace=True)
    return registry.all_contracts()


def _coverage(ns: argparse.Namespace, contracts: list[Contract]) -> int:
    """``list --coverage SOURCE``: the release's ops with and without a contract."""
    from .wheel import coverage, digest

    try:
        release = digest.resolve_release(ns.coverage)
    except (OSError, KeyError, ValueError) as exc:
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # no repr quotes
        print(f"opcontracts list --coverage: {text}", file=sys.stderr)
        return 2
    cov = coverage.coverage(release, [c for c in contracts if _matches(c.op, ns.pattern)])
    if ns.json:
        write_json(ns.json, cov.to_json())
    if not to_stdout(ns.json):
        print(coverage.render(cov, verbose=ns.verbose))
    return 0


def _cmd_list(ns: argparse.Namespace) -> int:
    """Contracts grouped by op.  Per op: each contract with whether it applies here and why
    (``explain``), then, when several apply (a version is unknown, or a chip-specific table
    adds to a version table), the strictest merge that is actually enforced.  Exit status 1
    when no op matches ``OP_PATTERN``."""
    from ._engine import registry
    from ._lang import versions as _versions

    settle(ns, "pattern")  # `list --json PATTERN`: the pattern, JSON on stdout
    contracts = _load_for_list(ns.contracts or ())
    if ns.coverage:
        return _coverage(ns, contracts)
    from ._lang import targets as _targets

    env = _versions.current()
    declared = _targets.declared()
    if len(declared[0]) == 1:  # one target: what applies is judged on it
        env = _targets.stacks(env, declared[0])[0]
    by_op: dict[str, list[Contract]] = {}
    for c in sorted(contracts, key=lambda c: (c.op, c.file or "")):
        if _matches(c.op, ns.pattern):
            by_op.setdefault(c.op, []).append(c)
    verdicts_by_op = {op: [(c, _versions.applies(c.when, env)) for c in lst]
                      for op, lst in by_op.items()}
    if ns.json:
        write_json(ns.json, _list_json(ns, env, verdicts_by_op, len(contracts)))
    if not by_op and ns.pattern:
        near = registry.near_names(ns.pattern, {c.op for c in contracts})
        print(f"opcontracts list: no op matches {ns.pattern!r}"
              + (f"; near matches: {', '.join(near)}" if near else "")
              + f" ({len(contracts)} contract(s) loaded; `opcontracts list` shows them all)",
              file=sys.stderr)
        return 1
    if to_stdout(ns.json):
        return 0
    print(f"environment: {_env_line(env)}")
    targets, origin = declared
    for t in targets:
        print(f"  judged on {t.label}, from {origin}")
    if any(ok is None for v in verdicts_by_op.values() for _, ok in v):
        print("  a version some contracts need is unknown: those contracts may apply; the guard "
              "enforces their strictest merge, and a call only some readings reject is warned "
              "about, not raised (see docs/targets.md)")
    print()
    if not (ns.verbose or ns.pattern or ns.all):
        return _list_summary(verdicts_by_op, len(contracts))
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
            status = _STATUS[ok]
            if c.when is not None:
                status += f": {why}"
            _print_contract(c, status)
        applying = [c for c, ok in verdicts if ok is not False]
        if len(applying) > 1:
            merged = registry.resolve(op)
            if merged is not None:
                print(f"  => enforced: the strictest merge of these {len(applying)} contracts")
                width = max((len(n) for n in merged.args), default=0)
                for name, a in merged.args.items():
                    print(f"       {name:<{width}}  {_rules(a)}")
        res = registry.resolution(op)
        if res is not None and res.split:
            print(f"  => readings ({', '.join(res.unknown) or 'targets'}): "
                  + " | ".join(dict.fromkeys(r.label or res.stack_label(r.stack) for r in res.readings))
                  + ": a call only some reject is conditional (warned, not raised)")
        print()
    matched = f" matching {ns.pattern!r}" if ns.pattern else ""
    tail = f"{shown} contract(s) shown for {len(by_op)} op(s){matched}, {len(contracts)} loaded"
    if hidden and not ns.all:
        tail += f"; {hidden} do not apply here (--all shows them and why)"
    print(tail)
    return 0


def _list_summary(verdicts_by_op: dict[str, list[tuple[Contract, bool | None]]],
                  loaded: int) -> int:
    """``list`` without a pattern: one line per op (how many contracts apply, its arguments);
    ``list OP``, ``--all`` or ``--verbose`` give every contract's rules."""
    rows = [("op", "contracts", "arguments")]
    for op, verdicts in verdicts_by_op.items():
        applying = [c for c, ok in verdicts if ok is not False]
        maybe = sum(1 for _, ok in verdicts if ok is None)
        if not applying:
            continue
        count = f"{len(applying)}" + (f" ({maybe} may apply)" if maybe else "")
        names = list(dict.fromkeys(n for c in applying for n in c.args))
        text = ", ".join(names)
        rows.append((op, count, text if len(text) <= 70 else text[:67] + "..."))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip())
    print()
    print(f"{len(rows) - 1} op(s) with a contract that applies here, {loaded} contract(s) "
          "loaded; `opcontracts list OP` (or --verbose) shows every rule and where it comes "
          "from, --all also those that do not apply")
    return 0


def _arg_json(a: Arg) -> dict[str, Any]:
    """An argument's rules as the contract file spells them (only the fields that are set),
    and as ``list`` prints them."""
    return {"rules": _rules(a),
            "spec": a.model_dump(mode="json", by_alias=True, exclude_defaults=True)}


def _list_json(ns: argparse.Namespace, env: Env,
               verdicts_by_op: dict[str, list[tuple[Contract, bool | None]]],
               loaded: int) -> dict[str, Any]:
    """``list --json``: every contract that matches (``--all`` is implied: each says whether it
    applies, ``true``/``null`` (may apply: a version is unknown)/``false``, and why), and per
    op the merge that is enforced."""
    from ._engine import registry
    from ._lang import versions as _versions

    ops = []
    for op, verdicts in verdicts_by_op.items():
        items = []
        for c, ok in verdicts:
            items.append({
                "applies": ok, "status": _STATUS[ok],
                "why": _versions.explain(c.when, env) if c.when is not None else None,
                "when": c.when.model_dump(mode="json", exclude_none=True) if c.when else None,
                "file": c.file, "source": c.source, "layer": c.layer, "replace": c.replace,
                "targets": [{"target": t, "unavailable": _target_status(t)} for t in c.targets],
                "args": {name: _arg_json(a) for name, a in c.args.items()},
                "cases": [{"if": case.condition_text, "source": case.source,
                           "args": {n: _arg_json(a) for n, a in case.args.items()}}
                          for case in c.cases],
            })
        merged = registry.resolve(op) if any(ok is not False for _, ok in verdicts) else None
        res = registry.resolution(op) if merged is not None else None
        ops.append({"op": op, "contracts": items,
                    "enforced": {name: _arg_json(a) for name, a in merged.args.items()}
                    if merged is not None else None,
                    "readings": [{"stack": res.stack_label(r.stack), "assumes": r.label or None,
                                  "contracts": [c.source for c in r.contracts]}
                                 for r in res.readings] if res is not None and res.split else []})
    return {
        "environment": _env_json(env)["versions"],
        "pattern": ns.pattern,
        "contract_paths": _contract_paths() + list(ns.contracts or ()),
        "loaded": loaded,
        "ops": ops,
    }


def _mode_info() -> dict[str, Any]:
    """The mode a guarded call gets here, and where it comes from; a bad ``OPCONTRACTS_MODE``
    is shown as such (``error``), not taken for the default."""
    raw = os.environ.get("OPCONTRACTS_MODE")
    info: dict[str, Any] = {"mode": None, "by_op": {}, "OPCONTRACTS_MODE": raw, "error": None}
    try:
        from ._lang import modes

        if raw and raw.strip():
            modes.parse_mode(raw, where="OPCONTRACTS_MODE")
        state = modes.current_state()
    except Exception as exc:  # noqa: BLE001 - env is where a bad setting must be visible
        info["error"] = str(exc)
        return info
    info["mode"] = state.default.value
    info["by_op"] = {op: m.value for op, m in state.by_op.items()}
    return info


def _env_json(env: Env) -> dict[str, Any]:
    from ._lang import versions as _versions
    from ._version import __version__

    versions = {}
    for (name, shown, origin) in _versions.rows(env):
        versions[name] = {"value": getattr(env, name), "shown": shown, "origin": origin,
                          "emulated": name in env.emulated}
    paths = [{"path": p, "kind": "folder" if os.path.isdir(p) else
              "file" if os.path.isfile(p) else "not found"} for p in _contract_paths()]
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OPCONTRACTS_")}
    return {"opcontracts": __version__, "versions": versions, "mode": _mode_info(),
            "targets": _targets_info(), "contract_paths": paths, "settings": settings}


def _targets_info() -> dict[str, Any]:
    """The declared targets and where they come from; a bad setting is shown as ``error``."""
    from ._lang import targets as _targets

    try:
        targets, origin = _targets.declared()
    except Exception as exc:  # noqa: BLE001 - env is where a bad setting must be visible
        return {"targets": [], "origin": None, "error": str(exc)}
    return {"targets": [dict(t.as_dict(), label=t.label) for t in targets],
            "origin": origin or None, "error": None}


def _cmd_env(ns: argparse.Namespace) -> int:
    """The versions that decide which contracts apply, and where each was found, so a wrong
    guess (a stand-in, a stale ``ASCEND_TOOLKIT_HOME``) is visible; the mode and the extra
    contract files.  Exit status 2 when ``OPCONTRACTS_MODE`` is not a mode."""
    from ._lang import versions as _versions

    data = _env_json(_versions.current())
    mode = data["mode"]
    status = 2 if mode["error"] or data["targets"]["error"] else 0
    if ns.json:
        write_json(ns.json, data)
        if to_stdout(ns.json):
            return status
    rows = _versions.rows(_versions.current())
    if mode["error"]:
        rows.append(("mode", "invalid", mode["error"]))
    else:
        origin = ("$OPCONTRACTS_MODE" if (mode["OPCONTRACTS_MODE"] or "").strip()
                  else "default (OPCONTRACTS_MODE not set)")
        if mode["by_op"]:
            origin += "; per op: " + ", ".join(f"{k}={v}" for k, v in mode["by_op"].items())
        rows.append(("mode", mode["mode"], origin))
    tg = data["targets"]
    if tg["error"]:
        rows.append(("targets", "invalid", tg["error"]))
    elif not tg["targets"]:
        rows.append(("targets", "-", "none declared (set_targets(), $OPCONTRACTS_TARGETS, "
                     "[tool.opcontracts] targets in pyproject.toml): judged on this environment"))
    for t in tg["targets"]:
        rows.append(("target", t["label"], tg["origin"]))
    for p in data["contract_paths"]:
        rows.append(("contracts", p["path"], f"$OPCONTRACTS_CONTRACTS ({p['kind']})"))
    if not data["contract_paths"]:
        rows.append(("contracts", "-", "shipped only (OPCONTRACTS_CONTRACTS not set)"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for name, value, origin in rows:
        print(f"{name:<{w0}}  {value:<{w1}}  {origin}")
    print()
    print("Overrides: OPCONTRACTS_TORCH_NPU_VERSION, OPCONTRACTS_CANN_VERSION, "
          "OPCONTRACTS_MINDSPEED_VERSION, OPCONTRACTS_SOC, or opcontracts.set_versions(...).")
    print("Targets (the stacks calls are judged against): OPCONTRACTS_TARGETS, [tool.opcontracts] "
          "targets in pyproject.toml, or opcontracts.set_targets(...); see docs/targets.md.")
    return status


def _cmd_report_merge(ns: argparse.Namespace) -> int:
    """Merge per-rank report files (``report.rank{R}.json``) and say which ranks saw what."""
    from ._ranks.gather import cmd_merge

    return cmd_merge(ns)


def _cmd_demo(ns: argparse.Namespace) -> int:
    """Reproduce the first-step NaN of the incident on the CPU emulation, catch it, fix it."""
    from ._tools import demo

    return demo.run(ns)


def _cmd_run(ns: argparse.Namespace) -> int:
    """Run a script or module under ``opcontracts.patch`` (``opcontracts run --help``)."""
    from ._tools import run as _run

    return _run.main(ns.argv)


def _run_usage() -> str:
    from ._tools.run import USAGE  # one usage text: `opcontracts run --help` prints the same

    return USAGE.removeprefix("usage: ")


def build_parser() -> argparse.ArgumentParser:
    """The parser; one ``add_parser`` (or one call adding a subcommand) per line of commands."""
    from ._version import __version__

    p = argparse.ArgumentParser(prog="opcontracts",
                                description="Contracts for custom accelerator operators.")
    p.add_argument("--version", action="version", version=f"opcontracts {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("list", help="show the contracts that apply here",
                        description="The contracts that apply here (shipped, "
                        "OPCONTRACTS_CONTRACTS, --contracts), per op, and the merge enforced.")
    pl.add_argument("pattern", nargs="?", metavar="OP_PATTERN",
                    help="only ops matching it: a glob (fnmatch) when it has *, ? or [, "
                    "otherwise a substring; case-insensitive")
    pl.add_argument("--all", action="store_true", help="also those that do not apply, and why")
    pl.add_argument("--contracts", action="append", help="extra contract file or folder")
    add_json_option(pl, "every matching contract, each with whether it applies,")
    pl.add_argument("--coverage", metavar="SOURCE",
                    help="which ops of a torch_npu release have a contract: SOURCE is a wheel, "
                    "an unpacked tree, a digest (FILE.json.gz[@VERSION]) or a version of the "
                    "shipped digest (2.14.0)")
    pl.add_argument("-v", "--verbose", action="store_true",
                    help="every contract's rules (the default without OP_PATTERN is one line "
                    "per op); with --coverage: also list the undocumented ops")
    pl.set_defaults(func=_cmd_list)
    pe = sub.add_parser("env", help="show detected torch_npu / CANN / MindSpeed versions, the "
                        "mode and the extra contract files",
                        description="The versions that decide which contracts apply (torch_npu, "
                        "CANN, MindSpeed, the SoC) and where each was found, so a wrong guess is "
                        "visible; the mode, the declared targets, the OPCONTRACTS_* settings and "
                        "the extra contract files. Exit status 2 when a setting is invalid.")
    add_json_option(pe, "the same")
    pe.set_defaults(func=_cmd_env)
    pd = sub.add_parser("demo", help="reproduce the first-step NaN of the incident, catch it, "
                        "fix it (CPU emulation)",
                        description="One training step of a small MoE transformer, four ways, on "
                        "the CPU emulation of the NPU kernels: reference (plain PyTorch), "
                        "unguarded (mode off), strict, fix. Exit status 0 when each outcome is "
                        "the described one.")
    add_json_option(pd, "the results")
    pd.add_argument("--seed", type=int, default=0, help="seed of the weights and data (default 0)")
    pd.add_argument("--nan-check", action="store_true",
                    help="also run the NaN sentinel on the unguarded and fix runs")
    pd.add_argument("--ranks", type=int, metavar="N",
                    help="run it as the incident ran: N processes (gloo, CPU), the model sharded "
                    "per block with FSDP, the sentinel on; rank 0 prints the merged result "
                    "(under torchrun the job's own processes are used)")
    pd.add_argument("--sentinel", choices=("always-on", "watch"),
                    help="the NaN sentinel on the unguarded and fix runs: always-on (the step "
                    "checked at optimizer.step(), a bad step replayed under the watch; the default "
                    "with --ranks) or watch (every guarded call checked; the default of "
                    "--nan-check); implies --nan-check")
    pd.add_argument("--fsdp", type=int, choices=(1, 2),
                    help="with --ranks: FSDP1 (FullyShardedDataParallel, flat parameters; the "
                    "default) or FSDP2 (fully_shard, DTensor parameters)")
    pd.set_defaults(func=_cmd_demo, settings=True)
    # everything after `run` belongs to opcontracts run's own parser (then to the script):
    # no prefix characters, so argparse hands every word over untouched
    prun = sub.add_parser("run", help="run a script (or -m module) with opcontracts.patch "
                          "applied; `opcontracts run --help` for options",
                          add_help=False, prefix_chars="\x00",
                          usage=_run_usage())
    prun.add_argument("argv", nargs=argparse.REMAINDER,
                      help="run's options, the script (or -m module) and its arguments")
    prun.set_defaults(func=_cmd_run)
    pr = sub.add_parser("report", help="work with saved report files")
    rsub = pr.add_subparsers(dest="report_command", required=True)
    prm = rsub.add_parser("merge", help="merge per-rank report files; show which ranks saw "
                          "each violation")
    prm.add_argument("files", nargs="+", metavar="FILE",
                     help="report files (report.rank0.json ...) or a folder of them")
    add_json_option(prm, "the merged report")
    prm.set_defaults(func=_cmd_report_merge)
    from .wheel.cli import add_parser as _add_wheel_parser  # imports nothing else until run

    _add_wheel_parser(sub)
    from ._tools.probe_cli import add_parser as _add_probe_parser  # imports nothing until run

    _add_probe_parser(sub)
    from ._tools.dump_cli import add_parser as _add_dump_parsers  # imports nothing until run

    _add_dump_parsers(sub, _load_for_list)  # check-dump, record --from-dump
    from ._tools.selftest import add_parser as _add_selftest_parser  # imports nothing until run

    _add_selftest_parser(sub)
    from ._tools.scan import add_parser as _add_scan_parser  # imports nothing until run

    _add_scan_parser(sub)
    from ._tools.preflight_cli import add_parser as _add_preflight_parser  # nothing until run

    _add_preflight_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 fine; 1 checked and found problems; 2 a usage error, input that cannot
    be read or output that cannot be written (one line naming the file or flag, no traceback)."""
    from .errors import OpContractsError

    ns = build_parser().parse_args(argv)
    try:
        if getattr(ns, "json", None):
            if hasattr(ns, "pattern"):
                settle(ns, "pattern")
            check_writable(ns.json, "--json")  # before the work, not after it
        if getattr(ns, "settings", False):  # a bad setting is said before any output
            _check_settings()
        return int(ns.func(ns))
    except OpContractsError as exc:  # a bad file or setting: its message names it
        print(f"opcontracts {ns.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        if isinstance(exc, BrokenPipeError):
            return _reader_left()
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"opcontracts {ns.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2



def _check_settings() -> None:
    """``SettingError`` now when ``OPCONTRACTS_MODE`` (or another setting that decides what is
    checked) or the declared targets cannot be used: for a command that prints before it
    guards its first call (``demo``)."""
    from ._lang import modes, targets

    modes.check_setting()
    targets.check()


def _reader_left() -> int:
    """`opcontracts list | head`: the reader left, nothing to report."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
