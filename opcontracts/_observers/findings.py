"""What an observer that reports findings keeps: the first, a bounded list, a count of the rest,
and what to do at the first one (record, warn, raise).  The NaN sentinel and the shadow compare
both keep their events this way.  The caller holds its own lock around ``add``; ``react`` is
called outside it (it may raise into the user's call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .._engine.callsite import warn_at_caller

__all__ = ["Findings", "react", "later_lines"]

E = TypeVar("E")


class Findings(Generic[E]):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.clear()

    def clear(self) -> None:
        self.first: E | None = None
        self.events: list[E] = []
        self.dropped = 0

    def add(self, event: E) -> bool:
        """Keep ``event`` (or count it, beyond ``limit``); whether it is the first."""
        first = self.first is None
        if first:
            self.first = event
        if len(self.events) < self.limit:
            self.events.append(event)
        else:
            self.dropped += 1
        return first


def react(policy: str, message: str, error: Callable[[], BaseException]) -> None:
    """At the first finding: ``"warn"`` warns (``RuntimeWarning`` at the user's line, however
    the finding was reached: the call, a backward hook, a read at ``optimizer.step()``),
    ``"raise"`` raises ``error()``, anything else only records."""
    if policy == "warn":
        warn_at_caller(message, RuntimeWarning)
    elif policy == "raise":
        raise error()


def later_lines(more: list[Any], dropped: int, shown: int = 8) -> list[str]:
    """The findings after the first, one line each (``direction op: what [module]``), the first
    ``shown`` of them, and how many more there were."""
    if not more and not dropped:
        return []
    lines = [f"  then {len(more) + dropped} more:"]
    for e in more[:shown]:
        where = f" [{e.module or e.module_type}]" if e.module is not None else ""
        lines.append(f"    {e.direction:<8} {e.op}: {e.what}{where}")
    if len(more) > shown:
        lines.append(f"    ... ({len(more) - shown + dropped} not shown)")
    elif dropped:
        lines.append(f"    ... ({dropped} not kept)")
    return lines
