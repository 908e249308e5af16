"""Which argument a broken shape relation blames.

A relation such as ``N*K`` on ``sorted_indices`` and ``N K`` on ``probs`` holds between
arguments; the checker finds it broken at one of them.  Arguments another op produced
(``produced_by`` in the contract: permute's ``sorted_indices``) are the side the caller did not
build, so they bind the shape names first (the compiler orders them first) and this module,
run only on the careful checker's failure, decides what the violation says:

* the produced side against an argument the caller made: the caller's argument is blamed, with
  the shape the produced ones imply (``probs`` (16, 128) for ``N*K`` = 32 of permute's outputs:
  (16, 2));
* the caller's argument against a produced one: it stays blamed, and the message says where
  the sizes come from;
* both produced, or neither: the message names both, and the fix does not tell the user to
  change one of them alone.

Nothing here runs for a call that conforms.  Any internal failure leaves the violation as the
checker made it (a message must never fail on its explanation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from .._lang.shapes import Dim, ShapeSpec, eval_dim, parse_shape

if TYPE_CHECKING:
    from ..spec import Arg

# compile.RawViolation and compile.Rule: compile imports this module, not the other way round
RawViolation = Any
Rule = Any

__all__ = ["Plan", "BlameText", "attribute", "trusted_first"]


@dataclass(frozen=True)
class BlameText:
    """What a violation says instead of its rule's generic expectation and hint."""

    expected: str
    fix: str


def trusted_first(args: Mapping[str, Arg]) -> list[tuple[str, Arg]]:
    """The order the checkers visit arguments in: those another op produced first (their sizes
    bind the shape names), then the rest, each group in the contract's order.  A produced
    argument whose dtype or shape is checked against one the caller made (``same_dtype_as``,
    ``same_shape_as``) keeps its place after it: the caller's argument's own rules speak first."""
    def ahead(a: Arg) -> bool:
        partners = [p for p in (a.same_dtype_as, a.same_shape_as) if p is not None]
        return bool(a.produced_by) and all(
            p in args and bool(args[p].produced_by) for p in partners)

    items = list(args.items())
    return [kv for kv in items if ahead(kv[1])] + [kv for kv in items if not ahead(kv[1])]


@dataclass
class Plan:
    """What the compiler knows that an explanation needs: the arguments in the checkers' order
    and each one's shape rule by alternative (filled as the careful checker is generated)."""

    op: str
    order: list[tuple[str, Arg]]
    shape_rules: dict[tuple[str, str], Rule] = field(default_factory=dict)
    case_args: dict[int, list[tuple[str, Arg]]] = field(default_factory=dict)
    """a case's arguments (in the checkers' order) by the id of each rule the case made: the
    case's shapes bind names after the contract's own"""
    _shapes: dict[tuple[str, tuple[str, ...]], tuple[ShapeSpec, ...]] = field(default_factory=dict)
    case_from: int | None = None
    """in a plan for a case's rule: where the case's arguments begin in ``order``"""

    def for_rule(self, rule: Rule) -> Plan:
        """The plan a violation of ``rule`` is explained with: a case's rule reads the case's
        shapes after the contract's own."""
        case = self.case_args.get(id(rule))
        if case is None:
            return self
        return Plan(self.op, [*self.order, *case], self.shape_rules, self.case_args,
                    self._shapes, len(self.order))

    def shapes(self, name: str, spec: Arg) -> tuple[ShapeSpec, ...]:
        key = (name, spec.shape or ())
        got = self._shapes.get(key)
        if got is None:
            got = self._shapes[key] = tuple(parse_shape(s) for s in spec.shape or ())
        return got

    def spec(self, label: str) -> Arg | None:
        """An argument's rules, by its name or a list element's label (``weight[0]``)."""
        name = _split(label)[0]
        return next((a for n, a in self.order if n == name), None)


def _split(label: str) -> tuple[str, int | None]:
    """``weight[1]`` -> ("weight", 1); ``probs`` -> ("probs", None)."""
    if label.endswith("]") and "[" in label:
        name, i = label[:-1].split("[", 1)
        return name, int(i)
    return label, None


def _value(args: Mapping[str, Any], label: str) -> Any:
    name, i = _split(label)
    v = args.get(name)
    if i is None:
        return v
    return v[i] if isinstance(v, (list, tuple)) and i < len(v) else None


# --------------------------------------------------------------------------- reading a call
def _fmt(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(int(s)) for s in t.shape) + ("," if t.dim() == 1 else "") + ")"


def _dims(sh: ShapeSpec, t: torch.Tensor) -> list[tuple[Dim, int]] | None:
    """Each dimension of ``sh`` with the size ``t`` has there (None: the ranks differ)."""
    dims = [d for d in sh.dims if d.kind != "ellipsis"]
    n = t.dim()
    if (n < len(dims)) if sh.has_ellipsis else (n != len(dims)):
        return None
    sizes = list(t.shape)[n - len(dims):]
    return [(d, int(s)) for d, s in zip(dims, sizes)]


def _alternative(shapes: tuple[ShapeSpec, ...], t: torch.Tensor) -> ShapeSpec | None:
    return next((sh for sh in shapes if _dims(sh, t) is not None), None)


def _key(d: Dim) -> str:
    return d.text.replace(" ", "")


@dataclass
class _Reading:
    """The call as the checkers read it: the first argument to give each name its size, and
    every argument's size for each expression of names (``N*K``), in the checkers' order."""

    names: dict[str, tuple[str, int]] = field(default_factory=dict)
    exprs: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    dims: dict[str, list[tuple[Dim, int]]] = field(default_factory=dict)
    shape: dict[str, ShapeSpec] = field(default_factory=dict)

    def bindings(self) -> dict[str, int]:
        return {n: s for n, (_, s) in self.names.items()}


def _read(plan: Plan, args: Mapping[str, Any], only_trusted: bool = False,
          own: tuple[str, ShapeSpec] | None = None) -> _Reading:
    """``own``: the failing argument and the shape its rule checked (read where that rule is:
    among the contract's arguments, or the case's when the plan is a case's)."""
    r = _Reading()
    for at, (name, spec) in enumerate(plan.order):
        if only_trusted and not (plan.spec(name) or spec).produced_by:
            continue
        if not spec.shape:
            continue
        in_case = plan.case_from is not None and at >= plan.case_from
        mine = own if own is not None and in_case == (plan.case_from is not None) else None
        v = args.get(name)
        if spec.tensor_list:  # each element, as the checkers' loop reads them
            items = [(f"{name}[{i}]", x) for i, x in enumerate(v)] \
                if isinstance(v, (list, tuple)) else []
        else:
            items = [(name, v)]
        for label, t in items:
            if not isinstance(t, torch.Tensor):
                continue
            sh = mine[1] if mine is not None and mine[0] == label \
                else _alternative(plan.shapes(name, spec), t)
            dims = _dims(sh, t) if sh is not None else None
            if sh is None or dims is None:
                continue
            r.dims[label], r.shape[label] = dims, sh
            for d, s in dims:
                if d.kind == "name":
                    r.names.setdefault(d.names[0], (label, s))
                elif d.kind == "expr":
                    if d.solve is not None and d.solve[0] not in r.names:
                        x, k = d.solve
                        if s % k == 0:
                            r.names[x] = (label, s // k)
                            continue
                    r.exprs.setdefault(_key(d), []).append((label, s))
    return r


@dataclass
class _Conflict:
    dim: Dim
    mine: list[str]     # the failing argument and those agreeing with it
    theirs: list[str]   # the arguments whose sizes it disagrees with
    size: int           # the failing argument's size there
    other: int | None   # what the other side makes of that dimension


def _conflict(r: _Reading, arg: str) -> _Conflict | None:
    """The first dimension of ``arg`` that disagrees with another argument; None when the first
    dimension that fails is no relation (a fixed size) or nothing disagrees."""
    b = r.bindings()
    for d, s in r.dims.get(arg, ()):
        if d.kind == "int":
            if s != d.value:
                return None
        elif d.kind == "name":
            if d.names[0] not in r.names:  # given by an argument not read here (a list)
                continue
            who, size = r.names[d.names[0]]
            if who != arg and size != s:
                same = [a for a, dims in r.dims.items() if a != arg and a != who
                        and any(e.kind == "name" and e.names == d.names and z == s for e, z in dims)]
                return _Conflict(d, [arg, *same], [who], s, size)
        elif d.kind == "expr":
            occ = r.exprs.get(_key(d), [])
            mine = [a for a, z in occ if z == s]
            first = occ[0] if occ else None
            if first is not None and first[0] != arg and first[1] != s:
                theirs = [a for a, z in occ if z == first[1]]
                return _Conflict(d, mine, theirs, s, first[1])
            value = eval_dim(d, b)
            if value is not None and value != s:
                theirs = list(dict.fromkeys(r.names[n][0] for n in d.names if n in r.names))
                theirs = [a for a in theirs if a not in mine]
                if theirs:
                    return _Conflict(d, mine, theirs, s, value)
    return None


# --------------------------------------------------------------------------- what to say
def _producers(plan: Plan, names: list[str]) -> str:
    ops: list[str] = []
    for n in names:
        spec = plan.spec(n)
        for op in (spec.produced_by or ()) if spec is not None else ():
            if op not in ops:
                ops.append(op)
    return " or ".join(ops)


def _trusted(plan: Plan, names: list[str]) -> bool:
    return any((s := plan.spec(n)) is not None and bool(s.produced_by) for n in names)


def _both(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _with_shapes(names: list[str], args: Mapping[str, Any]) -> str:
    return _both([f"{n} {_fmt(_value(args, n))}" for n in names])


def _concrete(sh: ShapeSpec, b: Mapping[str, int]) -> str:
    out = []
    for d in sh.dims:
        v = eval_dim(d, dict(b)) if d.kind in ("name", "expr", "int") else None
        out.append(str(v) if v is not None else d.text)
    return "(" + ", ".join(out) + ("," if len(out) == 1 else "") + ")"


def _context(rule: Rule) -> str:
    """A case's condition the rule's expectation ends with (`` (when x is None)``), or ""."""
    i = rule.expected.find(" (when ")
    return rule.expected[i:] if i >= 0 else ""


def _solve(d: Dim, b: dict[str, int], target: int, free: list[str]) -> bool:
    """Give one of ``free`` (tried last first) the size that makes ``d`` equal ``target``
    (the others keep theirs); True when one fits."""
    for n in reversed(free):
        def at(v: int, n: str = n) -> int | None:
            return eval_dim(d, {**b, n: v})
        f1, f2 = at(1), at(2)
        if f1 is None or f2 is None or f2 == f1:
            continue
        step = f2 - f1
        if (target - f1) % step:
            continue
        v = (target - f1) // step + 1
        if v >= 1 and at(v) == target:
            b[n] = v
            return True
    return False


def _implied(plan: Plan, args: Mapping[str, Any], blamed: str, prefer: tuple[str, ...] = ()
             ) -> tuple[ShapeSpec, dict[str, int], bool] | None:
    """The shape the produced arguments imply for ``blamed``: their sizes for the names they
    give, the blamed argument's own for the others, then each relation they fix solved for one
    of the blamed argument's own names (``prefer`` first, then its last dimension's first: a
    dense (T, E) where (T, K) belongs keeps T).  The bool says whether every relation holds."""
    name = _split(blamed)[0]
    t = _value(args, blamed)
    if not isinstance(t, torch.Tensor):
        return None
    # the blamed argument's shape as the rule being explained has it: a case's first
    specs = [a for n, a in reversed(plan.order) if n == name and a.shape]
    sh = next((x for a in specs if (x := _alternative(plan.shapes(name, a), t)) is not None), None)
    dims = _dims(sh, t) if sh is not None else None
    if sh is None or dims is None:
        return None
    trusted = _read(plan, args, only_trusted=True)
    b = trusted.bindings()
    own: list[str] = []
    for d, s in dims:
        if d.kind == "name" and d.names[0] not in b:
            b[d.names[0]] = s
            own.append(d.names[0])
        elif d.kind == "expr" and d.solve is not None and d.solve[0] not in b and s % d.solve[1] == 0:
            b[d.solve[0]] = s // d.solve[1]
            own.append(d.solve[0])
    own = [n for n in own if n not in prefer] + [n for n in prefer if n in own]  # tried last first
    ok = True
    for f in _fixed(plan, args):
        value = eval_dim(f.dim, b)
        if value is None or value == f.size:
            continue
        ok = _solve(f.dim, b, f.size, [n for n in own if n in f.dim.names]) and ok
    return sh, b, ok


@dataclass
class _Fix:
    """A relation the produced arguments fix: ``dim`` is ``size``, as ``by`` have it."""

    dim: Dim
    size: int
    by: list[str]


def _fixed(plan: Plan, args: Mapping[str, Any], name: str | None = None) -> list[_Fix]:
    """The expressions of names (``N*K``) the produced arguments fix, those with ``name`` only
    when it is given."""
    tr = _read(plan, args, only_trusted=True)
    out = []
    for key, occ in tr.exprs.items():
        d = next(e for e, _ in tr.dims[occ[0][0]] if e.kind == "expr" and _key(e) == key)
        if name is None or name in d.names:
            out.append(_Fix(d, occ[0][1], [a for a, z in occ if z == occ[0][1]]))
    return out


def _arbitrate(plan: Plan, args: Mapping[str, Any], r: _Reading, c: _Conflict
               ) -> tuple[bool, _Fix] | None:
    """Two arguments the caller made disagree on a name (``K``): the relations the produced
    arguments fix (``N*K``) may say which size is right.  (True: the failing argument's,
    False: the other side's; with the relation that says so), or None when they cannot tell."""
    if c.dim.kind != "name" or c.other is None:
        return None
    n, full = c.dim.names[0], r.bindings()
    rels = _fixed(plan, args, n)
    if not rels:
        return None

    def holds(v: int) -> bool:
        return all(eval_dim(f.dim, {**full, n: v}) == f.size for f in rels)

    mine, theirs = holds(c.size), holds(c.other)
    return (mine, rels[0]) if mine != theirs else None


def attribute(plan: Plan, raw: RawViolation, args: Mapping[str, Any]) -> RawViolation:
    """The violation a broken shape relation should report (see the module's docstring)."""
    try:
        return _attribute(plan, raw, args)
    except Exception:  # noqa: BLE001 - never fail on an explanation: the checker's verdict stands
        return raw


def _attribute(plan: Plan, raw: RawViolation, args: Mapping[str, Any]) -> RawViolation:
    rule = raw.rule
    if rule.kind != "shape" or rule.arg is None \
            or not isinstance(rule.detail, list) or len(rule.detail) != 1:
        return raw
    arg = rule.arg if raw.index is None else f"{rule.arg}[{raw.index}]"
    own = rule.detail[0]
    plan = plan.for_rule(rule)
    t = _value(args, arg)
    if not isinstance(t, torch.Tensor):
        return raw
    if raw.value is None:  # an end-of-call check of an optional argument: show the tensor
        raw = replace(raw, value=t)
    r = _read(plan, args, own=(arg, own))
    c = _conflict(r, arg)
    if c is None:
        return raw
    mine_trusted, theirs_trusted = _trusted(plan, c.mine), _trusted(plan, c.theirs)
    ctx = _context(rule)
    if mine_trusted and not theirs_trusted and len(c.theirs) == 1:
        by = [a for a in c.mine if _trusted(plan, [a])]
        return _blame(plan, raw, args, c.theirs[0], _Fix(c.dim, c.size, by), c.other) or raw
    if theirs_trusted and not mine_trusted:
        b = r.bindings()
        concrete = _concrete(own, b)
        why = (f"{c.dim.text} = {c.other} comes from {_with_shapes(c.theirs, args)} (outputs of "
               f"{_producers(plan, c.theirs)})")
        return replace(raw, bindings=b, blame=BlameText(
            expected=f"shape ({own.text}) = {concrete}{ctx}: {why}",
            fix=f"pass {arg} with shape {concrete}: {why}"))
    if not mine_trusted and not theirs_trusted:
        verdict = _arbitrate(plan, args, r, c)
        if verdict is not None:
            mine_right, rel = verdict
            right, wrong = (c.mine, c.theirs) if mine_right else (c.theirs, c.mine)
            wrong_size = c.other if mine_right else c.size
            if (len(wrong) == 1 or not mine_right) and wrong_size is not None:
                blamed = arg if not mine_right else wrong[0]
                full = {**r.bindings(), c.dim.names[0]: wrong_size}
                agree = f", and {_with_shapes(right, args)} " + ("agrees" if len(right) == 1
                                                                  else "agree")
                got = _blame(plan, raw, args, blamed, rel, eval_dim(rel.dim, full), agree,
                             prefer=c.dim.names)
                if got is not None:
                    return got
    # both sides produced by ops, or neither: the contract cannot tell which one is wrong
    concrete = _concrete(own, r.bindings())
    shown = f" = {concrete}" if concrete != f"({own.text.replace(' ', ', ')})" else ""
    if theirs_trusted and mine_trusted:
        why = (f"both sides come from {_producers(plan, c.mine + c.theirs)}: pass the outputs "
               "of one call (neither side is right on its own)")
    else:
        why = "the contract cannot tell which side is wrong: correct that one so they agree"
    return replace(raw, blame=BlameText(
        expected=f"shape ({own.text}){shown}{ctx} to agree with {_with_shapes(c.theirs, args)} "
                 f"on {c.dim.text}",
        fix=f"{_gives(c.mine, args)} {c.dim.text} = {c.size}, {_gives(c.theirs, args)} "
            f"{c.other if c.other is not None else 'another size'}; {why}"))


def _gives(names: list[str], args: Mapping[str, Any]) -> str:
    return _with_shapes(names, args) + (" gives" if len(names) == 1 else " give")


def _blame(plan: Plan, raw: RawViolation, args: Mapping[str, Any], blamed: str, fixed: _Fix,
           own: int | None, also: str = "", prefer: tuple[str, ...] = ()) -> RawViolation | None:
    """The violation as ``blamed``'s, which breaks ``fixed`` (a relation the produced arguments
    fix; ``own``: what ``blamed`` makes of it); None when it has no shape rule to report."""
    got = _implied(plan, args, blamed, prefer)
    t = _value(args, blamed)
    if got is None:
        return None
    sh, b, ok = got
    name, index = _split(blamed)
    rule = plan.shape_rules.get((name, sh.text))
    if rule is None:
        return None
    made = f"outputs of {_producers(plan, fixed.by)}"
    rel = f"{fixed.dim.text} = {fixed.size}"
    src = f"{_with_shapes(fixed.by, args)} ({made}){also}"
    mine = f"; {blamed} {_fmt(t)} makes it {own}" if own is not None else ""
    if ok:
        concrete = _concrete(sh, b)
        expected = f"shape ({sh.text}) = {concrete}{_context(rule)}: {rel} comes from {src}"
        fix = f"pass {blamed} with shape {concrete}: {_both(fixed.by)} ({made}) fix {rel}{mine}"
    else:  # the bindings the produced side gives, not the blamed argument's own
        b = _read(plan, args, only_trusted=True).bindings()
        expected = f"shape ({sh.text}) with {rel}{_context(rule)}: {fixed.dim.text} comes from {src}"
        fix = (f"pass {blamed} with shape ({sh.text}) where {rel}: {_both(fixed.by)} ({made}) "
               f"fix it{mine}")
    return replace(raw, rule=rule, value=t, bindings=b, index=index, note=None,
                   blame=BlameText(expected, fix))
