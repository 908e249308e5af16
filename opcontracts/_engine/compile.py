"""Compile a contract into a straight-line checker function.

The checker has the *target's own parameter list* (every default replaced by a sentinel), so
CPython binds positional and keyword arguments to names for free: no ``inspect.Signature.bind``
(~3 µs) per call.  Its body is the ``if`` chain one would write by hand, specialised to the
contract: dtype membership against frozensets (or ``is`` for one dtype), ``len(shape)`` and
indexed size comparisons, shape names held in locals.  A conforming call returns ``None``;
the first failed rule returns a ``RawViolation`` built on the slow path.

The generated source is registered in ``linecache`` so tracebacks, ``pdb`` and ``inspect``
can show it (as attrs does for its generated methods).
"""

from __future__ import annotations

import itertools
import keyword
import linecache
import numbers
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._lang import values as _values
from .._lang.dtypes import parse_dtype
from .._lang.shapes import Dim, ShapeSpec, parse_shape
from ..errors import ContractFileError
from . import blame as _blame

if TYPE_CHECKING:  # the pydantic models are imported only when a contract is loaded
    from ..spec import Arg, Contract

__all__ = ["Param", "Rule", "RawViolation", "CompiledContract", "compile_contract", "MISSING"]


class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


MISSING: Any = _Sentinel("<missing>")  # an argument the caller did not pass
_UNBOUND: Any = _Sentinel("<unbound>")  # a shape name not bound yet


@dataclass(frozen=True)
class Param:
    """One parameter of the guarded callable: ``kind`` is one of ``inspect.Parameter`` kinds'
    names (POSITIONAL_ONLY, POSITIONAL_OR_KEYWORD, VAR_POSITIONAL, KEYWORD_ONLY, VAR_KEYWORD)."""

    name: str
    kind: str = "POSITIONAL_OR_KEYWORD"
    default: Any = field(default=None, compare=False)
    """the value used when the argument is left out (``has_default``), for ``cases``"""
    has_default: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class Rule:
    """One check of a contract, with what a message needs."""

    op: str
    arg: str | None
    kind: str  # missing type dtype same_dtype device contiguous rank shape list_len allowed bound value same_shape
    expected: str
    source: str | None
    arg_spec: Arg | None = None
    partner: str | None = None
    detail: Any = None
    layer: str | None = None
    """the layer whose check decides the rule (``spec.LAYERS``), when the contract says"""


@dataclass
class RawViolation:
    rule: Rule
    value: Any
    bindings: dict[str, int]
    index: int | None = None  # element index for tensor lists
    note: str | None = None   # extra text from value checks
    blame: Any = None
    """``blame.BlameText``: what a broken shape relation says instead of the rule's generic
    expectation and hint (which argument to change, and why)"""


@dataclass(eq=False)  # identity semantics: torch.compile guards on it by id
class CompiledContract:
    contract: Contract
    params: tuple[Param, ...]
    check: Callable[..., RawViolation | None]
    rules: list[Rule]
    source_code: str
    filename: str
    has_values: bool = False
    tensor_args: tuple[str, ...] = field(default=())
    fast: Callable[..., bool] | None = None
    """the optimistic checker: True when the call conforms, False when ``check`` must explain"""
    fast_source: str = ""
    key: int = -1
    """index in ``BY_KEY``: how code traced by torch.compile names this contract as a constant"""
    origin: Any = None
    """the contract it was compiled from (``contract`` may lack the arguments the guarded
    callable does not take): how the slow path finds the registry's readings behind it"""


_counter = itertools.count()
# weak: a contract replaced and no longer used by any guard is freed, with its entries here and
# its generated source in linecache (``_forget``): register/replace cycles keep nothing for good
BY_KEY: weakref.WeakValueDictionary[int, CompiledContract] = weakref.WeakValueDictionary()
# what code traced by torch.compile reads, by key: plain functions and strings (dynamo guards
# them cheaply; a CompiledContract read from a dict would become a constant it cannot guard)
FAST_BY_KEY: dict[int, Callable[..., Any]] = {}
OP_BY_KEY: dict[int, str] = {}
# the guards whose contract is built on their first call (``enforce.make_guard`` with a factory),
# by token: the traced guard names one by this constant and builds its contract at trace time
BY_TOKEN: weakref.WeakValueDictionary[int, Callable[..., Any]] = weakref.WeakValueDictionary()


def _expected_dtypes(names: Sequence[str]) -> str:
    return " or ".join(names) if len(names) <= 2 else "one of " + ", ".join(names)


def _among(value: Any, values: tuple[Any, ...]) -> bool:
    """``value in values`` for a tensor: a comparison that cannot say True or False (a
    multi-element tensor's ``==``) means "not one of them"."""
    try:
        return bool(value in values)
    except Exception:  # noqa: BLE001 - "Boolean value of Tensor ... is ambiguous" and kin
        return False


class _Gen:
    def __init__(self, contract: Contract, params: Sequence[Param], fast: bool = False) -> None:
        self.fast = fast
        self.c = contract
        self.params = list(params)
        self.rules: list[Rule] = []
        self.ns: dict[str, Any] = {
            "_oc_M": MISSING, "_oc_U": _UNBOUND, "_oc_T": torch.Tensor, "_oc_VALUES": _values.ENABLED,
            "_oc_IL": _int_list_tensor, "_oc_in": _among,
        }
        self.lines: list[str] = []
        self.consts = itertools.count()
        self.bound: set[str] = set()       # names surely bound at this point of the code
        self.seen: set[str] = set()        # names bound somewhere earlier (maybe conditionally)
        self.mentioned: list[str] = []     # every shape name, in order
        self.pseudo: dict[str, str] = {}   # expression text -> local holding its first size
        self.deferred: list[tuple[str, int]] = []  # code lines run at the end, with indent
        self.has_values = False
        self.pnames = {p.name for p in self.params}
        # inside a ``Case`` block: one more indent, nothing binds definitely, rules say when
        self.base = 1
        self.in_case = False
        self.context = ""
        self.case_source: str | None = None
        self.case_layer: str | None = None
        # the careful checker hands a broken relation the tensor arguments (this literal, only
        # evaluated on a failure) and the plan to explain it with (``blame``)
        self.plan = _blame.Plan(contract.op, [])
        self.args_lit = "None"

    # -- helpers -----------------------------------------------------------------------
    def const(self, value: Any) -> str:
        n = f"_oc_c{next(self.consts)}"
        self.ns[n] = value
        return n

    def rule(self, arg: str | None, kind: str, expected: str, spec: Arg | None = None,
             partner: str | None = None, detail: Any = None) -> int:
        source = (spec.source if spec is not None and spec.source else None) \
            or self.case_source or self.c.source
        layer = (spec.layer if spec is not None else None) or self.case_layer or self.c.layer
        self.rules.append(Rule(self.c.op, arg, kind, expected + self.context, source, spec,
                               partner, detail, layer))
        return len(self.rules) - 1

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)

    def bdict(self) -> str:
        items = [f"{n!r}: _oc_d_{n}" for n in self.mentioned]
        return "{" + ", ".join(items) + "}"

    def fail(self, rid: int, value: str, index: str = "None") -> str:
        if self.fast:
            return "return False"
        r = self.rules[rid]
        if r.kind == "shape" and isinstance(r.detail, list):  # a relation: who is to blame
            return f"return _oc_V({rid}, {value}, {self.bdict()}, {index}, None, {self.args_lit})"
        return f"return _oc_V({rid}, {value}, {self.bdict()}, {index})"

    # -- shape -------------------------------------------------------------------------
    def _name(self, n: str) -> None:
        if n not in self.mentioned:
            self.mentioned.append(n)

    def _bind(self, ind: int, key: str, local: str, value: str, mismatch: str,
              definite: bool, fail: str) -> None:
        """``local`` takes ``value`` where ``key`` first occurs; later occurrences fail on
        ``mismatch``.  A key bound on every path is compared directly; a first occurrence on
        every path (a required argument, nothing seen before) assigns without the sentinel
        test; anywhere else the sentinel decides between binding and comparing."""
        if key in self.bound:
            self.emit(ind, f"if {mismatch}: {fail}")
        elif definite and key not in self.seen:
            self.emit(ind, f"{local} = {value}")
            self.bound.add(key)
        else:
            self.emit(ind, f"if {local} is _oc_U: {local} = {value}")
            self.emit(ind, f"elif {mismatch}: {fail}")
        self.seen.add(key)

    def dim_check(self, ind: int, d: Dim, size: str, rid: int, val: str, idx: str,
                  definite: bool) -> None:
        for n in d.names:
            self._name(n)
        fail = self.fail(rid, val, idx)  # after _name: the failure shows this dim's names too
        if d.kind == "int":
            self.emit(ind, f"if {size} != {d.value}: {fail}")
        elif d.kind == "name":
            n = d.names[0]
            self._bind(ind, n, f"_oc_d_{n}", size, f"{size} != _oc_d_{n}", definite, fail)
        elif d.kind == "expr":
            py, nonzero = _local_expr(d)
            if all(n in self.bound for n in d.names):
                self.emit(ind, f"if {nonzero}{size} != {py}: {fail}")
                return
            if d.solve is not None and d.solve[0] not in self.bound:
                x, k = d.solve  # k*X with X unbound: the size must divide, X is its quotient
                self.emit(ind, f"if {size} % {k}: {fail}")
                self._bind(ind, x, f"_oc_d_{x}", f"{size} // {k}", f"{size} != {py}", definite, fail)
                return
            # Names not bound yet: remember this size under the expression's text, compare
            # further occurrences with it, and check the expression once names are known.
            key = d.text.replace(" ", "")
            first = key not in self.pseudo
            if first:
                self.pseudo[key] = f"_oc_e{len(self.pseudo)}"
            local = self.pseudo[key]
            self._bind(ind, key, local, size, f"{size} != {local}", definite, fail)
            if first:
                guard = " and ".join(f"_oc_d_{n} is not _oc_U" for n in d.names)
                self.deferred.append(
                    (f"if {local} is not _oc_U and {guard} and {nonzero}{local} != {py}: "
                     f"return _oc_V({rid}, {val if definite else 'None'}, __BINDINGS__, None, "
                     f"None, {self.args_lit})", 1)
                )

    def shape_checks(self, ind: int, arg: str, spec: Arg, val: str, idx: str,
                     definite: bool) -> None:
        shapes = [parse_shape(s) for s in (spec.shape or ())]
        if spec.rank is not None:
            rid = self.rule(arg, "rank", " or ".join(f"{r}-D" for r in spec.rank), spec)
            if len(spec.rank) == 1:
                self.emit(ind, f"if {val}.dim() != {spec.rank[0]}: {self.fail(rid, val, idx)}")
            else:
                self.emit(ind, f"if {val}.dim() not in {self.const(frozenset(spec.rank))}: "
                               f"{self.fail(rid, val, idx)}")
        if not shapes:
            return
        if self.fast and len(shapes) == 1 and not shapes[0].has_ellipsis:
            # optimistic: tuple unpacking checks the rank (ValueError) and binds the sizes in
            # one step; cheaper than len() plus indexing
            sh = shapes[0]
            n = sh.fixed_rank
            if n == 0:
                self.emit(ind, f"if {val}.dim(): return False")
                return
            targets = ", ".join(f"_oc_s{i}" for i in range(n))
            self.emit(ind, f"{targets}{',' if n == 1 else ''} = {val}.shape")
            rid = self.rule(arg, "shape", f"shape ({sh.text})", spec)
            for i, d in enumerate(sh.dims):
                if d.kind != "any":
                    self.dim_check(ind, d, f"_oc_s{i}", rid, val, idx, definite)
            return
        self.emit(ind, f"_oc_s = {val}.shape")
        if len(shapes) == 1:
            self.one_shape(ind, arg, spec, shapes[0], val, idx, definite)
            return
        expected = " or ".join(f"({s.text})" for s in shapes)
        rid_rank = self.rule(arg, "rank", "shape " + expected, spec, detail=shapes)
        self.emit(ind, "_oc_r = len(_oc_s)")
        for i, sh in enumerate(shapes):
            kw = "if" if i == 0 else "elif"
            self.emit(ind, f"{kw} _oc_r == {sh.fixed_rank}:")
            saved, before = set(self.bound), len(self.lines)
            self.one_shape(ind + 1, arg, spec, sh, val, idx, False, check_rank=False,
                           expected_all=expected)
            if len(self.lines) == before:  # an alternative of wildcards ("_ _"): its rank is all
                self.emit(ind + 1, "pass")
            self.bound = saved
        self.emit(ind, f"else: {self.fail(rid_rank, val, idx)}")

    def one_shape(self, ind: int, arg: str, spec: Arg, sh: ShapeSpec, val: str, idx: str,
                  definite: bool, check_rank: bool = True, expected_all: str | None = None) -> None:
        expected = expected_all or f"shape ({sh.text})"
        rid_rank = self.rule(arg, "rank", expected, spec, detail=[sh])
        rid = self.rule(arg, "shape", expected, spec, detail=[sh])
        # (the contract's own arguments come first: their rule is kept for a shape a case repeats)
        self.plan.shape_rules.setdefault((arg, sh.text), self.rules[rid])
        n = sh.fixed_rank
        if check_rank:
            if sh.has_ellipsis:
                self.emit(ind, f"if len(_oc_s) < {n}: {self.fail(rid_rank, val, idx)}")
            else:
                self.emit(ind, f"if len(_oc_s) != {n}: {self.fail(rid_rank, val, idx)}")
        dims = [d for d in sh.dims if d.kind != "ellipsis"]
        for i, d in enumerate(dims):
            if d.kind == "any":
                continue
            pos = i - len(dims) if sh.has_ellipsis else i
            self.dim_check(ind, d, f"_oc_s[{pos}]", rid, val, idx, definite)

    # -- one argument --------------------------------------------------------------------
    def tensor_body(self, ind: int, arg: str, spec: Arg, val: str, idx: str,
                    definite: bool) -> None:
        rid = self.rule(arg, "type", "a tensor or a list of ints" if spec.int_list else "a tensor",
                        spec)
        if not self.fast or spec.dtype is None:
            # the fast checker lets a non-tensor fail on comparing `.dtype` with torch dtypes;
            # without a dtype rule nothing else proves it is a tensor (a numpy array has a
            # `.shape`, an `Arg()` reads nothing at all)
            self.emit(ind, f"if not isinstance({val}, _oc_T): {self.fail(rid, val, idx)}")
        if spec.dtype is not None:
            dts = [parse_dtype(d) for d in spec.dtype]
            exp = _expected_dtypes(spec.dtype)
            if spec.same_dtype_as is not None:
                exp += f" and the dtype of {spec.same_dtype_as}"
            extra = spec.dtype_if_present or {}
            for other, more in extra.items():
                exp += f" (or {_expected_dtypes(more)} when {other} is passed)"
            rid = self.rule(arg, "dtype", exp, spec)
            # a mode chosen by an optional argument (quantized weights with their scales)
            unless = "".join(
                f" and not ({o} is not _oc_M and {o} is not None and {val}.dtype in "
                f"{self.const(frozenset(parse_dtype(d) for d in more))})"
                for o, more in extra.items())
            if len(dts) == 1:
                self.emit(ind, f"if {val}.dtype is not {self.const(dts[0])}{unless}: "
                               f"{self.fail(rid, val, idx)}")
            else:
                self.emit(ind, f"if {val}.dtype not in {self.const(frozenset(dts))}{unless}: "
                               f"{self.fail(rid, val, idx)}")
        if spec.same_dtype_as is not None:
            p = spec.same_dtype_as
            exc = spec.same_dtype_except or {}
            exp = f"the dtype of {p}"
            if exc:
                exp += " (" + "; ".join(
                    f"or {'/'.join(v)} when {p} is {k}" for k, v in exc.items()) + ")"
            rid = self.rule(arg, "same_dtype", exp, spec, partner=p)
            cond = f"isinstance({p}, _oc_T) and {val}.dtype is not {p}.dtype"
            if exc:
                table = {parse_dtype(k): frozenset(parse_dtype(x) for x in v) for k, v in exc.items()}
                cond += f" and {val}.dtype not in {self.const(table)}.get({p}.dtype, ())"
            self.emit(ind, f"if {cond}: {self.fail(rid, val, idx)}")
        if self.c.same_device and len(self.tensor_args) > 1:
            rid = self.rule(arg, "device", "the same device as the other tensor arguments", spec)
            # `.device`, not `.get_device()`: the latter is -1 for CPU and meta tensors alike
            self.emit(ind, f"if _oc_dev is _oc_U: _oc_dev = {val}.device")
            self.emit(ind, f"elif {val}.device != _oc_dev: {self.fail(rid, val, idx)}")
        if spec.contiguous:
            rid = self.rule(arg, "contiguous", "a contiguous tensor", spec)
            self.emit(ind, f"if not {val}.is_contiguous(): {self.fail(rid, val, idx)}")
        self.shape_checks(ind, arg, spec, val, idx, definite)
        if spec.numel_lt is not None:
            rid = self.rule(arg, "shape", f"fewer than {spec.numel_lt} elements", spec,
                            detail=("numel", spec.numel_lt))
            self.emit(ind, f"if {val}.numel() >= {spec.numel_lt}: {self.fail(rid, val, idx)}")
        for name, b in (spec.dims or {}).items():
            shape = " or ".join(f"({s})" for s in spec.shape or ())
            for op_name, sym, bad in (("ge", ">=", "<"), ("le", "<=", ">"), ("lt", "<", ">=")):
                bound = getattr(b, op_name)
                if bound is None:
                    continue
                rid = self.rule(arg, "shape", f"shape {shape} with {name} {sym} {bound}", spec,
                                detail=("dims", name, sym, bound))
                guard = "" if name in self.bound else f"_oc_d_{name} is not _oc_U and "
                self.emit(ind, f"if {guard}_oc_d_{name} {bad} {bound}: {self.fail(rid, val, idx)}")
        if spec.same_shape_as is not None:
            p = spec.same_shape_as
            rid = self.rule(arg, "same_shape", f"the shape of {p}", spec, partner=p)
            self.emit(ind, f"if isinstance({p}, _oc_T) and {val}.shape != {p}.shape: "
                           f"{self.fail(rid, val, idx)}")
        if spec.values is not None:
            self.has_values = True
            rid = self.rule(arg, "value", "values " + _values.describe(spec.values), spec,
                            detail=spec.values)
            if self.fast:  # values are read by the careful checker only
                self.deferred.append(("if _oc_VALUES[0]: return False", 1))
                return
            self.deferred.append((f"if _oc_VALUES[0] and isinstance({val}, _oc_T):", 1))
            partner = spec.values.duplicates_where_zero
            other = "None" if partner is None or partner not in self.pnames else \
                f"(None if {partner} is _oc_M else {partner})"
            self.deferred.append((f"_oc_vr = _oc_vc({rid}, {val}, __BINDINGS__, {other})", 2))
            self.deferred.append(("if _oc_vr is not None: return _oc_V(" + str(rid) + f", {val}, __BINDINGS__, None, _oc_vr)", 2))

    def arg_code(self, arg: str, spec: Arg) -> None:
        v = arg
        if not spec.is_tensor:
            self.scalar(arg, spec)
            return
        if spec.optional:
            self.emit(self.base, f"if {v} is not _oc_M and {v} is not None:")
            ind, definite = self.base + 1, False
        else:
            rid = self.rule(arg, "missing", "a tensor (this argument is not optional)", spec)
            touches = spec.dtype is not None or bool(spec.shape) or bool(spec.rank) \
                or spec.contiguous or spec.tensor_list
            if not (self.fast and touches):  # the fast checker's None fails on `.dtype` & co
                self.emit(self.base, f"if {v} is None: {self.fail(rid, v)}")
            # a required argument left out: a guard lets the original raise its own TypeError
            # (the optimistic checker says True); the careful one, which `check()` runs, says so.
            # Required by a case, the kernel would not notice: the careful checker explains.
            left_out = "return False" if self.in_case else "return True"
            self.emit(self.base, f"if {v} is _oc_M: "
                                 f"{left_out if self.fast else self.fail(rid, v)}")
            ind, definite = self.base, not self.in_case
        if spec.int_list:
            self.emit(ind, f"if isinstance({v}, (list, tuple)): {v} = _oc_IL({v})")
        if spec.tensor_list:
            rid = self.rule(arg, "type", "a list of tensors", spec)
            self.emit(ind, f"if not isinstance({v}, (list, tuple)): {self.fail(rid, v)}")
            if spec.max_len is not None:
                rid = self.rule(arg, "list_len", f"at most {spec.max_len} tensors", spec)
                self.emit(ind, f"if len({v}) > {spec.max_len}: {self.fail(rid, v)}")
            self.emit(ind, f"for _oc_i, _oc_x in enumerate({v}):")
            before = len(self.lines)
            self.tensor_body(ind + 1, arg, spec, "_oc_x", "_oc_i", False)
            if len(self.lines) == before:  # pragma: no cover - the type rule is always emitted
                self.emit(ind + 1, "pass")
        else:
            before = len(self.lines)
            self.tensor_body(ind, arg, spec, v, "None", definite)
            if len(self.lines) == before and ind > 1:  # an optional argument with no rule to run
                self.emit(ind, "pass")

    def default_of(self, arg: str) -> Any:
        """The value a left-out ``arg`` takes (the signature's or schema's default), or
        ``MISSING`` when there is none (or it is None: nothing to check)."""
        p = next((p for p in self.params if p.name == arg), None)
        return p.default if p is not None and p.has_default and p.default is not None else MISSING

    def fail_default(self, rid: int, default: Any) -> str:
        """Fail a left-out argument whose default breaks the rule (decided when compiling: a
        default that conforms costs the checker nothing)."""
        if self.fast:
            return "return False"
        return (f"return _oc_V({rid}, {self.const(default)}, {self.bdict()}, None, "
                "'left out: its default')")

    def scalar(self, arg: str, spec: Arg) -> None:
        v = arg
        present = f"{v} is not _oc_M and {v} is not None"
        default = self.default_of(arg)
        # None for a required scalar is a missing value, whatever its rules (unless listed)
        if not spec.optional and None not in (spec.allowed or ()):
            rid = self.rule(arg, "missing", "a value (this argument is not optional)", spec)
            self.emit(self.base, f"if {v} is None: {self.fail(rid, v)}")
        if spec.dtype_value and spec.dtype is not None:
            # a dtype passed as a value: the value itself against the torch dtypes
            wanted = spec.torch_dtypes or ()
            rid = self.rule(arg, "allowed", "a dtype among " + ", ".join(
                str(d).replace("torch.", "") for d in wanted), spec)
            vals = self.const(tuple(wanted))
            self.emit(self.base, f"if {present} and {v} not in {vals}: {self.fail(rid, v)}")
            if default is not MISSING and default not in wanted:
                self.emit(self.base, f"if {v} is _oc_M: {self.fail_default(rid, default)}")
        if spec.allowed is not None:
            rid = self.rule(arg, "allowed", "one of " + ", ".join(map(repr, spec.allowed)), spec)
            vals = self.const(tuple(spec.allowed))
            # a tensor through _oc_in (its == cannot say True or False when it has several
            # elements); the values themselves as they are
            self.emit(self.base, f"if {present} and (isinstance({v}, _oc_T) and not _oc_in({v}, "
                                 f"{vals}) or not isinstance({v}, _oc_T) and {v} not in {vals}): "
                                 f"{self.fail(rid, v)}")
            if default is not MISSING and default not in spec.allowed:
                self.emit(self.base, f"if {v} is _oc_M: {self.fail_default(rid, default)}")
        bounds = [(n, getattr(spec, n)) for n in ("ge", "le", "lt") if getattr(spec, n) is not None]
        if bounds and not self.fast:
            # a value that cannot be compared with a number ("abc" against ge=1) is a violation
            # of its own; the optimistic checker's comparison raises and sends it here
            rid = self.rule(arg, "type", "a number", spec)
            self.emit(self.base, f"if {present} and not isinstance({v}, {self.const(numbers.Real)}): "
                         f"{self.fail(rid, v)}")
        for op_name, bound in bounds:
            sym = {"ge": ">=", "le": "<=", "lt": "<"}[op_name]
            rid = self.rule(arg, "bound", f"{sym} {bound}", spec, detail=(sym, bound))
            # "not (v >= 1)", not "v < 1": a NaN satisfies no bound
            if isinstance(bound, int):
                self.emit(self.base, f"if {present} and not ({v} {sym} {bound}): "
                                     f"{self.fail(rid, v)}")
                if isinstance(default, numbers.Real) and not _holds(default, sym, bound):
                    self.emit(self.base, f"if {v} is _oc_M: {self.fail_default(rid, default)}")
            else:
                d = parse_shape(bound).dims[0]
                for n in d.names:
                    self._name(n)
                py, _ = _local_expr(d)
                guard = " and ".join(f"_oc_d_{n} is not _oc_U" for n in d.names) or "True"
                guard += "".join(f" and {x}" for x in _divisors(d))
                self.deferred.append(
                    (f"if {present} and {guard} and not ({v} {sym} {py}): "
                     f"return _oc_V({rid}, {v}, __BINDINGS__, None)", 1))
                if isinstance(default, numbers.Real):  # left out: its default against the sizes
                    c = self.const(default)
                    self.deferred.append(
                        (f"if {v} is _oc_M and {guard} and not ({c} {sym} {py}): "
                         f"return _oc_V({rid}, {c}, __BINDINGS__, None, 'left out: its default')",
                         1))

    def case_code(self, case: Any) -> None:
        """The rules of one ``Case``, under its condition (a wrapper without one of the
        condition's parameters cannot tell, and skips the case; rules for arguments it does not
        take are skipped, as for the contract's own optional rules)."""
        params = {p.name: p for p in self.params}
        if any(k not in params for k in case.condition_names):
            return
        conds = [f"({k} is _oc_M or {k} is None)" for k in case.if_none]
        for k, sizes in case.if_shape.items():
            dims = " and ".join(f"{k}.shape[{i}] == {s}" for i, s in enumerate(sizes)
                                if s is not None)
            conds.append(f"(isinstance({k}, _oc_T) and {k}.dim() == {len(sizes)}"
                         + (f" and {dims})" if dims else ")"))
        for k, vals in case.if_.items():
            p = params[k]
            value = f"({k} if {k} is not _oc_M else {self.const(p.default)})" if p.has_default \
                else k
            # a tensor where a value belongs: the case does not apply (the argument's own
            # rules, such as ``allowed``, say what is wrong with it)
            c = self.const(tuple(vals))
            test = f"(_oc_in({value}, {c}) if isinstance({value}, _oc_T) else {value} in {c})"
            conds.append(test if p.has_default else f"{k} is not _oc_M and {test}")
        cond = " and ".join(conds)
        args = {n: a for n, a in _blame.trusted_first(case.args) if n in params}
        if not args:
            return
        self.emit(1, f"if {cond}:")
        before, mark, bound = len(self.lines), len(self.deferred), set(self.bound)
        first_rule = len(self.rules)
        self.base, self.in_case = 2, True
        self.context, self.case_source = f" (when {case.condition_text})", case.source
        self.case_layer = case.layer
        try:
            for name, spec in args.items():
                self.arg_code(name, spec)
        finally:
            self.base, self.in_case, self.context, self.case_source = 1, False, "", None
            self.case_layer = None
            self.bound = bound
        if len(self.lines) == before:
            self.emit(2, "pass")
        case_args = list(args.items())
        for r in self.rules[first_rule:]:  # how a violation of the case's rules is explained
            self.plan.case_args[id(r)] = case_args
        later = self.deferred[mark:]
        del self.deferred[mark:]
        if later:  # the case's end-of-function checks, under the same condition
            self.deferred.append((f"if {cond}:", 1))
            self.deferred.extend((line, ind + 1) for line, ind in later)

    # -- whole function ------------------------------------------------------------------
    def build(self) -> CompiledContract:
        c = self.c
        # A wrapper may take fewer parameters than the op (it passes padded_mode=False itself):
        # rules for optional and scalar arguments it does not take do not apply to it; a
        # required tensor argument it lacks, or a relation to one it lacks, is an error.
        absent = [n for n in c.args if n not in self.pnames]
        for name in absent:
            a = c.args[name]
            partners = [n for n, b in c.args.items() if name in (b.same_dtype_as, b.same_shape_as)
                        or name in (b.dtype_if_present or {})]
            if (a.is_tensor and not a.optional) or partners:
                raise ContractFileError(
                    f"the contract names argument {name!r}, but the guarded callable takes "
                    f"({', '.join(p.name for p in self.params)})",
                    file=c.file, contract=c.op, field=f"args.{name}")
        if absent:
            c = self.c = c.model_copy(
                update={"args": {n: a for n, a in c.args.items() if n not in absent}})
        self.tensor_args = tuple(n for n, a in c.args.items() if a.is_tensor)
        order = _blame.trusted_first(c.args)  # produced arguments bind the shape names first
        self.plan.order = order
        self.args_lit = "{" + ", ".join(f"{n!r}: {n}" for n in self.tensor_args) + "}"
        body_start = len(self.lines)
        if c.same_device and len(self.tensor_args) > 1:
            self.emit(1, "_oc_dev = _oc_U")
        for name, spec in order:
            self.arg_code(name, spec)
        for case in c.cases:
            self.case_code(case)
        init = []
        names = self.mentioned
        if names:
            init.append("    " + " = ".join(f"_oc_d_{n}" for n in names) + " = _oc_U")
        if self.pseudo:
            init.append("    " + " = ".join(self.pseudo.values()) + " = _oc_U")
        self.lines[body_start:body_start] = init
        bd = self.bdict()
        # a name (or an expression's first size) bound on every path of the body needs no
        # sentinel test at the end: binding the produced arguments first leaves the relation to
        # this end-of-call check, which then costs what the direct comparison did
        sure = [f"_oc_d_{n}" for n in self.mentioned if n in self.bound] + \
            [local for k, local in self.pseudo.items() if k in self.bound]
        unsure = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, sure)) + r") is not _oc_U and ") \
            if sure else None
        for line, ind in self.deferred:
            line = line.replace("__BINDINGS__", bd)
            if unsure is not None:
                line = unsure.sub("", line)
            if self.fast and "return _oc_V(" in line:
                line = line[: line.index("return _oc_V(")] + "return False"
            self.emit(ind, line)
        if not self.lines:  # a contract with no rule at all: every call conforms
            self.emit(1, "pass")
        if self.fast:
            self.lines = ["    try:"] + ["    " + ln for ln in self.lines] + [
                "    except Exception:  # anything odd: let the careful checker explain",
                "        return False",
                "    return True",
            ]
        else:
            self.emit(1, "return None")
        sig = _signature_source(self.params)
        fname = f"{'fast_' if self.fast else ''}check_{_ident(c.op)}"
        src = f"def {fname}({sig}):\n" + "\n".join(self.lines) + "\n"
        filename = f"<opcontracts check {c.op} #{next(_counter)}>"
        rules = self.rules
        plan = self.plan

        def _oc_V(rid: int, value: Any, bindings: dict[str, Any], index: Any = None,
               note: str | None = None, args: dict[str, Any] | None = None) -> RawViolation:
            raw = RawViolation(rules[rid], value,
                               {k: v for k, v in bindings.items() if v is not _UNBOUND},
                               index, note)
            return raw if args is None else _blame.attribute(plan, raw, args)

        def _oc_vc(rid: int, t: torch.Tensor, bindings: dict[str, Any],
                   partner: Any = None) -> str | None:
            b = {k: v for k, v in bindings.items() if v is not _UNBOUND}
            return _values.check_values(rules[rid].detail, t, b, partner)

        self.ns["_oc_V"] = _oc_V
        self.ns["_oc_vc"] = _oc_vc
        code = compile(src, filename, "exec")
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(code, self.ns)  # noqa: S102 - source generated above from a validated contract
        fn = self.ns[fname]
        return CompiledContract(c, tuple(self.params), fn, rules, src, filename,
                                self.has_values, self.tensor_args, fn)


def _holds(value: Any, sym: str, bound: int) -> bool:
    return bool({">=": value >= bound, "<=": value <= bound, "<": value < bound}[sym])


def _int_list_tensor(v: list[Any] | tuple[Any, ...]) -> Any:
    """A list of ints as the 1-D int64 tensor the kernel would build from it; anything else
    unchanged (so the type rule reports it)."""
    if all(type(x) is int for x in v):
        return torch.tensor(v, dtype=torch.int64)
    return v


def _local_expr(d: Dim) -> tuple[str, str]:
    """A dimension's expression over the generated locals, and the test that must hold before
    it is evaluated (``"_oc_d_G and "``: its divisors are not 0; ``""`` when it has none)."""
    py = d.py or d.text
    for n in d.names:
        py = _replace_name(py, n, f"_oc_d_{n}")
    return py, "".join(f"{x} and " for x in _divisors(d))


def _divisors(d: Dim) -> list[str]:
    """The divisors of a dimension's ``//``, over the generated locals, innermost first."""
    out = list(d.divisors)
    for n in d.names:
        out = [_replace_name(x, n, f"_oc_d_{n}") for x in out]
    return out


def _replace_name(py: str, name: str, new: str) -> str:
    import re

    return re.sub(rf"\b{name}\b", new, py)


def _ident(op: str) -> str:
    # ASCII only: "²" is alphanumeric but no identifier, and a fullwidth letter is one that
    # Python normalizes (NFKC) to another name than the one the namespace is read by
    return "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in op)


def _signature_source(params: Sequence[Param]) -> str:
    out: list[str] = []
    seen_kwonly = False
    had_posonly = False
    for p in params:
        if p.kind == "POSITIONAL_ONLY":
            out.append(f"{p.name}=_oc_M")
            had_posonly = True
            continue
        if had_posonly:
            out.append("/")
            had_posonly = False
        if p.kind == "VAR_POSITIONAL":
            out.append(f"*{p.name}")
            seen_kwonly = True
        elif p.kind == "KEYWORD_ONLY":
            if not seen_kwonly:
                out.append("*")
                seen_kwonly = True
            out.append(f"{p.name}=_oc_M")
        elif p.kind == "VAR_KEYWORD":
            out.append(f"**{p.name}")
        else:
            out.append(f"{p.name}=_oc_M")
    if had_posonly:
        out.append("/")
    return ", ".join(out)


def compile_contract(contract: Contract, params: Sequence[Param] | None = None) -> CompiledContract:
    """Generate the checker for ``contract`` with the given parameter list (defaults to the
    contract's ``signature`` or its argument names in order)."""
    if params is None:
        names = contract.signature or tuple(contract.args)
        params = [Param(n) for n in names]
    for p in params:
        # every name the generated code uses for itself starts with ``_oc_``: a parameter (or
        # contract argument) can be any other identifier without shadowing one of them
        if not p.name.isidentifier() or keyword.iskeyword(p.name) or p.name.startswith("_oc_"):
            raise ContractFileError(
                f"cannot guard a parameter named {p.name!r} (parameters must be Python "
                "identifiers, not keywords, and not start with '_oc_', which the generated "
                "checkers reserve)", file=contract.file, contract=contract.op,
                field=f"args.{p.name}" if p.name in contract.args else "signature")
    careful = _Gen(contract, params).build()
    quick = _Gen(contract, params, fast=True).build()
    careful.fast = quick.check  # type: ignore[assignment]  # returns bool in fast mode
    careful.fast_source = quick.source_code
    careful.key = next(_counter)
    careful.origin = contract
    BY_KEY[careful.key] = careful
    FAST_BY_KEY[careful.key] = quick.check
    OP_BY_KEY[careful.key] = contract.op
    weakref.finalize(careful, _forget, careful.key, (careful.filename, quick.filename))
    return careful


_freed: list[tuple[int, tuple[str, ...]]] = []  # forgotten while torch.compile was tracing


def _forget(key: int, filenames: tuple[str, ...]) -> None:
    """A compiled contract was freed: drop what was kept for it by key and its sources.

    A finalizer runs wherever the last reference goes, inside torch.compile's tracing too,
    where dynamo may be iterating ``FAST_BY_KEY`` / ``OP_BY_KEY`` (the traced guard reads
    them: dynamo wraps the whole dict) -- a removal then fails its trace with "dictionary
    changed size during iteration".  While a trace is on (torch's ``TracingContext``, per
    thread) the removal waits for the next one made outside a trace."""
    _freed.append((key, filenames))
    if not _tracing():
        _sweep()


def _tracing() -> bool:
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.TracingContext.try_get() is not None


def _sweep() -> None:
    while _freed:
        key, filenames = _freed.pop()
        FAST_BY_KEY.pop(key, None)
        OP_BY_KEY.pop(key, None)
        for f in filenames:
            linecache.cache.pop(f, None)

