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

from .._lang import modes
from .layer import Counter
from .sections import RunStats, merge_stats

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
