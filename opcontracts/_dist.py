"""Reports from multi-process (``torchrun``) jobs: gather them on rank 0, or merge saved files.

Each rank checks its own calls and records its own violations (with its rank, see
``_report.current_rank``); a data-parallel job where one rank feeds a kernel a bad dtype, say
because only that rank's data shard hits a code path, shows up as a violation seen by that rank
alone.  Two ways to put the ranks' reports side by side:

* in the job: ``opcontracts.report(gather=True)``, a collective that returns the merged report on
  rank 0 (every rank must call it, like any ``torch.distributed`` collective);
* afterwards: ``opcontracts report merge report.rank*.json`` on the files ``write_report`` (and
  ``opcontracts run --report``) left, one per rank.

Kept out of ``_report`` so that ``import opcontracts`` never imports ``torch.distributed``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from ._report import Record, Report, load_report, merge_reports, table_lines

__all__ = ["gather_report", "merge_files", "format_merged", "cmd_merge"]

_RANK_FILE = re.compile(r"\.rank\d+\.json$")


def _with_rank(rep: Report, rank: int) -> Report:
    """The report with ``rank`` on every record that does not name its ranks yet (records made
    before the process knew it was distributed)."""
    recs = [Record(**{**r.__dict__, "ranks": list(r.ranks) or [rank]}) for r in rep.records]
    return Report(recs, rep.dropped, rep.total)


def gather_report(rep: Report, group: Any = None, dst: int = 0) -> Report:
    """Collect every rank's report; rank ``dst`` (of ``group``) gets the merged report with each
    record's ``ranks`` filled, the other ranks their own.  Without an initialized process group
    this is ``rep`` itself.

    A collective: every rank of ``group`` must call it, or the job hangs.  ``all_gather_object``
    rather than ``gather_object`` because every backend (gloo, NCCL, HCCL) implements it; a
    report is at most ``MAX_RECORDS`` small records, so sending it to every rank costs nothing
    worth saving.
    """
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return rep
    if not (dist.is_available() and dist.is_initialized()):
        return rep
    rank = dist.get_rank()
    mine = _with_rank(rep, rank)
    world = dist.get_world_size(group)
    if world <= 1:
        return mine
    payload = mine.to_dict()
    payload["rank"] = rank
    everyone = _all_gather_payloads(payload, group, world)
    if dist.get_rank(group) != dst:
        return mine
    return merge_reports(_from_payload(p) for p in everyone if p is not None)


def _all_gather_payloads(payload: dict[str, Any], group: Any, world: int) -> list[Any]:
    """Every rank's payload.  torch's object collectives unpickle through numpy; where numpy is
    missing (every rank of a job shares the environment, so all take the same branch) the JSON
    text travels as byte tensors on the CPU, which gloo carries."""
    import importlib.util

    import torch
    import torch.distributed as dist

    if importlib.util.find_spec("numpy") is not None:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, payload, group=group)
        return everyone
    data = torch.tensor(list(json.dumps(payload).encode("utf-8")), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(n.item()) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return [json.loads(bytes(b[: int(n.item())].tolist()).decode("utf-8"))
            for b, n in zip(bufs, sizes)]


def _from_payload(data: dict[str, Any]) -> Report:
    rep = Report.from_dict(data)
    rank = data.get("rank")
    return _with_rank(rep, int(rank)) if rank is not None else rep


# --------------------------------------------------------------------------- files
def _expand(paths: Sequence[str]) -> list[str]:
    """Files as given; a folder stands for the per-rank files in it (``*.rank<R>.json``, else
    every ``*.json``: a merged report saved next to them must not be counted twice); a pattern
    the shell did not expand (Windows, quotes) is expanded here."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            per_rank = [f for f in glob.glob(os.path.join(p, "*.rank*.json"))
                        if _RANK_FILE.search(os.path.basename(f))]
            out.extend(sorted(per_rank) or sorted(glob.glob(os.path.join(p, "*.json"))))
        elif not os.path.exists(p) and glob.has_magic(p):
            out.extend(sorted(glob.glob(p)))
        else:
            out.append(p)
    return out


def _file_rank(path: str) -> int | None:
    with open(path, encoding="utf-8") as f:
        rank = json.load(f).get("rank")
    return int(rank) if rank is not None else None


def merge_files(paths: Sequence[str]) -> tuple[Report, list[int]]:
    """Load per-rank report files and merge them; also the ranks the files came from (a file
    written outside a distributed job has no rank and adds none)."""
    reports: list[Report] = []
    ranks: set[int] = set()
    for p in paths:
        reports.append(load_report(p))
        r = _file_rank(p)
        if r is not None:
            ranks.add(r)
    return merge_reports(reports), sorted(ranks)


def _ranks_text(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if ranks else "-"


def format_merged(merged: Report, ranks: Sequence[int], n_files: int) -> str:
    """A table of the merged violations, with which ranks saw each, and the first message of
    each: the ranks column is the point (a violation on one rank of eight is a data or
    code-path problem on that rank, not a model bug everyone shares)."""
    head = (f"opcontracts: merged {n_files} report file(s)"
            + (f" from rank(s) {_ranks_text(ranks)}" if ranks else ""))
    if not merged.records:
        return head + "\nno contract violations."
    recs = sorted(merged.records, key=lambda r: (r.op, r.call_site, r.arg or "", r.rule, r.mode))
    lines = [head, f"{merged.total} contract violation(s) at {len(recs)} site(s)", ""]
    lines += table_lines(recs)
    if merged.dropped:
        lines.append(f"({merged.dropped} further distinct violation(s) not kept)")
    lines.append("")
    lines.append("per violation, the ranks that saw it:")
    for r in recs:
        seen = sorted(r.ranks)
        where = f"{r.op}: {r.arg or '-'} {r.rule} at {r.call_site}"
        if not seen:
            lines.append(f"  {where}: rank unknown")
            continue
        missing = [k for k in ranks if k not in seen]
        only = " only" if missing else ""
        text = f"  {where}: rank {_ranks_text(seen)}{only}" if len(seen) == 1 else \
            f"  {where}: ranks {_ranks_text(seen)}{only}"
        if missing:
            text += f" (not rank {_ranks_text(missing)})"
        else:
            text += " (every rank)" if len(ranks) > 1 else ""
        lines.append(text)
    lines.append("")
    lines.append("first message of each:")
    for r in recs:
        lines.extend("  " + ln for ln in r.message.splitlines())
    return "\n".join(lines)


def cmd_merge(ns: argparse.Namespace) -> int:
    """``opcontracts report merge FILES... [--json OUT]``."""
    paths = _expand(ns.files)
    if not paths:
        print("opcontracts report merge: no report files", file=sys.stderr)
        return 2
    try:
        merged, ranks = merge_files(paths)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # json.JSONDecodeError is a ValueError; a record with the wrong fields a TypeError
        print(f"opcontracts report merge: {exc}", file=sys.stderr)
        return 2
    print(format_merged(merged, ranks, len(paths)))
    if ns.json:
        data = merged.to_dict()
        data["ranks"] = ranks
        data["files"] = list(paths)
        d = os.path.dirname(ns.json)
        if d:
            os.makedirs(d, exist_ok=True)
        with open(ns.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2))
    return 0
