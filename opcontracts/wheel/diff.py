"""``opcontracts wheel diff OLD NEW``: what changed between two torch_npu releases, per op.

Added and removed ops; per op present in both: added and removed arguments (of the default
overload), changed types (``Tensor`` -> ``Tensor?``), changed defaults, added/removed overloads,
dtype changes per argument as the docstrings list them (unpermute's probs: bf16 in 2.7.1,
fp16/bf16/fp32 in 2.7.1.post11), the doc itself appearing or disappearing, and meta-kernel rank
changes.  This is what a contract's ``when`` table must follow.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from typing import Any

from .digest import Release

__all__ = ["OpChange", "ReleaseDiff", "diff", "render"]

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def _dt(names: Any) -> str:
    return "/".join(_SHORT.get(n, n) for n in sorted(names)) if names else "(none)"


@dataclass
class OpChange:
    op: str
    changes: list[str] = field(default_factory=list)


@dataclass
class ReleaseDiff:
    old: str
    new: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[OpChange] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


def _op_changes(op: str, a: Release, b: Release) -> list[str]:
    out: list[str] = []
    sa, sb = a.schema(op), b.schema(op)
    assert sa is not None and sb is not None
    ova = {s.overload or "default" for s in a.schemas[op]}
    ovb = {s.overload or "default" for s in b.schemas[op]}
    for ov in sorted(ovb - ova):
        out.append(f"overload added: {ov}")
    for ov in sorted(ova - ovb):
        out.append(f"overload removed: {ov}")
    for p in sb.params:
        q = sa.param(p.name)
        if q is None:
            out.append(f"argument added: {p.text()}" + (" (keyword-only)" if p.kw_only else ""))
            continue
        if q.type != p.type:
            out.append(f"{p.name}: type {q.type} -> {p.type}")
        if q.default != p.default:
            out.append(f"{p.name}: default {q.default} -> {p.default}")
        if q.kw_only != p.kw_only:
            out.append(f"{p.name}: {'now' if p.kw_only else 'no longer'} keyword-only")
    for q in sa.params:
        if sb.param(q.name) is None:
            out.append(f"argument removed: {q.text()}")
    if [p.name for p in sa.params if sb.param(p.name)] != \
            [p.name for p in sb.params if sa.param(p.name)]:
        out.append("argument order changed")
    if sa.returns != sb.returns:
        out.append(f"returns {sa.returns} -> {sb.returns}")
    da, db = a.docs.get(op), b.docs.get(op)
    if (da is None) != (db is None):
        out.append("docstring added" if db is not None else "docstring removed")
    elif da is not None and db is not None:
        for name in list(dict.fromkeys([*da.args, *db.args])):
            x, y = da.args.get(name), db.args.get(name)
            dx = set(x.dtypes) if x and x.dtypes else set()
            dy = set(y.dtypes) if y and y.dtypes else set()
            if dx != dy:
                out.append(f"{name}: doc dtypes {_dt(dx)} -> {_dt(dy)}")
            sx, sy = (x.same_as if x else None), (y.same_as if y else None)
            if sx != sy:
                out.append(f"{name}: doc 'same dtype as' {sx or '-'} -> {sy or '-'}")
        if da.blocks != db.blocks:
            out.append(f"documented {da.blocks} -> {db.blocks} times (the last block counts)")
    ra, _ = a.meta_ranks(op)
    rb, _ = b.meta_ranks(op)
    if (op in a.meta) != (op in b.meta):
        out.append("meta kernel added" if op in b.meta else "meta kernel removed")
    for name in sorted(set(ra) | set(rb)):
        if ra.get(name) != rb.get(name):
            fa = "/".join(map(str, ra[name])) if name in ra else "unchecked"
            fb = "/".join(map(str, rb[name])) if name in rb else "unchecked"
            out.append(f"{name}: meta rank {fa} -> {fb}")
    oa, ob = a.meta_outputs(op), b.meta_outputs(op)
    if oa and ob and oa != ob:
        out.append(f"meta outputs {oa} -> {ob}")
    return out


def diff(a: Release, b: Release, op: str | None = None) -> ReleaseDiff:
    """``a`` -> ``b``; ``op``: only ops matching this glob pattern."""
    def keep(name: str) -> bool:
        return op is None or fnmatch.fnmatchcase(name, op)

    res = ReleaseDiff(a.version, b.version)
    ops_a, ops_b = set(a.schemas), set(b.schemas)
    res.added = sorted(o for o in ops_b - ops_a if keep(o))
    res.removed = sorted(o for o in ops_a - ops_b if keep(o))
    for name in sorted(ops_a & ops_b):
        if keep(name):
            ch = _op_changes(name, a, b)
            if ch:
                res.changed.append(OpChange(name, ch))
    return res


def render(d: ReleaseDiff) -> str:
    lines = [f"torch_npu {d.old} -> {d.new}"]
    if d.empty:
        lines.append("  no differences in the schemas, docstrings' dtypes or meta kernels")
        return "\n".join(lines)
    if d.added:
        lines.append(f"  ops added ({len(d.added)}): " + ", ".join(d.added))
    if d.removed:
        lines.append(f"  ops removed ({len(d.removed)}): " + ", ".join(d.removed))
    for c in d.changed:
        lines.append(f"  {c.op}")
        lines += [f"    {x}" for x in c.changes]
    lines.append(f"{len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed")
    return "\n".join(lines)
