"""torch_npu's meta kernels (``torch_npu/op_plugin/meta/_meta_registrations.py``), read with
``ast``: per op, the ranks and dtypes its ``torch._check`` calls demand of each argument and the
dtypes of the outputs it builds.

Read:

* functions decorated ``@impl(m, "op")`` where ``m = Library("npu", "IMPL", "Meta")``;
* ``torch._check(cond, ...)``: ``x.dim() == 2``, ``x.dim() in (2, 3)``, ``x.dim() >= 2``,
  ``len(x.shape) == 3``, ``x.ndim``, ``or`` of such on one argument, ``and`` of several;
  ``x.dtype == torch.float32``, ``x.dtype in (torch.float16, ...)``; local aliases
  (``x_dim = x.dim()``);
* a check under ``if x is not None:`` holds for x whenever x is given; a check under any other
  ``if`` is conditional (kept apart: it holds in some calls only);
* the returned tensors: ``torch.empty(..., dtype=torch.float32)``, ``torch.empty_like(x)``,
  ``x.new_empty(...)``, ``dtype=x.dtype``, through one level of local names.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from ._source import parse_source

__all__ = ["MetaKernel", "parse_meta", "MAX_RANK"]

MAX_RANK = 8
"""NPU tensors have at most 8 dimensions: ranks are sets within 0..8."""

_ALL = frozenset(range(MAX_RANK + 1))


@dataclass
class MetaKernel:
    op: str
    function: str
    params: tuple[str, ...]
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """ranks every call must have (checks outside any condition but ``x is not None``)"""
    cond_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """ranks demanded under some other condition (layout, mode): hold in some calls only"""
    dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cond_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    outputs: list[str | None] = field(default_factory=list)
    """per output: a dtype name (``float32``), ``"same as x"``, or None when not read"""
    checks: int = 0
    """``torch._check`` calls in the kernel"""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"function": self.function, "params": list(self.params),
                               "checks": self.checks}
        for k in ("ranks", "cond_ranks", "dtypes", "cond_dtypes"):
            v = getattr(self, k)
            if v:
                out[k] = {a: list(r) for a, r in v.items()}
        if self.outputs:
            out["outputs"] = list(self.outputs)
        return out

    @classmethod
    def from_json(cls, op: str, d: dict[str, Any]) -> MetaKernel:
        return cls(op, d.get("function", ""), tuple(d.get("params", ())),
                   {a: tuple(r) for a, r in d.get("ranks", {}).items()},
                   {a: tuple(r) for a, r in d.get("cond_ranks", {}).items()},
                   {a: tuple(r) for a, r in d.get("dtypes", {}).items()},
                   {a: tuple(r) for a, r in d.get("cond_dtypes", {}).items()},
                   list(d.get("outputs", ())), d.get("checks", 0))


def _torch_dtype(node: ast.AST) -> str | None:
    """``torch.float32`` -> ``float32`` (``torch_npu.hifloat8`` -> ``hifloat8``)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
            node.value.id in ("torch", "torch_npu"):
        return node.attr
    return None


class _Kernel:
    def __init__(self, fn: ast.FunctionDef, op: str) -> None:
        a = fn.args
        params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        self.k = MetaKernel(op, fn.name, tuple(params))
        self.params = set(params)
        self.dim_alias: dict[str, str] = {}
        self.dtype_alias: dict[str, str] = {}
        self.assign: dict[str, ast.AST] = {}
        self.ranks: dict[str, set[int]] = {}
        self.cond_ranks: dict[str, set[int]] = {}
        self.dtypes: dict[str, set[str]] = {}
        self.cond_dtypes: dict[str, set[str]] = {}
        self._collect_assignments(fn)
        self._walk(fn.body, frozenset(), False)
        self._outputs(fn)
        for src, dst in ((self.ranks, self.k.ranks), (self.cond_ranks, self.k.cond_ranks)):
            for p, s in src.items():
                if s != _ALL:
                    dst[p] = tuple(sorted(s))
        for src2, dst2 in ((self.dtypes, self.k.dtypes), (self.cond_dtypes, self.k.cond_dtypes)):
            for p, d in src2.items():
                dst2[p] = tuple(sorted(d))

    # ------------------------------------------------------------------ names
    def _collect_assignments(self, fn: ast.FunctionDef) -> None:
        for node in fn.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                name, value = node.targets[0].id, node.value
                self.assign.setdefault(name, value)
                p = self._dim_of(value, alias=False)
                if p:
                    self.dim_alias[name] = p
                d = self._dtype_param(value, alias=False)
                if d:
                    self.dtype_alias[name] = d

    def _param(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name) and node.id in self.params:
            return node.id
        return None

    def _dim_of(self, node: ast.AST, alias: bool = True) -> str | None:
        """The argument whose rank ``node`` is: ``x.dim()``, ``len(x.shape)``, ``x.ndim``."""
        if alias and isinstance(node, ast.Name):
            return self.dim_alias.get(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("dim", "ndimension") and not node.args:
            return self._param(node.func.value)
        if isinstance(node, ast.Attribute) and node.attr == "ndim":
            return self._param(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "len" and len(node.args) == 1:
            inner = node.args[0]
            if isinstance(inner, ast.Attribute) and inner.attr == "shape":
                return self._param(inner.value)
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and \
                    inner.func.attr == "size" and not inner.args:
                return self._param(inner.func.value)
        return None

    def _dtype_param(self, node: ast.AST, alias: bool = True) -> str | None:
        if alias and isinstance(node, ast.Name):
            return self.dtype_alias.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "dtype":
            return self._param(node.value)
        return None

    # ------------------------------------------------------------------ checks
    def _int_set(self, node: ast.AST) -> set[int] | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and \
                not isinstance(node.value, bool):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            out: set[int] = set()
            for e in node.elts:
                s = self._int_set(e)
                if s is None:
                    return None
                out |= s
            return out
        if isinstance(node, ast.Name) and node.id == "NPU_TENSOR_DIM_LIMIT":
            return {MAX_RANK}
        return None

    def _rank_fact(self, node: ast.AST) -> tuple[str, set[int]] | None:
        if isinstance(node, ast.BoolOp):
            facts = [self._rank_fact(v) for v in node.values]
            if any(f is None for f in facts):
                return None
            params = {f[0] for f in facts if f}
            if len(params) != 1:
                return None
            sets = [f[1] for f in facts if f]
            out = set(_ALL)
            if isinstance(node.op, ast.Or):
                out = set().union(*sets)
            else:
                for s in sets:
                    out &= s
            return params.pop(), out
        if not isinstance(node, ast.Compare) or len(node.ops) != 1:
            return None
        left, op, right = node.left, node.ops[0], node.comparators[0]
        p = self._dim_of(left)
        flip = False
        if p is None:
            p, flip = self._dim_of(right), True
            left, right = right, left
        if p is None:
            return None
        vals = self._int_set(right)
        if vals is None:
            return None
        if isinstance(op, (ast.In, ast.NotIn)):
            out = vals if isinstance(op, ast.In) else set(_ALL) - vals
            return p, out
        if len(vals) != 1:
            return None
        n = next(iter(vals))
        if flip:  # 2 <= x.dim()  ->  x.dim() >= 2
            op = {ast.Lt: ast.Gt(), ast.Gt: ast.Lt(), ast.LtE: ast.GtE(),
                  ast.GtE: ast.LtE()}.get(type(op), op)
        table = {ast.Eq: lambda r: r == n, ast.NotEq: lambda r: r != n, ast.Lt: lambda r: r < n,
                 ast.LtE: lambda r: r <= n, ast.Gt: lambda r: r > n, ast.GtE: lambda r: r >= n}
        test = table.get(type(op))
        if test is None:
            return None
        return p, {r for r in _ALL if test(r)}

    def _dtype_fact(self, node: ast.AST) -> tuple[str, set[str]] | None:
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            facts = [self._dtype_fact(v) for v in node.values]
            if any(f is None for f in facts):
                return None
            params = {f[0] for f in facts if f}
            if len(params) != 1:
                return None
            return params.pop(), set().union(*(f[1] for f in facts if f))
        if not isinstance(node, ast.Compare) or len(node.ops) != 1:
            return None
        p = self._dtype_param(node.left)
        right = node.comparators[0]
        if p is None:
            return None
        op = node.ops[0]
        if isinstance(op, ast.Eq):
            d = _torch_dtype(right)
            return (p, {d}) if d else None
        if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            names = [_torch_dtype(e) for e in right.elts]
            if all(names):
                return p, {n for n in names if n}
        return None

    def _check(self, cond: ast.AST, guard: frozenset[str], conditional: bool) -> None:
        parts = cond.values if isinstance(cond, ast.BoolOp) and isinstance(cond.op, ast.And) \
            else [cond]
        for part in parts:
            if isinstance(part, ast.Compare) and len(part.ops) > 1 and \
                    all(isinstance(o, ast.Eq) for o in part.ops):
                # a.dtype == torch.float32 and ... chained: a == b == c
                continue
            fact = self._rank_fact(part)
            if fact is not None:
                p, s = fact
                if conditional and p not in guard:  # some scenario: a rank it may have
                    self.cond_ranks[p] = self.cond_ranks.get(p, set()) | s
                else:
                    self.ranks[p] = self.ranks.get(p, set(_ALL)) & s
                continue
            dfact = self._dtype_fact(part)
            if dfact is not None:
                p, d = dfact
                if conditional and p not in guard:
                    self.cond_dtypes[p] = self.cond_dtypes.get(p, set()) | d
                else:
                    self.dtypes[p] = (self.dtypes[p] & d) if p in self.dtypes else set(d)

    def _walk(self, body: list[ast.stmt], guard: frozenset[str], conditional: bool) -> None:
        for node in body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                f = node.value.func
                if isinstance(f, ast.Attribute) and f.attr == "_check" and \
                        isinstance(f.value, ast.Name) and f.value.id == "torch" and node.value.args:
                    self.k.checks += 1
                    self._check(node.value.args[0], guard, conditional)
            elif isinstance(node, ast.If):
                t = node.test
                notnone = None
                if isinstance(t, ast.Compare) and len(t.ops) == 1 and \
                        isinstance(t.ops[0], ast.IsNot) and isinstance(t.comparators[0], ast.Constant) \
                        and t.comparators[0].value is None:
                    notnone = self._param(t.left)
                if notnone is not None:
                    self._walk(node.body, guard | {notnone}, True)
                else:
                    self._walk(node.body, guard, True)
                self._walk(node.orelse, guard, True)
            elif isinstance(node, (ast.For, ast.While, ast.With, ast.Try)):
                for sub in ("body", "orelse", "finalbody"):
                    self._walk(getattr(node, sub, []) or [], guard, True)
                for h in getattr(node, "handlers", []) or []:
                    self._walk(h.body, guard, True)

    # ------------------------------------------------------------------ outputs
    def _out_dtype(self, node: ast.AST, depth: int = 0) -> str | None:
        if isinstance(node, ast.Name) and depth < 3 and node.id in self.assign:
            return self._out_dtype(self.assign[node.id], depth + 1)
        if not isinstance(node, ast.Call):
            return None
        for kw in node.keywords:
            if kw.arg == "dtype":
                d = _torch_dtype(kw.value)
                if d:
                    return d
                p = self._dtype_param(kw.value)
                return f"same as {p}" if p else None
        f = node.func
        if isinstance(f, ast.Attribute):
            if f.attr in ("empty_like", "zeros_like", "ones_like", "full_like") and \
                    isinstance(f.value, ast.Name) and f.value.id == "torch" and node.args:
                src = node.args[0]
                p = self._param(src)
                if p:
                    return f"same as {p}"
                return self._out_dtype(src, depth + 1) if depth < 3 else None
            if f.attr in ("new_empty", "new_zeros", "new_ones", "new_full", "clone", "contiguous"):
                p = self._param(f.value)
                if p:
                    return f"same as {p}"
        return None

    def _outputs(self, fn: ast.FunctionDef) -> None:
        ret = next((n for n in reversed(fn.body) if isinstance(n, ast.Return)), None)
        if ret is None or ret.value is None:
            return
        v = ret.value
        elts = v.elts if isinstance(v, ast.Tuple) else [v]
        self.k.outputs = [self._out_dtype(e) for e in elts]


def _npu_libraries(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            args = node.value.args
            if fname == "Library" and args and isinstance(args[0], ast.Constant) and \
                    args[0].value == "npu":
                out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def parse_meta(source: str) -> dict[str, MetaKernel]:
    """op -> its meta kernel, for every ``@impl(<npu library>, "op")`` in the file (the default
    overload's when an op has several; ``op.overload`` registrations are skipped)."""
    tree = parse_source(source)
    libs = _npu_libraries(tree)
    out: dict[str, MetaKernel] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and
                    dec.func.id == "impl" and len(dec.args) >= 2):
                continue
            lib, name = dec.args[0], dec.args[1]
            if not (isinstance(lib, ast.Name) and lib.id in libs and
                    isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            if "." in name.value:
                continue
            out[name.value] = _Kernel(node, name.value).k
    return out
