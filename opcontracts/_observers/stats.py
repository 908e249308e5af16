"""What a run checked: guarded calls per op, and those the mode skipped (``opcontracts run``).

A report that says "no contract violations" means something only next to what was checked: a
script whose ops were never guarded (they were reached through names the patch does not know,
or the mode was ``off``) also has no violations.  ``CallStats`` is a counter observer of the
layer over the patch's guards (``_observers.layer``): per guarded call it counts the op and whether the
mode in effect for it was ``off`` (one ``ContextVar`` read and two dict updates, ~0.3 us on top
of the layer's wrapper; it is attached only by ``opcontracts run``).  ``RunStats`` is what it
counted plus what the patch guards, as plain data that merges across ranks.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from .._lang import modes
from .layer import Counter

__all__ = ["CallStats", "RunStats", "merge_stats"]


class CallStats(Counter):
    """Counts guarded calls per op, and those made while the op's mode was ``off``."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.off: dict[str, int] = {}
        self._lock = threading.Lock()

    def count(self, op: str) -> None:
        off = modes.mode_for(op) is modes.OFF
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            if off:
                self.off[op] = self.off.get(op, 0) + 1

    def snapshot(self) -> RunStats:
        """The counts, with what the patch guards now."""
        import sys

        from .._engine import registry

        targets: set[str] = set()
        ops: set[str] = set()
        patch = sys.modules.get("opcontracts.patch")
        if patch is not None:
            for rec in patch.patched():
                ops.add(rec.op)
                if rec.kind != "alias":
                    targets.add(rec.target)
        with self._lock:
            calls, off = dict(self.calls), dict(self.off)
        no_contract = {}
        for op, n in calls.items():
            try:
                applies = registry.resolve(op) is not None
            except registry.UnknownOpError:
                applies = False
            if not applies:
                no_contract[op] = n - off.get(op, 0)
        return RunStats(targets=len(targets), guarded_ops=len(ops), calls=calls, off=off,
                        no_contract={k: v for k, v in no_contract.items() if v})


@dataclass
class RunStats:
    """What was checked.  ``calls``/``off``: per op, guarded calls and those in mode off;
    ``no_contract``: calls of ops whose contract does not apply here (the guard calls through);
    ``ranks``: the ranks merged into this (empty outside a distributed job)."""

    targets: int = 0
    guarded_ops: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    off: dict[str, int] = field(default_factory=dict)
    no_contract: dict[str, int] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    @property
    def skipped(self) -> int:
        return sum(self.off.values())

    @property
    def checked(self) -> int:
        return self.total - self.skipped - sum(self.no_contract.values())

    def lines(self) -> list[str]:
        """The end-of-run paragraph: what was guarded, called, checked and skipped."""
        where = f" on rank(s) {','.join(map(str, self.ranks))}" if len(self.ranks) > 1 else ""
        if not self.total and not self.targets:
            return [f"opcontracts: nothing was checked{where}: nothing is guarded (no module "
                    "or op that a contract targets was loaded; `opcontracts list` shows the "
                    "targets)."]
        if not self.total:
            return [f"opcontracts: nothing was checked{where}: none of the {self.targets} "
                    f"guarded target(s) ({self.guarded_ops} op(s)) was called. The script may "
                    "reach its ops through names the patch does not know; `opcontracts list` "
                    "shows the targets."]
        seen = sorted(self.calls.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = ", ".join(f"{op} x{n}" for op, n in seen[:8])
        if len(seen) > 8:
            shown += f", ... ({len(seen) - 8} more)"
        out = [f"opcontracts: checked {self.checked} of {self.total} guarded call(s){where}; "
               f"{len(seen)} of {self.guarded_ops} guarded op(s) seen ({self.targets} "
               "target(s) guarded)",
               f"  ops seen: {shown}"]
        if self.skipped:
            out.append(f"  skipped by mode off: {self.skipped} call(s) ("
                       + ", ".join(f"{op} x{n}" for op, n in sorted(self.off.items())) + ")")
        if self.no_contract:
            out.append("  no contract applies here (called through unchecked): "
                       + ", ".join(f"{op} x{n}" for op, n in sorted(self.no_contract.items())))
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(total=self.total, checked=self.checked, skipped=self.skipped)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunStats:
        return cls(int(data.get("targets", 0)), int(data.get("guarded_ops", 0)),
                   {str(k): int(v) for k, v in dict(data.get("calls", {})).items()},
                   {str(k): int(v) for k, v in dict(data.get("off", {})).items()},
                   {str(k): int(v) for k, v in dict(data.get("no_contract", {})).items()},
                   [int(r) for r in data.get("ranks", [])])


def merge_stats(items: list[RunStats]) -> RunStats:
    """Several ranks' statistics as one: calls summed, the largest guarded set."""
    out = RunStats()
    for s in items:
        out.targets = max(out.targets, s.targets)
        out.guarded_ops = max(out.guarded_ops, s.guarded_ops)
        for src, dst in ((s.calls, out.calls), (s.off, out.off), (s.no_contract, out.no_contract)):
            for op, n in src.items():
                dst[op] = dst.get(op, 0) + n
        out.ranks = sorted(set(out.ranks) | set(s.ranks))
    return out
