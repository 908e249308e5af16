"""The observers' report sections as plain data, without torch: what ``opcontracts report
merge`` reads and merges (two JSON files must not cost a torch import), and what ``run``'s
rank-0 summary merges under torchrun.

``NanEvent`` (the sentinel's finding, ``opcontracts.nan.NanEvent``), ``RunStats`` and
``merge_stats`` (what a run checked, ``_observers.stats``), ``merge_sections`` and
``merged_lines`` (the shadow compare's sections across ranks, ``opcontracts.compare``).  Each
is re-exported where it is used; this module imports nothing but the standard library and
``modpath``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .modpath import clean as clean_module_path

__all__ = ["NanEvent", "RunStats", "merge_sections", "merge_stats", "merged_lines",
           "module_label"]

Direction = Literal["forward", "backward"]  # as ``_observers.layer.Direction``


# --------------------------------------------------------------------------- the sentinel
def module_label(module: str | None, module_type: str | None) -> str:
    """A finding's module as a report names it: ``layers.2.mlp (MoELayer)``, or ``MoE (the
    root module)`` for the model itself (the sentinel's and the compare's findings alike)."""
    if not module:
        return f"{module_type or '?'} (the root module)"
    return module + (f" ({module_type})" if module_type else "")


@dataclass(frozen=True)
class NanEvent:
    """One op that produced non-finite values from finite ones."""

    op: str
    direction: Direction
    kind: Literal["output", "input_grad", "received"]  # what was non-finite (see ``what``)
    arg: str                       # "output", "output[1]", or the argument's name
    dtype: str
    shape: tuple[int, ...]
    nan: int                       # -1: not counted (``counted``)
    inf: int
    call_site: str | None          # the user's line that called the (forward) op
    module: str | None             # qualified nn.Module path ("" for the root module)
    module_type: str | None        # its class name
    backward_of: str | None = None  # for an op called during backward: the forward op
    seq: int = 0                   # order among the sentinel's checks

    @property
    def module_label(self) -> str:
        """``layers.2.mlp (MoELayer)``, or ``MoE (the root module)``."""
        return module_label(self.module, self.module_type)

    @property
    def module_clean(self) -> str | None:
        """The module path without wrapper segments (``_observers.modpath.clean``): under FSDP1,
        ``_fsdp_wrapped_module.layers.2._fsdp_wrapped_module.mlp`` is ``layers.2.mlp``."""
        return clean_module_path(self.module)

    @property
    def what(self) -> str:
        if self.kind == "input_grad":
            return f"gradient of '{self.arg}'"
        return self.arg

    @property
    def counted(self) -> bool:
        """Whether ``nan`` and ``inf`` were counted (-1 each when not: an always-on sentinel
        keeps no tensor until its read, so only the finiteness of the value is known)."""
        return self.nan >= 0 and self.inf >= 0

    def counted_text(self, numel: int) -> str:
        if not self.counted:
            return f"non-finite (NaN and inf not counted: always-on) of {numel}"
        return f"{self.nan} NaN, {self.inf} inf of {numel}"

    def message(self) -> str:
        op = self.op + (f" (in the backward of {self.backward_of})" if self.backward_of else "")
        numel = 1
        for s in self.shape:
            numel *= s
        shape = "(" + ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "") + ")"
        if self.kind == "received":
            head = f"non-finite {'gradient' if self.direction == 'backward' else 'input'} " \
                   f"reached {op} ({self.direction}): produced by an op the sentinel does not watch"
        else:
            head = f"first non-finite value: {self.direction}, in {op}"
        if self.kind == "input_grad":
            tail = "; the gradients flowing in were finite"
        elif self.kind == "output":
            tail = "; every input was finite"
        else:
            tail = ""
        lines = [
            head,
            f"  value:     {self.what}: {self.dtype} {shape}, {self.counted_text(numel)}{tail}",
            f"  call site: {self.call_site or '?'}",
        ]
        if self.module is not None:
            lines.append(f"  module:    {self.module_label}")
            if self.module_clean != self.module:
                lines.append(f"  unwrapped: {self.module_clean} (wrapper segments removed)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["module_clean"] = self.module_clean
        return d


# --------------------------------------------------------------------------- what a run checked
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


# --------------------------------------------------------------------------- the compare across ranks
_COUNTS = ("checked", "grads_checked", "skipped", "unsampled", "errors", "warnings", "dropped",
           "repaired", "grads_skipped")


def merge_sections(parts: list[tuple[int | None, dict[str, Any]]]) -> dict[str, Any]:
    """Several ranks' ``shadow_compare`` report sections (``CompareResult.to_dict``) as one:
    counts summed, each rank's first divergence under ``per_rank``, ``first`` the first of the
    lowest rank that found one.  For ``opcontracts run`` under torchrun and ``report merge``."""
    out: dict[str, Any] = dict.fromkeys(_COUNTS, 0)
    out.update(skipped_ops={}, checked_ops={}, per_rank={}, first=None, ranks=[])
    for rank, d in sorted(parts, key=lambda p: (p[0] is None, p[0] or 0)):
        for k in _COUNTS:
            out[k] += int(d.get(k, 0) or 0)
        for key in ("skipped_ops", "checked_ops"):
            for op, n in dict(d.get(key) or {}).items():
                out[key][op] = out[key].get(op, 0) + int(n)
        if rank is not None:
            out["ranks"].append(rank)
        first = d.get("first")
        if first:
            out["per_rank"][str(rank)] = first
            if out["first"] is None:
                out["first"] = {**first, "rank": rank}
    return out


def merged_lines(merged: dict[str, Any]) -> list[str]:
    """The merged section in words: the counts, and each rank's first divergence."""
    ranks = ",".join(map(str, merged.get("ranks", []))) or "?"
    head = (f"shadow compare on rank(s) {ranks}: {merged['checked']} call(s) compared "
            f"({merged['grads_checked']} with gradients), {merged['skipped']} without a "
            "reference")
    per = merged.get("per_rank") or {}
    if not per:
        return [head + "; no divergence on any rank"]
    lines = [head + "; first divergence per rank:"]
    for r, e in sorted(per.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1):
        where = e.get("module") or e.get("module_type") or "?"
        lines.append(f"  rank {r}: {e['direction']}, {e['op']}, {e['argument']} [{where}] at "
                     f"{e.get('call_site') or '?'}: {e.get('reason', '')}")
    return lines
