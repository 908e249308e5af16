"""``opcontracts probe OP... [--all] [--json FILE] [--write-contract FILE] [--profile NAME]``.

``add_parser(subparsers)`` adds the command to ``opcontracts``' parser (one call in
``cli.build_parser``); nothing heavier than argparse is imported until the command runs.

Where it runs: with a real torch_npu importable, on the real kernels (``--profile`` is refused);
without one, on the CPU emulation installed with ``--profile`` (default ``narrow``), which is
uninstalled again afterwards.  Exit status: 0; 1 when the contract that applies lets through a
dtype the kernel gets wrong (the dangerous disagreement); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

from .._jsonout import add_json_option, check_writable, to_stdout, write_json, write_text

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "probe", help="measure which dtypes an op really computes correctly (against its "
        "plain-PyTorch reference); compare with its contract",
        description="Run OP on small generated inputs over its dtype grid (per tensor argument, "
        "then the groups its contract couples), compare each result with the op's reference as "
        "the shadow compare does (msprobe's thresholds), and report per argument the dtypes that "
        "give correct results, that raise, and that return wrong numbers silently; and where "
        "the measurement and the contract that applies here disagree, both ways.")
    p.add_argument("ops", nargs="*", metavar="OP",
                   help="op names as contracts name them (npu_moe_token_unpermute, "
                   "mindspeed.npu_gmm); torch.ops.npu.X and torch_npu.X are accepted")
    p.add_argument("--all", action="store_true", help="every op that has a reference with "
                   "example inputs")
    add_json_option(p, "the measurements")
    p.add_argument("--write-contract", metavar="FILE",
                   help="write the measured dtype rules as a contract file whose `when` pins "
                   "the detected torch_npu / CANN / SoC")
    p.add_argument("--profile", metavar="NAME",
                   help="without a real torch_npu: the emulation's dtype profile to measure "
                   "(narrow, incident, wide; default narrow)")
    p.add_argument("--seed", type=int, default=0, help="seed of the example inputs")
    p.set_defaults(func=_cmd_probe)


def _real_torch_npu() -> bool:
    from ..emulation._standins import is_standin

    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return not is_standin(mod)
    from .. import emulation

    if emulation.installed():
        return False
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _kernels(profile: str | None) -> Iterator[None]:
    """The real kernels, or the emulation with ``profile`` (put back as it was afterwards)."""
    from .. import emulation

    if _real_torch_npu():
        if profile is not None:
            raise ValueError("--profile selects an emulation profile, and a real torch_npu is "
                             "present: the probe measures the real kernels here")
        import torch_npu  # noqa: F401 - registers the npu ops (and says which torch_npu this is)

        yield
        return
    was = emulation.installed()
    previous = emulation.current_profile()
    emulation.install(profile or "narrow")
    import torch_npu  # noqa: F401 - the stand-in: it tells the version detection what it is

    try:
        yield
    finally:
        if was:
            emulation.install(previous if previous is not None else "narrow")
        else:
            emulation.uninstall()


def _cmd_probe(ns: argparse.Namespace) -> int:
    from .. import reference

    ops = list(ns.ops)
    if ns.all:
        ops += [n for n in reference.names() if reference.get(n).example is not None]  # type: ignore[union-attr]
    probeable = [n for n in reference.names() if reference.get(n).example is not None]  # type: ignore[union-attr]
    if not ops:
        print("opcontracts probe: name an op (or --all); probe-able: " + ", ".join(probeable),
              file=sys.stderr)
        return 2
    if ns.write_contract:
        check_writable(ns.write_contract, "--write-contract")  # before the runs
    from ..probe import probe

    try:
        with _kernels(ns.profile):
            reports = [probe(op, seed=ns.seed) for op in dict.fromkeys(ops)]
            # while the kernels are in place: the versions their `when` and `source` name
            measured = [r.contract() for r in reports] if ns.write_contract else []
    except (LookupError, ValueError) as exc:
        msg = str(exc)
        unknown = [op for op in ops if op not in probeable and msg.find(repr(op)) >= 0]
        # a typo: the near matches, not every name (a shipped op without a reference: the
        # message already says why it has none)
        if unknown and reference.unmodelled(unknown[0]) is None:
            from .._engine.registry import near_names

            near = near_names(unknown[0], probeable)
            msg = (f"no reference with example inputs for {unknown[0]!r}"
                   + (f"; near matches: {', '.join(near)}" if near else "")
                   + " (`opcontracts probe` without an op lists them all)")
        print(f"opcontracts probe: {msg}", file=sys.stderr)
        return 2
    text = to_stdout(ns.json)
    out = sys.stderr if text else sys.stdout  # --json on stdout: the tables go to stderr
    for i, r in enumerate(reports):
        if i:
            print(file=out)
        print(r.table(), file=out)
    total = sum(r.seconds for r in reports)
    print(f"\n{len(reports)} op(s) probed, {sum(len(r.cells) for r in reports)} run(s) in "
          f"{total:.2f} s", file=out)
    if ns.json:
        write_json(ns.json, {"ops": [r.to_dict() for r in reports], "seconds": total})
        if not text:
            print(f"measurements written to {ns.json}")
    if ns.write_contract:
        from .._observers.contract_out import dumps_contracts, utc_now

        header = [f"Measured by `opcontracts probe` on {utc_now()}: {len(reports)} op(s).",
                  "Loaded through OPCONTRACTS_CONTRACTS each applies where its `when` holds, "
                  "on top of the shipped contract (a call must satisfy both)."]
        write_text(ns.write_contract, dumps_contracts(measured, header), "--write-contract")
        print(f"measured contract written to {ns.write_contract}", file=out)
    dangerous = [(r.op, c) for r in reports for c in r.claimed_but_wrong]
    if dangerous:
        print(f"\n{len(dangerous)} dtype(s) the contract allows are computed wrong: the "
              "contract must forbid them", file=sys.stderr)
        return 1
    return 0

