"""``opcontracts record --from-dump PATH -o FILE``: a golden contract file from an msprobe dump.

What ``opcontracts run --record`` drafts from a known-good run, drafted from the run's msprobe
dump instead: every recorded forward call of an op with a contract goes to the recorder
(``opcontracts.record.Recorder.add``, the recorder's own rules and writer) as meta tensors in
the recorded dtypes and shapes, bound to parameter names as ``check-dump`` binds them.  A call
that violates the contracts that apply (``check-dump``'s verdict) is warned about and left
out, unless ``record_violations``: a golden file must not pin what the shipped rules reject.
The contracts keep the targets of the contracts of their op.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .._engine import registry as _registry
from . import msprobe_dump as md
from .check_dump import Judge, Stacks, judged_calls

__all__ = ["DumpRecording", "record_dump"]


@dataclass
class DumpRecording:
    path: Path
    recorded: dict[str, int] = field(default_factory=dict)
    """op -> calls recorded"""
    left_out: dict[str, int] = field(default_factory=dict)
    """op -> calls that violate a contract (left out, or kept with ``record_violations``)"""
    unread: dict[str, int] = field(default_factory=dict)
    """op -> calls left out because an argument's record cannot be read (no dtype ...)"""
    written: bool = False
    """False when nothing could be recorded: no file is written (an empty golden file would
    make every later compare against it vacuous)"""


def record_dump(path: str | Path, out: str | Path, stacks: Stacks, *,
                record_violations: bool = False) -> DumpRecording:
    """Record PATH's calls into the contract file ``out``; ``msprobe_dump.DumpError`` when
    PATH is not an msprobe dump."""
    from ..record import Recorder

    files = md.find_rank_dumps(path)
    judge = Judge(stacks)
    rec = Recorder()
    result = DumpRecording(Path(out))
    warned: set[tuple[str, str | None, str]] = set()
    for j in judged_calls(files, judge):
        if j.op is None or j.verdicts is None:
            continue
        if j.unread:  # a tensor recorded without a dtype (...): nothing to pin for it
            result.unread[j.op] = result.unread.get(j.op, 0) + 1
            continue
        broken = [v.violation for v in j.verdicts if v.kind == "violation"]
        if broken:
            result.left_out[j.op] = result.left_out.get(j.op, 0) + 1
            e = broken[0]
            if (j.op, e.arg, e.rule) not in warned:
                warned.add((j.op, e.arg, e.rule))
                what = "recorded anyway (--record-violations)" if record_violations \
                    else "left out of the golden file (--record-violations keeps it)"
                warnings.warn(f"opcontracts record: {j.call.name} ({j.dump.path}) breaks its "
                              f"contract ({e.arg or '-'}: {e.rule}, expected {e.expected}, got "
                              f"{e.got}): {what}", RuntimeWarning, stacklevel=2)
            if not record_violations:
                continue
        args, kwargs = judge.arguments(j.call)
        rec.add(j.op, judge.names(j.op, j.call), args, kwargs)
        result.recorded[j.op] = result.recorded.get(j.op, 0) + 1
        if j.op not in rec.targets:
            rec.targets[j.op] = list(dict.fromkeys(
                t for c in _registry.candidates(j.op) for t in c.targets))
    steps = sorted({s for s, _ in map(md.where, files) if s is not None})
    ranks = sorted({r for _, r in map(md.where, files) if r is not None})
    origin = (f"opcontracts record --from-dump: msprobe dump {path} ({len(files)} dump.json, "
              f"step(s) {', '.join(map(str, steps)) or '-'}, rank(s) "
              f"{', '.join(map(str, ranks)) or '-'})")
    if result.left_out:
        origin += ("; calls that broke a contract " +
                   ("recorded too: " if record_violations else "left out: ") +
                   ", ".join(f"{op} ({n})" for op, n in sorted(result.left_out.items())))
    if result.unread:
        origin += ("; calls with an argument whose record cannot be read left out: " +
                   ", ".join(f"{op} ({n})" for op, n in sorted(result.unread.items())))
    if result.recorded:
        rec.write(out, origin=origin)
        result.written = True
    return result
