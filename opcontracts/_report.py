"""Violation records: counted per (op, argument, rule, call site, mode), bounded, as a table or JSON.

At most ``MAX_RECORDS`` distinct records are kept; further distinct ones only bump a counter,
so a job that violates a contract on every step from a million call sites stays small.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Record", "Report", "record", "report", "reset_report", "MAX_RECORDS", "merge_reports"]

MAX_RECORDS = 1000


@dataclass
class Record:
    op: str
    arg: str | None
    rule: str
    call_site: str
    mode: str
    count: int
    message: str
    fixed: int = 0
    ranks: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str | None, str, str, str]:
        return (self.op, self.arg, self.rule, self.call_site, self.mode)


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[tuple[str, str | None, str, str, str], Record] = {}
        self.dropped = 0
        self.total = 0

    def add(self, op: str, arg: str | None, rule: str, call_site: str, mode: str,
            message: str, fixed: bool, rank: int | None) -> tuple[Record | None, bool]:
        key = (op, arg, rule, call_site, mode)
        with self.lock:
            self.total += 1
            rec = self.records.get(key)
            if rec is not None:
                rec.count += 1
                rec.fixed += int(fixed)
                return rec, False
            if len(self.records) >= MAX_RECORDS:
                self.dropped += 1
                return None, True
            rec = Record(op, arg, rule, call_site, mode, 1, message, int(fixed),
                         [rank] if rank is not None else [])
            self.records[key] = rec
            return rec, True


_store = _Store()


def bump(keys: list[tuple[str, str | None, str, str, str]], fixed: bool) -> None:
    """Count a repeat of known violations (the cached slow path: no message, no frame walk)."""
    with _store.lock:
        for key in keys:
            _store.total += 1
            rec = _store.records.get(key)
            if rec is not None:
                rec.count += 1
                rec.fixed += int(fixed)


def record(op: str, arg: str | None, rule: str, call_site: str, mode: str, message: str,
           fixed: bool = False, rank: int | None = None) -> tuple[Record | None, bool]:
    """Count one violation; returns the record and whether it is new."""
    return _store.add(op, arg, rule, call_site, mode, message, fixed, rank)


@dataclass
class Report:
    """A snapshot of the violations seen so far."""

    records: list[Record]
    dropped: int = 0
    total: int = 0

    def __bool__(self) -> bool:
        return bool(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "dropped": self.dropped,
                "records": [asdict(r) for r in self.records]}

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kw})

    def table(self) -> str:
        if not self.records:
            return "opcontracts: no contract violations."
        lines = [f"opcontracts: {self.total} contract violation(s) at {len(self.records)} site(s)"]
        lines += table_lines(sorted(self.records, key=lambda r: (-r.count, r.op, r.call_site)))
        if self.dropped:
            lines.append(f"({self.dropped} further distinct violation(s) not kept: limit {MAX_RECORDS})")
        firsts = sorted(self.records, key=lambda r: (-r.count, r.op, r.call_site))[:5]
        lines.append("")
        lines.append("first message of each (most frequent first):")
        for r in firsts:
            lines.extend("  " + ln for ln in r.message.splitlines())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        fields = set(Record.__dataclass_fields__)
        recs = [Record(**{k: v for k, v in r.items() if k in fields}) for r in data.get("records", [])]
        return cls(recs, int(data.get("dropped", 0)), int(data.get("total", 0)))


def table_lines(records: Iterable[Record]) -> list[str]:
    """The records as an aligned table (header, rule, one row each), in the order given."""
    rows = [("op", "arg", "rule", "mode", "count", "ranks", "call site")]
    for r in records:
        ranks = ",".join(map(str, sorted(r.ranks))) if r.ranks else "-"
        mode = f"{r.mode} ({r.fixed} fixed)" if r.fixed else r.mode
        rows.append((r.op, r.arg or "-", r.rule, mode, str(r.count), ranks, r.call_site))
    return aligned(rows)


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as left-aligned columns, a rule under the first (header) row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def merge_reports(reports: Iterable[Report]) -> Report:
    merged: dict[tuple[str, str | None, str, str, str], Record] = {}
    dropped = total = 0
    for rep in reports:
        dropped += rep.dropped
        total += rep.total
        for r in rep.records:
            m = merged.get(r.key)
            if m is None:
                merged[r.key] = Record(**{**asdict(r), "ranks": list(r.ranks)})
            else:
                m.count += r.count
                m.fixed += r.fixed
                m.ranks = sorted(set(m.ranks) | set(r.ranks))
    return Report(list(merged.values()), dropped, total)


def report(*, gather: bool = False) -> Report:
    """A snapshot of every violation recorded in this process.

    ``gather=True`` in a ``torch.distributed`` job is a collective (every rank must call it): rank
    0 gets every rank's violations merged, each record naming the ``ranks`` that saw it; the other
    ranks get their own.  Outside a distributed job it is the same as ``report()``.
    """
    with _store.lock:
        recs = [Record(**{**asdict(r), "ranks": list(r.ranks)}) for r in _store.records.values()]
        rep = Report(recs, _store.dropped, _store.total)
    if gather:
        from ._dist import gather_report  # torch.distributed only when asked

        return gather_report(rep)
    return rep


def reset_report() -> None:
    """Forget every recorded violation (and the warn-once memory that goes with it)."""
    with _store.lock:
        _store.records.clear()
        _store.dropped = 0
        _store.total = 0
    _on_reset()


def _on_reset() -> None:
    """Forget cached per-site state that refers to records (set by the enforcer)."""
    for cb in _reset_callbacks:
        cb()


_reset_callbacks: list[Any] = []


def current_rank() -> int | None:
    """This process's rank under torchrun / torch.distributed, or None when not distributed."""
    import os

    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # pragma: no cover - a broken backend must not hide the report
        pass
    ws, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
    if ws.isdigit() and int(ws) > 1 and rank.isdigit():
        return int(rank)
    return None


def report_path_for_rank(path: str, rank: int | None = None) -> str:
    """``report.json`` -> ``report.rank3.json`` on rank 3 of a distributed job; unchanged
    otherwise."""
    import os

    rank = current_rank() if rank is None else rank
    if rank is None:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def write_report(path: str, rep: Report | None = None) -> str:
    """Write the report as JSON (one file per rank when distributed); returns the path."""
    import os

    rep = report() if rep is None else rep
    rank = current_rank()
    data = rep.to_dict()
    data["rank"] = rank
    out = report_path_for_rank(path, rank)
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2))
    return out


def load_report(path: str) -> Report:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rep = Report.from_dict(data)
    rank = data.get("rank")
    if rank is not None:
        for r in rep.records:
            if not r.ranks:
                r.ranks = [int(rank)]
    return rep
