"""Violation records: counted per (op, argument, rule, call site, mode), bounded, as a table or JSON.

At most ``MAX_RECORDS`` distinct records are kept; further distinct ones only bump a counter,
so a job that violates a contract on every step from a million call sites stays small.

A report as JSON (``Report.to_dict``, ``write_report``) carries ``metadata``: the versions that
decided which contracts applied, the mode, the command line, host, rank and time, so a file
read days later says where it came from.  ``load_report`` / ``Report.from_dict`` check a file's
shape and name every problem (``ReportFileError``): a merge never takes a stray JSON file for an
empty report.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import OpContractsError

__all__ = ["Record", "Report", "ReportFileError", "record", "report", "reset_report",
           "MAX_RECORDS", "merge_reports", "metadata", "write_report", "load_report"]

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
    # the rule's side and the argument's side, as the message's ``expected:`` / ``got:`` lines
    # say them (``"bfloat16"``, ``"dtype float32 (shape (4, 2))"``): for tools reading the JSON
    expected: str | None = None
    got: str | None = None
    nested: list[dict[str, Any]] = field(default_factory=list)
    """violations seen inside this call (the guarded op its kernel calls, the ``*_grad`` op of
    its backward): the same mistake, not one of their own (``op``, ``arg``, ``rule``,
    ``call_site``, ``count``)"""
    shown: bool = False
    """its full message was shown as a warning at the call (the summary then names it only)"""

    @property
    def key(self) -> tuple[str, str | None, str, str, str]:
        return (self.op, self.arg, self.rule, self.call_site, self.mode)


DROPPED_MEMORY = 1 << 20
"""distinct dropped records remembered (as hashes) so ``dropped`` counts each once"""


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[tuple[str, str | None, str, str, str], Record] = {}
        self.dropped = 0
        self.total = 0
        self.dropped_keys: set[int] = set()

    def add(self, op: str, arg: str | None, rule: str, call_site: str, mode: str,
            message: str, fixed: bool, rank: int | None, expected: str | None = None,
            got: str | None = None) -> tuple[Record | None, bool]:
        key = (op, arg, rule, call_site, mode)
        with self.lock:
            self.total += 1
            rec = self.records.get(key)
            if rec is not None:
                rec.count += 1
                rec.fixed += int(fixed)
                return rec, False
            if len(self.records) >= MAX_RECORDS:
                h = hash(key)
                if h not in self.dropped_keys:  # distinct ones, as the report says
                    if len(self.dropped_keys) < DROPPED_MEMORY:
                        self.dropped_keys.add(h)
                    self.dropped += 1
                    return None, True
                return None, False
            rec = Record(op, arg, rule, call_site, mode, 1, message, int(fixed),
                         [rank] if rank is not None else [], expected, got)
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
           fixed: bool = False, rank: int | None = None, *, expected: str | None = None,
           got: str | None = None) -> tuple[Record | None, bool]:
    """Count one violation; returns the record and whether it is new.  ``expected`` / ``got``
    are kept on a new record for the JSON (the violation's expected and got text)."""
    return _store.add(op, arg, rule, call_site, mode, message, fixed, rank, expected, got)


MAX_NESTED = 16
"""distinct nested violations kept per record"""


def nest(outer: tuple[str, str | None, str, str, str], op: str, arg: str | None, rule: str,
         call_site: str) -> None:
    """Attach a violation seen inside the call recorded under ``outer`` to that record (it
    counts no violation of its own)."""
    with _store.lock:
        rec = _store.records.get(outer)
        if rec is None:  # the outer record was not kept (limit): nothing to attach to
            return
        _add_nested(rec.nested, {"op": op, "arg": arg, "rule": rule, "call_site": call_site,
                                 "count": 1})


def _add_nested(into: list[dict[str, Any]], n: dict[str, Any]) -> None:
    for x in into:
        if (x["op"], x["arg"], x["rule"], x["call_site"]) == \
                (n["op"], n["arg"], n["rule"], n["call_site"]):
            x["count"] += n["count"]
            return
    if len(into) < MAX_NESTED:
        into.append(dict(n))


def mark_shown(key: tuple[str, str | None, str, str, str]) -> None:
    """The record's full message went out as a warning at its call site."""
    with _store.lock:
        rec = _store.records.get(key)
        if rec is not None:
            rec.shown = True


def _nested_text(r: Record) -> list[str]:
    out = []
    for n in r.nested:
        times = f" ({n['count']}x)" if n["count"] > 1 else ""
        out.append(f"    inside it: {n['op']}, argument '{n['arg']}', {n['rule']}, at "
                   f"{n['call_site']}{times}")
    return out


@dataclass
class Report:
    """A snapshot of the violations seen so far."""

    records: list[Record]
    dropped: int = 0
    total: int = 0
    # where the report came from (``metadata()``): read from a file by ``from_dict``; None for a
    # live snapshot, filled when it is written (``to_dict``)
    metadata: dict[str, Any] | None = field(default=None, compare=False)

    def __bool__(self) -> bool:
        return bool(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def to_dict(self) -> dict[str, Any]:
        return {"metadata": self.metadata if self.metadata is not None else metadata(),
                "total": self.total, "dropped": self.dropped,
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
            if r.shown:  # the full text was a warning at the call: one line here, not twice
                lines.append("  " + r.message.splitlines()[0])
                shown = "raised (strict)" if r.mode == "strict" else "a warning"
                lines.append(f"    (shown in full as {shown} at {r.call_site})")
            else:
                lines.extend("  " + ln for ln in r.message.splitlines())
            lines.extend(_nested_text(r))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        """The report a ``to_dict`` (or a report file) holds.  Its shape is checked first:
        ``ValueError`` listing every problem, each with its place (``records[2].count: ...``).
        Keys it does not know (a newer opcontracts) are ignored."""
        problems = check_report_data(data)
        if problems:
            raise ValueError(_problems_text(problems))
        fields = set(Record.__dataclass_fields__)
        recs = []
        for r in data["records"]:
            kw: dict[str, Any] = {k: v for k, v in r.items() if k in fields}
            kw["ranks"] = list(kw.get("ranks", ()))
            recs.append(Record(**kw))
        meta = data.get("metadata")
        return cls(recs, int(data.get("dropped", 0)), int(data.get("total", 0)),
                   dict(meta) if isinstance(meta, dict) else None)


class ReportFileError(OpContractsError, ValueError):
    """A report file that cannot be read or is not an opcontracts report; the message starts
    with the file's name and says every problem (``r.json: records[0].count: ...``)."""

    def __init__(self, path: str, problems: Sequence[str]) -> None:
        self.path = path
        self.problems = list(problems)
        self.files: list[ReportFileError] = [self]  # several bad files: one error each
        super().__init__(f"{path}: {_problems_text(self.problems)}")

    @classmethod
    def several(cls, errors: Sequence[ReportFileError]) -> ReportFileError:
        """One error for several bad files (``files``), one line each."""
        err = cls(errors[0].path, errors[0].problems)
        err.files = list(errors)
        err.args = ("\n".join(str(e) for e in errors),)
        return err


# --------------------------------------------------------------------------- file shape
_MAX_SHOWN = 10


def _problems_text(problems: Sequence[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    shown = "; ".join(problems[:_MAX_SHOWN])
    more = len(problems) - _MAX_SHOWN
    return f"{len(problems)} problems: {shown}" + (f"; ... {more} more" if more > 0 else "")


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _short(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# field: (check, what it must be, required)
_STR = (lambda v: isinstance(v, str), "a string")
_OPT_STR = (lambda v: v is None or isinstance(v, str), "a string or null")
_RECORD_FIELDS: dict[str, tuple[Any, str, bool]] = {
    "op": (*_STR, True), "arg": (*_OPT_STR, True), "rule": (*_STR, True),
    "call_site": (*_STR, True), "mode": (*_STR, True),
    "count": (lambda v: _is_int(v, 1), "an integer >= 1", True),
    "message": (*_STR, True),
    "fixed": (_is_int, "an integer >= 0", False),
    "ranks": (lambda v: isinstance(v, list) and all(_is_int(k) for k in v),
              "a list of ranks (integers >= 0)", False),
    "expected": (*_OPT_STR, False), "got": (*_OPT_STR, False),
    "nested": (lambda v: isinstance(v, list) and all(isinstance(n, dict) for n in v),
               "a list of objects", False),
}
_TOP_FIELDS: dict[str, tuple[Any, str]] = {
    "total": (_is_int, "an integer >= 0"), "dropped": (_is_int, "an integer >= 0"),
    "rank": (lambda v: v is None or _is_int(v), "a rank (an integer >= 0) or null"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "nan_sentinel": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}
_NAN_EVENT_FIELDS: dict[str, tuple[Any, str, bool]] = {
    "op": (*_STR, True), "direction": (*_STR, True), "kind": (*_STR, True),
    "arg": (*_STR, True), "dtype": (*_STR, True),
    "shape": (lambda v: isinstance(v, list) and all(_is_int(s) for s in v),
              "a list of sizes", True),
    # -1: not counted (an always-on sentinel keeps no tensor until its read: NanEvent.counted)
    "nan": (lambda v: _is_int(v, -1), "an integer >= -1", True),
    "inf": (lambda v: _is_int(v, -1), "an integer >= -1", True),
    "call_site": (*_OPT_STR, False), "module": (*_OPT_STR, False),
    "module_type": (*_OPT_STR, False), "backward_of": (*_OPT_STR, False),
    "seq": (_is_int, "an integer >= 0", False),
    "time": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number",
             False),
}


def _check_fields(obj: Any, where: str, spec: dict[str, tuple[Any, str, bool]],
                  out: list[str]) -> None:
    if not isinstance(obj, dict):
        out.append(f"{where}: expected an object, got {_short(obj)}")
        return
    for name, (ok, what, required) in spec.items():
        if name not in obj:
            if required:
                out.append(f"{where}: no '{name}' field")
        elif not ok(obj[name]):
            out.append(f"{where}.{name}: expected {what}, got {_short(obj[name])}")


def check_report_data(data: Any) -> list[str]:
    """Every way ``data`` (a parsed report file) is not an opcontracts report; ``[]`` if it is
    one.  An object without a ``records`` list is not a report (not an empty one)."""
    if not isinstance(data, dict):
        return [f"not an opcontracts report: expected a JSON object, got {_short(data)}"]
    if "records" not in data:
        keys = ", ".join(sorted(map(str, data))[:8]) or "none"
        return [f"not an opcontracts report: no 'records' list (its keys: {keys})"]
    out: list[str] = []
    recs = data["records"]
    if not isinstance(recs, list):
        out.append(f"records: expected a list, got {_short(recs)}")
        recs = []
    for name, (ok, what) in _TOP_FIELDS.items():
        if name in data and not ok(data[name]):
            out.append(f"{name}: expected {what}, got {_short(data[name])}")
    for i, r in enumerate(recs):
        _check_fields(r, f"records[{i}]", _RECORD_FIELDS, out)
    nan = data.get("nan_sentinel")
    if isinstance(nan, dict):
        for key in ("first", "received"):
            if nan.get(key) is not None:
                _check_fields(nan[key], f"nan_sentinel.{key}", _NAN_EVENT_FIELDS, out)
        events = nan.get("events", [])
        if not isinstance(events, list):
            out.append(f"nan_sentinel.events: expected a list, got {_short(events)}")
        else:
            for i, e in enumerate(events):
                _check_fields(e, f"nan_sentinel.events[{i}]", _NAN_EVENT_FIELDS, out)
        for key in ("calls", "dropped"):
            if key in nan and not _is_int(nan[key]):
                out.append(f"nan_sentinel.{key}: expected an integer >= 0, got {_short(nan[key])}")
    return out


def table_lines(records: Iterable[Record]) -> list[str]:
    """The records as an aligned table (header, rule, one row each), in the order given; a last
    column counts the violations seen inside each call when any record has some."""
    recs = list(records)
    inside = any(r.nested for r in recs)
    rows = [("op", "arg", "rule", "mode", "count", "ranks", "call site")
            + (("inside it",) if inside else ())]
    for r in recs:
        ranks = ",".join(map(str, sorted(r.ranks))) if r.ranks else "-"
        mode = f"{r.mode} ({r.fixed} fixed)" if r.fixed else r.mode
        extra = ((f"+{len(r.nested)} nested" if r.nested else "-",) if inside else ())
        rows.append((r.op, r.arg or "-", r.rule, mode, str(r.count), ranks, r.call_site, *extra))
    return aligned(rows)


def _copy(r: Record) -> Record:
    """A record that shares no list with ``r`` (``asdict`` copies lists and dicts deeply)."""
    return Record(**asdict(r))


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
                merged[r.key] = _copy(r)
            else:
                m.count += r.count
                m.fixed += r.fixed
                m.ranks = sorted(set(m.ranks) | set(r.ranks))
                m.shown = m.shown and r.shown
                for n in r.nested:
                    _add_nested(m.nested, n)
    return Report(list(merged.values()), dropped, total)


def report() -> Report:
    """A snapshot of every violation recorded in this process (``opcontracts.report`` adds
    ``gather=True``, every rank's violations, from the layer above)."""
    with _store.lock:
        recs = [_copy(r) for r in _store.records.values()]
        return Report(recs, _store.dropped, _store.total)


def reset_report() -> None:
    """Forget every recorded violation (and the warn-once memory that goes with it)."""
    with _store.lock:
        _store.records.clear()
        _store.dropped = 0
        _store.total = 0
        _store.dropped_keys.clear()
    _on_reset()


def _on_reset() -> None:
    """Forget cached per-site state that refers to records (set by the enforcer)."""
    for cb in _reset_callbacks:
        cb()


_reset_callbacks: list[Any] = []


def current_rank() -> int | None:
    """This process's rank under torchrun / torch.distributed, or None when not distributed."""
    import os
    import sys

    dist = sys.modules.get("torch.distributed")  # not loaded: no process group (no torch import)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
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


def metadata(*, rank: int | None = None) -> dict[str, Any]:
    """Where a report comes from: opcontracts, torch, torch_npu, CANN and MindSpeed versions and
    the SoC as they decided which contracts apply here (``opcontracts env``; ``emulated`` names
    the CPU stand-ins), the mode, the command line, host, process, rank and time (UTC).
    Reads nothing that is not loaded already (no torch import)."""
    import os
    import socket
    import sys
    from datetime import datetime, timezone

    from .._lang import modes, versions
    from .._version import __version__

    env = versions.current()
    state = modes.current_state()
    return {
        "opcontracts": __version__,
        **{name: getattr(env, name) for name in versions.FIELDS},
        "emulated": list(env.emulated),
        "mode": state.default.value,
        "mode_by_op": {op: m.value for op, m in state.by_op.items()},
        "argv": list(sys.argv),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": current_rank() if rank is None else rank,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_report(path: str, rep: Report | None = None, *,
                 extra: dict[str, Any] | None = None, option: str = "report") -> str:
    """Write the report as strict JSON (one file per rank when distributed; ``"-"``: stdout),
    with its ``metadata`` and the ``extra`` sections; returns the path.  ``OutputError``
    naming ``option`` and the path when it cannot be written."""
    from .._jsonout import json_text, to_stdout, write_json, write_text

    rep = report() if rep is None else rep
    rank = current_rank()
    data = rep.to_dict()  # with the metadata of this process (or the one it was read with)
    data["rank"] = rank
    data.update(extra or {})
    if to_stdout(path):
        write_json(path, data)
        return path
    return write_text(report_path_for_rank(path, rank), json_text(data), option)


def read_report_file(path: str) -> dict[str, Any]:
    """The parsed contents of a report file, checked: ``ReportFileError`` naming the file and
    every problem (cannot be read, not JSON, not a report, records with wrong fields)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ReportFileError(path, ["no such file"]) from None
    except IsADirectoryError:
        raise ReportFileError(path, ["is a folder, not a report file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportFileError(path, [f"cannot be read ({exc})"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportFileError(path, [f"not JSON (line {exc.lineno} column {exc.colno}: "
                                     f"{exc.msg})"]) from None
    except RecursionError:
        raise ReportFileError(path, ["not a report: nested too deeply"]) from None
    problems = check_report_data(data)
    if problems:
        raise ReportFileError(path, problems)
    return data  # type: ignore[no-any-return]


def load_report(path: str) -> Report:
    """The report in a file ``write_report`` wrote (``ReportFileError`` if it is not one); each
    record names the file's rank when it names none."""
    data = read_report_file(path)
    rep = Report.from_dict(data)
    rank = data.get("rank")
    if rank is not None:
        for r in rep.records:
            if not r.ranks:
                r.ranks = [int(rank)]
    return rep
