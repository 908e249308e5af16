"""Reports from multi-process (``torchrun``) jobs: gather them on rank 0, or merge saved files.

Each rank checks its own calls and records its own violations (with its rank, see
``_engine.records.current_rank``); a data-parallel job where one rank feeds a kernel a bad dtype, say
because only that rank's data shard hits a code path, shows up as a violation seen by that rank
alone.  Two ways to put the ranks' reports side by side:

* in the job: ``opcontracts.report(gather=True)``, a collective that returns the merged report on
  rank 0 (every rank must call it, like any ``torch.distributed`` collective);
* afterwards: ``opcontracts report merge report.rank*.json`` on the files ``write_report`` (and
  ``opcontracts run --report``) left, one per rank.  Every file is checked first (a file that is
  not JSON, not a report, or has records with wrong fields stops the merge, named with what is
  wrong); the NaN sentinel's findings (``run --nan-check``) are merged too: the first culprit
  across ranks and which ranks saw it.

Kept out of ``_engine.records`` so that ``import opcontracts`` never imports ``torch.distributed``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._engine.records import (
    Record,
    Report,
    ReportFileError,
    merge_reports,
    metadata,
    read_report_file,
    table_lines,
)
from .._jsonout import to_stdout, write_json

__all__ = ["gather_report", "merge_files", "format_merged", "cmd_merge", "ReportFile",
           "read_files", "merge_nan"]

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
            taken = sorted(per_rank) or sorted(glob.glob(os.path.join(p, "*.json")))
            out.extend(taken)
            left = sorted(f for f in glob.glob(os.path.join(p, "*"))
                          if f not in taken and os.path.isfile(f)
                          and ".json" in os.path.basename(f))
            if left:  # a partial or stray report next to them: say it, never skip it silently
                print(f"opcontracts report merge: {p}: not merged (not per-rank report files "
                      f"*.rank<R>.json): {', '.join(os.path.basename(f) for f in left)}",
                      file=sys.stderr)
        elif not os.path.exists(p) and glob.has_magic(p):
            out.extend(sorted(glob.glob(p)))
        else:
            out.append(p)
    return out


@dataclass
class ReportFile:
    """One checked report file: its rank (None outside a distributed job), its violations, the
    NaN sentinel's section (``run --nan-check``) and the metadata it was written with."""

    path: str
    rank: int | None
    report: Report
    nan: dict[str, Any] | None
    metadata: dict[str, Any] | None
    checked: dict[str, Any] | None = None   # ``run``'s statistics of what was checked
    compare: dict[str, Any] | None = None   # ``run --compare``'s shadow-compare section


def read_files(paths: Sequence[str]) -> list[ReportFile]:
    """Read and check every file; ``ReportFileError`` naming each bad one (all of them, not
    only the first: a merge of 64 rank files should not be fixed one file per run)."""
    out: list[ReportFile] = []
    bad: list[ReportFileError] = []
    for p in paths:
        try:
            data = read_report_file(p)
        except ReportFileError as exc:
            bad.append(exc)
            continue
        rep = Report.from_dict(data)
        rank = data.get("rank")
        if rank is not None:
            for r in rep.records:
                r.ranks = r.ranks or [rank]
        out.append(ReportFile(p, rank, rep, data.get("nan_sentinel"), rep.metadata,
                              _section(data, "checked"), _section(data, "shadow_compare")))
    if bad:
        raise bad[0] if len(bad) == 1 else ReportFileError.several(bad)
    return out


def _section(data: dict[str, Any], key: str) -> dict[str, Any] | None:
    v = data.get(key)
    return v if isinstance(v, dict) else None


def merge_run_sections(files: Sequence[ReportFile]) -> tuple[dict[str, Any] | None,
                                                              dict[str, Any] | None, list[str]]:
    """The ``checked`` statistics and the ``shadow_compare`` sections of ``opcontracts run``
    files, merged with the mechanisms ``run`` uses for its own rank-0 summary under torchrun
    (``_observers.sections``: no torch import), and their lines of text."""
    lines: list[str] = []
    checked = compared = None
    stats_parts = [(f.rank, f.checked) for f in files if f.checked]
    if stats_parts:
        from .._observers.sections import RunStats, merge_stats

        parsed = []
        for r, d in stats_parts:
            try:
                parsed.append(RunStats.from_dict({**d, "ranks": [r] if r is not None else []}))
            except (TypeError, ValueError, AttributeError):
                lines += ["", f"(rank {r}: its 'checked' section cannot be read; left out)"]
        stats = merge_stats(parsed)
        checked = stats.to_dict()
        lines += ["", *stats.lines()]
    cmp_parts = [(f.rank, f.compare) for f in files if f.compare]
    if cmp_parts:
        from .._observers.sections import merge_sections, merged_lines

        try:
            compared = merge_sections(cmp_parts)
            lines += ["", *merged_lines(compared)]
        except (TypeError, ValueError, KeyError, AttributeError):
            compared = None
            lines += ["", "(the files' 'shadow_compare' sections cannot be read; left out)"]
    return checked, compared, lines


def merge_files(paths: Sequence[str]) -> tuple[Report, list[int]]:
    """Load per-rank report files and merge them; also the ranks the files came from (a file
    written outside a distributed job has no rank and adds none)."""
    files = read_files(paths)
    ranks = sorted({f.rank for f in files if f.rank is not None})
    return merge_reports(f.report for f in files), ranks


def _ranks_text(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if ranks else "-"


# --------------------------------------------------------------------------- NaN findings
_EVENT_ID = ("op", "direction", "kind", "arg", "call_site", "module", "backward_of")


def _event_id(e: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two ranks' events the same finding (not the counts or the shape of a shard)."""
    return tuple(e.get(k) for k in _EVENT_ID)


def _rank_key(f: ReportFile) -> int:
    return f.rank if f.rank is not None else -1


def merge_nan(files: Sequence[ReportFile]) -> dict[str, Any] | None:
    """The NaN sentinel's findings across the files that have them (None if none has):

    * ``first``: the first culprit across ranks, with its ``rank``.  Ordered by the event's
      ``time`` when it has one; the sentinel's own counters (``seq``) are per process and the
      ranks share no clock, so without a time the lowest rank's first culprit is shown, and
      ``firsts`` says which ranks had which first culprit;
    * ``firsts``: each distinct first culprit with the ``ranks`` whose first it was;
      ``seen_by``: the ranks that saw ``first`` at all (first or later); ``clean``: the ranks
      whose guarded ops produced no NaN/inf;
    * ``calls``: guarded calls checked, all ranks; ``per_rank``: each file's section as written.
    """
    sections = [(f, f.nan) for f in files if f.nan is not None]
    if not sections:
        return None
    with_first = sorted(((f, n) for f, n in sections if n.get("first") is not None),
                        key=lambda fn: (fn[1]["first"].get("time", float("inf")),
                                        _rank_key(fn[0])))
    firsts: dict[tuple[Any, ...], dict[str, Any]] = {}
    for f, n in with_first:
        group = firsts.setdefault(_event_id(n["first"]), {"event": n["first"], "ranks": []})
        if f.rank is not None:
            group["ranks"].append(f.rank)
    out: dict[str, Any] = {
        "first": None, "firsts": list(firsts.values()), "seen_by": [],
        "clean": sorted(f.rank for f, n in sections if n.get("first") is None
                        and f.rank is not None),
        "calls": sum(int(n.get("calls", 0)) for _, n in sections),
        "per_rank": [{"rank": f.rank, "file": f.path, **n} for f, n in sections],
    }
    if with_first:
        winner, section = with_first[0]
        key = _event_id(section["first"])
        out["first"] = {**section["first"], "rank": winner.rank}
        out["seen_by"] = sorted(f.rank for f, n in sections if f.rank is not None and any(
            _event_id(e) == key for e in [n.get("first") or {}, *n.get("events", [])]))
    return out


def _event_message(e: dict[str, Any]) -> str:
    """The sentinel's own wording of an event (``NanEvent.message``, torch-free)."""
    import dataclasses

    from .._observers.sections import NanEvent

    names = {f.name for f in dataclasses.fields(NanEvent)}
    kw: dict[str, Any] = {"call_site": None, "module": None, "module_type": None}
    kw.update((k, v) for k, v in e.items() if k in names)
    kw["shape"] = tuple(kw.get("shape", ()))
    try:
        return NanEvent(**kw).message()
    except TypeError:  # a file from another version, without a field this one needs
        return (f"first non-finite value: {e.get('direction')}, in {e.get('op')}\n"
                f"  value:     {e.get('arg')}\n  call site: {e.get('call_site') or '?'}")


def _seen_text(seen: Sequence[int], ranks: Sequence[int]) -> str:
    missing = [k for k in ranks if k not in seen]
    text = f"rank {_ranks_text(seen)}" if len(seen) == 1 else f"ranks {_ranks_text(seen)}"
    if missing:
        return text + f" only (not rank {_ranks_text(missing)})"
    return text + (" (every rank)" if len(ranks) > 1 else "")


def _nan_lines(nan: dict[str, Any], ranks: Sequence[int]) -> list[str]:
    lines = [f"NaN sentinel (--nan-check) in {len(nan['per_rank'])} file(s): "
             f"{nan['calls']} guarded call(s) checked"]
    first = nan["first"]
    received = [sec for sec in nan["per_rank"] if sec.get("first") is None and sec.get("received")]
    if first is None:
        lines.append("  no guarded op produced NaN or inf" + (" on any rank" if ranks else ""))
        for sec in received:
            who = f"rank {sec['rank']}" if sec["rank"] is not None else sec["file"]
            lines.append(f"  {who}:")
            lines.extend("    " + ln for ln in _event_message(sec["received"]).splitlines())
        return lines
    rank = first.get("rank")
    lines.append("  first culprit" + (f" (rank {rank})" if rank is not None else "") + ":")
    lines.extend("    " + ln for ln in _event_message(first).splitlines())
    if ranks:
        lines.append(f"  seen by {_seen_text(nan['seen_by'], ranks)}")
    if len(nan["firsts"]) > 1:
        lines.append("  the first culprit of each rank (the ranks share no clock):")
        for g in nan["firsts"]:
            e = g["event"]
            lines.append(f"    {_ranks_text(g['ranks'])}: {e.get('direction')} {e.get('op')}: "
                         f"{e.get('arg')} at {e.get('call_site') or '?'}")
    if nan["clean"]:
        lines.append(f"  no NaN/inf from a guarded op on {_seen_text(nan['clean'], [])}")
    for sec in received:  # NaN that came from elsewhere: on a clean rank, often a collective
        e = sec["received"]
        lines.append(f"    but rank {sec['rank']} received non-finite {e.get('arg')} in "
                     f"{e.get('op')} ({e.get('direction')}) at {e.get('call_site') or '?'}: "
                     "made by an op the sentinel does not watch (a culprit's non-finite "
                     "gradients reach every rank through the all-reduce)")
    return lines


# --------------------------------------------------------------------------- versions
_VERSION_KEYS = ("opcontracts", "torch", "torch_npu", "cann", "mindspeed", "soc")


def _version_disagreements(files: Sequence[ReportFile]) -> list[str]:
    """``cann: 8.0.RC3 (rank 0,1), 8.0.0 (rank 2)`` for each version the files' metadata
    disagree on: ranks that run different stacks apply different contracts."""
    out = []
    for key in _VERSION_KEYS:
        by_value: dict[str, list[str]] = {}
        for f in files:
            if f.metadata is None or key not in f.metadata:
                continue
            who = str(f.rank) if f.rank is not None else os.path.basename(f.path)
            by_value.setdefault(str(f.metadata[key] or "unknown"), []).append(who)
        if len(by_value) > 1:
            out.append(f"{key}: " + ", ".join(f"{v} (rank {','.join(w)})"
                                              for v, w in by_value.items()))
    return out


def format_merged(merged: Report, ranks: Sequence[int], n_files: int,
                  nan: dict[str, Any] | None = None,
                  disagreements: Sequence[str] = ()) -> str:
    """A table of the merged violations, with which ranks saw each, and the first message of
    each: the ranks column is the point (a violation on one rank of eight is a data or
    code-path problem on that rank, not a model bug everyone shares).  Then the NaN
    sentinel's merged findings (``merge_nan``) and the versions the ranks disagree on."""
    head = (f"opcontracts: merged {n_files} report file(s)"
            + (f" from rank(s) {_ranks_text(ranks)}" if ranks else ""))
    tail: list[str] = []
    if disagreements:
        tail += ["", "the files disagree on versions (so on which contracts apply):"]
        tail += ["  " + d for d in disagreements]
    if nan is not None:
        tail += ["", *_nan_lines(nan, ranks)]
    if not merged.records:
        return "\n".join([head, "no contract violations.", *tail])
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
    lines.extend(tail)
    return "\n".join(lines)


def cmd_merge(ns: argparse.Namespace) -> int:
    """``opcontracts report merge FILES... [--json OUT]``: exit 2, with ``FILE: what is wrong``
    for each bad file, when a file cannot be merged; 1 when the merged files found problems
    (a contract violation, a NaN culprit, a divergence from the reference), as ``check-dump``
    exits 1 on violations; 0 otherwise.  Imports no torch (two JSON files are read)."""
    paths = _expand(ns.files)
    if not paths:
        print("opcontracts report merge: no report files"
              + (f" ({', '.join(ns.files)})" if ns.files else ""), file=sys.stderr)
        return 2
    try:
        files = read_files(paths)
    except ReportFileError as exc:
        for err in exc.files:
            for problem in err.problems:
                print(f"opcontracts report merge: {err.path}: {problem}", file=sys.stderr)
        return 2
    ranks = sorted({f.rank for f in files if f.rank is not None})
    merged = merge_reports(f.report for f in files)
    nan = merge_nan(files)
    disagreements = _version_disagreements(files)
    checked, compared, run_lines = merge_run_sections(files)
    if not to_stdout(ns.json):
        print("\n".join([format_merged(merged, ranks, len(paths), nan, disagreements),
                         *run_lines]))
    if ns.json:
        data = merged.to_dict()
        data["metadata"] = metadata()  # the merge's own; each file's is under "sources"
        data["ranks"] = ranks
        data["files"] = list(paths)
        data["sources"] = [{"file": f.path, "rank": f.rank, "metadata": f.metadata}
                           for f in files]
        if disagreements:
            data["version_disagreements"] = list(disagreements)
        if nan is not None:
            data["nan_sentinel"] = nan
        if checked is not None:
            data["checked"] = checked
        if compared is not None:
            data["shadow_compare"] = compared
        write_json(ns.json, data)
    found = merged.total > 0 or (nan is not None and nan.get("first") is not None) \
        or (compared is not None and compared.get("first") is not None)
    return 1 if found else 0
