"""The contract model (frozen pydantic models ``Contract`` and ``Arg``) and TOML loading.

A contract file is a list of ``[[contract]]`` tables::

    [[contract]]
    op = "npu_moe_token_unpermute"
    targets = ["torch_npu.npu_moe_token_unpermute", "torch.ops.npu.npu_moe_token_unpermute"]
    source = "MindSpeed master, docs/ops/npu_moe_token_unpermute.md"

    [contract.args.probs]
    dtype = "bf16"
    shape = "N K"
    optional = true

Every error names the file, the contract and the field, and one ``ContractFileError`` lists
every problem of a file (or of the files of a folder).  Whatever a file holds (wrong types in
any field, dates, junk bytes, deep nesting, huge expressions), loading it raises
``ContractFileError`` and nothing else; so do ``Arg(...)`` and ``Contract(...)`` built in Python.
"""

from __future__ import annotations

import difflib
import keyword
import os
import re
import reprlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ._lang.dtypes import dtype_name, parse_dtype
from ._lang.shapes import parse_shape
from .errors import ContractFileError, FileProblem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Arg", "Case", "Contract", "When", "ValueRule", "DimBound", "load_contracts",
           "contracts_from_toml", "contract_files", "RESERVED_PREFIX", "LAYERS", "Layer"]

_Bound = int | str  # an integer or a shape expression over bound names ("N*K", "E")
_Size = Annotated[StrictInt, Field(ge=0)]
_Positive = Annotated[StrictInt, Field(ge=1)]

Layer = Literal["torch_npu", "cann", "mindspeed", "meta"]
"""The layer whose check decides a rule, so a tool knows which version the rule follows:

``torch_npu``  torch_npu's own glue (a ``TORCH_CHECK`` in op-plugin's C++ before the kernel):
               the rule follows the torch_npu release
``cann``       op-plugin passes the call straight to aclnn (``EXEC_NPU_CMD`` with no check of
               its own): the CANN kernel decides, the rule follows the CANN release
``mindspeed``  MindSpeed's own C++ or Python checks (its ops and autograd wrappers)
``meta``       the op's meta (fake) kernel: shape inference rejects the call under
               ``torch.compile`` and on meta tensors, whatever the device would do
"""
LAYERS: tuple[str, ...] = ("torch_npu", "cann", "mindspeed", "meta")

RESERVED_PREFIX = "_oc_"
"""names of the generated checkers' own locals start with this: no argument may"""


class _FieldProblems(ValueError):
    """Raised by a validator that found problems in sub-fields: (dotted sub-field, message)
    pairs, so each problem is reported at its own field (pydantic keeps the exception in the
    error's ``ctx``)."""

    def __init__(self, problems: Sequence[tuple[str | None, str]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(m for _, m in self.problems))


_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlist = 3, 60, 60, 6


def _show(v: Any) -> str:
    """``type repr`` of a user's value, short whatever it is (deeply nested, huge)."""
    try:
        return f"{type(v).__name__} {_short.repr(v)}"
    except Exception:  # noqa: BLE001 - a value whose repr fails must not hide the problem
        return type(v).__name__


def _items(v: Any, what: str) -> list[Any]:
    """One value or a list/tuple of them, as a list (the caller checks each item's type, so
    a number, a table or a date where a string belongs is reported as such)."""
    if isinstance(v, (list, tuple)):
        if not v:
            raise ValueError(f"{what} list is empty")
        return list(v)
    return [v]


def _name_problem(name: Any, what: str = "argument name") -> str | None:
    """Why ``name`` cannot be a parameter of the generated checker, or ``None``."""
    if not isinstance(name, str):
        return f"{what} must be a string, got {_show(name)}"
    if not name.isidentifier():
        return f"{what} {name!r} is not a Python identifier"
    if keyword.iskeyword(name):
        return f"{what} {name!r} is a Python keyword: no Python callable can take it"
    if name.startswith(RESERVED_PREFIX):
        return f"{what} {name!r} starts with {RESERVED_PREFIX!r}, reserved for opcontracts' generated code"
    return None


def _check_bound(v: Any) -> Any:
    if v is None:
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        spec = parse_shape(v)
        if len(spec.dims) != 1 or spec.dims[0].kind in ("any", "ellipsis"):
            raise ValueError(f"expected one integer or expression such as 'N*K', got {v!r}")
        return v
    raise ValueError(f"expected an integer or a shape expression such as 'E', got {_show(v)}")


class _Frozen(BaseModel):
    # defer_build: the validators are built on first use, not at import (import time matters:
    # `import opcontracts.patch` sits at the top of training scripts)
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True,
                              arbitrary_types_allowed=True, defer_build=True)

    def __repr_args__(self) -> Any:
        # only the fields that differ from their defaults: ``Arg(dtype=('bfloat16',))``, not
        # twenty ``=None`` (inspect.signature of an annotated wrapper prints this repr)
        for name, info in type(self).model_fields.items():
            if not info.repr:
                continue
            value = getattr(self, name)
            if value != info.default:
                yield name, value

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        # the project's error from every entry point (the registry builds merged Args this way)
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise ContractFileError.of(_problems(exc, cls, obj=cls.__name__)) from None


class ValueRule(_Frozen):
    """Checks that read tensor values; they run only when value checks are enabled."""

    permutation: StrictBool = False
    """the values are a permutation of ``[0, numel)`` (no duplicates, none out of range)"""
    nonnegative: StrictBool = False
    nondecreasing: StrictBool = False
    increasing: StrictBool = False
    lt: _Bound | None = None
    """every value is below this bound (an integer or an expression such as ``E``)"""
    last: _Bound | None = None
    """the last value equals this"""
    sum: _Bound | None = None
    """the values sum to this"""
    last_le: _Bound | None = None
    """the last value is at most this (offsets that end inside a buffer: its valid prefix)"""
    sum_le: _Bound | None = None
    """the values sum to at most this (counts of a buffer's valid prefix)"""
    skip: StrictInt | None = None
    """entries equal to this are rows the kernel skips (``-1``): the other rules ignore them"""
    duplicates_where_zero: str | None = None
    """with ``permutation``: a value may repeat where this argument (same number of elements)
    is 0 there, e.g. unpermute's sorted_indices where the probs are 0"""
    finite: StrictBool = False

    _v = field_validator("lt", "last", "sum", "last_le", "sum_le", mode="before")(_check_bound)

    @model_validator(mode="after")
    def _partner_needs_permutation(self) -> ValueRule:
        if self.duplicates_where_zero is not None and not self.permutation:
            raise ValueError("duplicates_where_zero relaxes permutation: set permutation = true")
        return self


class DimBound(_Frozen):
    """Limits on one named size of a shape (``dims = {K = {le = 512}}``): kernels document
    such limits (topK <= 512, head dim < 896) and fail or misbehave beyond them."""

    ge: _Size | None = None
    le: _Size | None = None
    lt: _Positive | None = None

    @model_validator(mode="after")
    def _some(self) -> DimBound:
        if (self.ge, self.le, self.lt) == (None, None, None):
            raise ValueError("give at least one of ge, le, lt")
        lo = self.ge
        hi = self.le if self.lt is None else self.lt - 1 if self.le is None else min(self.le, self.lt - 1)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"no size satisfies {self!r}")
        return self


class Arg(_Frozen):
    """The rules for one argument.

    ``Arg(dtype="bf16", shape="N K")``; every field is optional.
    """

    dtype: tuple[str, ...] | None = None
    """accepted dtypes, in order of preference (``fix`` casts to the first floating one)"""
    shape: tuple[str, ...] | None = None
    """a shape string, or a list of alternatives with different ranks"""
    rank: tuple[int, ...] | None = None
    """one rank or a list of them"""
    same_dtype_as: str | None = None
    same_dtype_except: dict[str, tuple[str, ...]] | None = None
    """with ``same_dtype_as``: extra dtypes allowed for a given partner dtype ({bf16 = ["fp32"]})"""
    same_shape_as: str | None = None
    dtype_if_present: dict[str, tuple[str, ...]] | None = None
    """with ``dtype``: extra dtypes allowed when another argument is passed (not None), for
    kernels whose mode is chosen by an optional argument: ``{antiquant_scale = ["int8"]}`` lets
    a quantized weight through only with its scales"""
    optional: StrictBool = False
    """``None`` (or leaving the argument out) is allowed"""
    fix: Literal["cast", "never"] | None = None
    """``fix`` mode: floats are cast by default; ``cast`` also allows integer narrowing when the
    values fit; ``never`` forbids repairs"""
    contiguous: StrictBool = False
    tensor_list: StrictBool = Field(default=False, alias="list")
    """the argument is a list/tuple of tensors; rules apply to every element"""
    max_len: _Positive | None = None
    ge: _Bound | None = None
    le: _Bound | None = None
    lt: _Bound | None = None
    allowed: tuple[Any, ...] | None = None
    """for non-tensor arguments: the values that are supported"""
    dtype_value: StrictBool = False
    """the argument is a dtype passed as a value (a ``ScalarType``: the ``_grad_v2`` kernels
    take the forward tensor's dtype instead of the tensor), checked against ``dtype``"""
    dtype_of: str | None = None
    """with the contract's ``rules_of``: a dtype passed as a value, checked against the dtype
    rules the other op's contracts have for the argument named here (``permuted_tokens_dtype``
    follows ``permuted_tokens``), version by version"""
    values: ValueRule | None = None
    dims: dict[str, DimBound] | None = None
    """bounds on sizes named in this argument's shape: ``dims = {K = {le = 512}}``"""
    numel_lt: _Positive | None = None
    """the tensor has fewer than this many elements (kernels index with 24- or 32-bit ints)"""
    int_list: StrictBool = False
    """a list or tuple of ints is accepted too, checked as a 1-D int64 tensor (MindSpeed's gmm
    takes ``group_list`` either way)"""
    produced_by: tuple[str, ...] | None = None
    """the op (or ops) whose output this argument normally is (unpermute's ``sorted_indices``:
    ``npu_moe_token_permute``): the side of a shape relation the caller did not build.  Its
    sizes bind the shape names first, and a relation it breaks with an argument the caller
    made blames that argument (both or neither produced: the message names both)"""
    source: str | None = None
    layer: Layer | None = None
    """the layer whose check decides this argument's rules, when it is not the contract's
    (``LAYERS``: ``torch_npu``, ``cann``, ``mindspeed``, ``meta``)"""
    hint: str | None = None
    """a suggested fix that replaces the generated one"""
    doc: str | None = None
    doc_conflict: str | None = None
    """a deliberate disagreement with the torch_npu docstring, and why (``opcontracts wheel
    verify`` reads it: a marked difference is reported, not failed)"""

    def __init__(self, dtype: Any = None, shape: Any = None, /, **data: Any) -> None:
        if dtype is not None:
            data["dtype"] = dtype
        if shape is not None:
            data["shape"] = shape
        try:
            super().__init__(**data)
        except ValidationError as exc:  # the project's error: field, expected, got; no URL
            raise ContractFileError.of(_problems(exc, Arg, obj="Arg")) from None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtypes(cls, v: Any) -> Any:
        if v is None:
            return v
        return tuple(dtype_name(parse_dtype(x)) for x in _items(v, "dtype"))

    @field_validator("same_dtype_except", mode="before")
    @classmethod
    def _except(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, Mapping):
            raise ValueError(f"expected a table such as {{bf16 = ['fp32']}}, got {_show(v)}")
        out = {}
        for k, vals in v.items():
            items = _items(vals, f"same_dtype_except.{k}")
            out[dtype_name(parse_dtype(k))] = tuple(dtype_name(parse_dtype(x)) for x in items)
        return out

    @field_validator("dtype_if_present", mode="before")
    @classmethod
    def _if_present(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, Mapping):
            raise ValueError("expected a table such as {antiquant_scale = ['int8']}, got "
                             f"{_show(v)}")
        out = {}
        for k, vals in v.items():
            items = _items(vals, f"dtype_if_present.{k}")
            out[str(k)] = tuple(dtype_name(parse_dtype(x)) for x in items)
        return out

    @field_validator("produced_by", mode="before")
    @classmethod
    def _producers(cls, v: Any) -> Any:
        if v is None:
            return v
        items = _items(v, "produced_by")
        for x in items:
            if not isinstance(x, str) or not x.strip():
                raise ValueError("produced_by names an op (or a list of ops) such as "
                                 f"'npu_moe_token_permute', got {_show(x)}")
        return tuple(items)

    @field_validator("shape", mode="before")
    @classmethod
    def _shapes(cls, v: Any) -> Any:
        if v is None:
            return v
        items = _items(v, "shape")
        ranks = set()
        specs = [parse_shape(s) for s in items]  # a non-string says "a shape must be a string"
        for s, spec in zip(items, specs):
            key = ("...", spec.fixed_rank) if spec.has_ellipsis else spec.fixed_rank
            if key in ranks:
                raise ValueError(f"shape alternatives must differ in rank, {s!r} repeats one")
            ranks.add(key)
        if len(items) > 1 and any(spec.has_ellipsis for spec in specs):
            raise ValueError("shape alternatives cannot use '...'")
        return tuple(items)

    @field_validator("rank", mode="before")
    @classmethod
    def _rank(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, (list, tuple)):
            items = _items(v, "rank")
        elif isinstance(v, int) and not isinstance(v, bool):
            items = [v]
        else:
            raise ValueError(f"rank must be an integer or a list of integers such as [2, 3], "
                             f"got {_show(v)}")
        for r in items:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(f"rank must be a non-negative integer, got {_show(r)}")
        return tuple(items)

    @field_validator("allowed", mode="before")
    @classmethod
    def _allowed(cls, v: Any) -> Any:
        if v is None:
            return v
        items = _items(v, "allowed")
        for x in items:
            if x is not None and not isinstance(x, (bool, int, float, str)):
                raise ValueError("allowed values are None, booleans, numbers or strings, "
                                 f"got {_show(x)}")
        return tuple(items)

    _b = field_validator("ge", "le", "lt", mode="before")(_check_bound)

    @model_validator(mode="after")
    def _dims_named(self) -> Arg:
        problems: list[tuple[str | None, str]] = []
        if self.dims:
            named = {n for s in (self.shape or ()) for n in parse_shape(s).names}
            for n in self.dims:
                if n not in named:
                    shape = f"shape {' or '.join(map(repr, self.shape))}" if self.shape else "no shape"
                    problems.append((f"dims.{n}", f"names {n!r}, which this argument's shape does "
                                                  f"not mention ({shape})"))
        if self.same_dtype_except is not None and self.same_dtype_as is None:
            problems.append(("same_dtype_except", "needs same_dtype_as (the partner whose dtype "
                                                  "it makes exceptions for)"))
        if self.dtype_if_present is not None and self.dtype is None:
            problems.append(("dtype_if_present", "needs dtype (the dtypes it adds to)"))
        if self.dtype_value and self.dtype is None:
            problems.append(("dtype_value", "needs dtype (the dtypes the value may be)"))
        if self.dtype_value and (self.shape or self.rank or self.same_dtype_as or self.contiguous
                                 or self.tensor_list):
            problems.append(("dtype_value", "a dtype passed as a value has no tensor rules "
                                            "(shape, rank, same_dtype_as, contiguous, list)"))
        if self.max_len is not None and not self.tensor_list:
            problems.append(("max_len", "applies to a list of tensors: add list = true"))
        if problems:
            raise _FieldProblems(problems)
        return self

    @property
    def torch_dtypes(self) -> tuple[Any, ...] | None:
        return None if self.dtype is None else tuple(parse_dtype(d) for d in self.dtype)

    @property
    def is_tensor(self) -> bool:
        """Arguments are tensors (or tensor lists) unless they carry only scalar rules
        (``allowed``, ``ge``, ``le``, ``lt``)."""
        return self.allowed is None and self.ge is None and self.le is None and self.lt is None \
            and not self.dtype_value and self.dtype_of is None


class When(_Frozen):
    """Version conditions: packaging specifiers (``">=2.13"``) and chip names.

    A version field may also be a list of alternatives, any of which may hold
    (``torch_npu = [">=2.13", ">=2.7.1.post11,<2.8"]``: torch_npu releases do not document in
    version order); it is kept as one string, the alternatives joined by `` || ``."""

    torch_npu: str | None = None
    cann: str | None = None
    mindspeed: str | None = None
    torch: str | None = None
    soc: tuple[str, ...] | None = None

    @field_validator("torch_npu", "cann", "mindspeed", "torch", mode="before")
    @classmethod
    def _spec(cls, v: Any) -> Any:
        if v is None:
            return v
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        if isinstance(v, (list, tuple)):
            if not v or not all(isinstance(x, str) for x in v):
                raise ValueError(f"expected a specifier or a non-empty list of them, got {v!r}")
            parts = [str(x).strip() for x in v]
        else:
            parts = [p.strip() for p in str(v).split("||")]
        for part in parts:
            if not part:  # SpecifierSet("") matches every release: a typo must not do that
                raise ValueError(f"an empty alternative in {v!r} would match every release "
                                 "(write the alternatives as 'A || B', or a list ['A', 'B'])")
            try:
                SpecifierSet(part)
            except InvalidSpecifier:
                raise ValueError(f"not a version specifier: {part!r} (try '>=8.0.0', or a list "
                                 "of alternatives such as ['>=2.13', '==2.7.1.post11'])") from None
        return " || ".join(parts)

    @field_validator("soc", mode="before")
    @classmethod
    def _soc(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if isinstance(items, (list, tuple)):
            if not items:
                raise ValueError("soc = [] names no chip (leave soc out to mean any chip)")
            if any(not isinstance(x, str) or not x.strip() for x in items):
                raise ValueError(f"soc: chip names are non-empty strings, got {_show(v)}")
            return tuple(items)
        return v


class Case(_Frozen):
    """Rules that hold only when scalar arguments have given values: the kernel's mode is chosen
    by an argument's value (``input_layout = "TND"``, ``group_list_type = 1``)::

        [[contract.cases]]
        if = {input_layout = "TND", sparse_mode = [2, 3, 4, 6, 7, 8]}
        source = "torch_npu 2.14.0 _op_plugin_docs.py (npu_fusion_attention)"
        [contract.cases.args.atten_mask]
        shape = "2048 2048"
        optional = true

    ``if`` maps argument names to a value or a list of values (any of them); an argument left
    out counts as its default when the target's signature or schema gives one (else the case
    does not apply).  ``if_none`` lists arguments that must be left out or ``None`` (a kernel
    mode chosen by an optional tensor's absence: no ``block_table``, no page attention);
    ``if_shape`` maps tensor arguments to a shape pattern of sizes and ``_`` that their shape
    must match (``{atten_mask = "_ 1 1 _"}``).  Every rule of ``args`` then holds too, on top
    of the contract's own; ``optional = false`` there means the case requires the argument."""

    if_: dict[str, Any] = Field(default_factory=dict, alias="if")
    if_none: tuple[str, ...] = ()
    """arguments the case needs left out or ``None``"""
    if_shape: dict[str, tuple[int | None, ...]] = Field(default_factory=dict)
    """argument -> the sizes its shape must have (``None`` for ``_``: any size)"""
    args: dict[str, Arg]
    source: str | None = None
    layer: Layer | None = None
    """the layer whose check decides the case's rules, when it is not the contract's"""
    doc: str | None = None

    @field_validator("if_", mode="before")
    @classmethod
    def _cond(cls, v: Any) -> Any:
        if not isinstance(v, Mapping) or not v:
            raise ValueError("expected a table such as {input_layout = 'TND'}, got " + _show(v))
        out: dict[str, Any] = {}
        for k, val in v.items():
            items = list(val) if isinstance(val, (list, tuple)) else [val]
            for x in items:
                if x is not None and not isinstance(x, (bool, int, float, str)):
                    raise ValueError(f"if.{k}: a value or a list of values (None, booleans, "
                                     f"numbers, strings), got {_show(x)}")
            if not items:
                raise ValueError(f"if.{k}: the list of values is empty")
            out[str(k)] = tuple(items)
        return out

    @field_validator("if_shape", mode="before")
    @classmethod
    def _shape_cond(cls, v: Any) -> Any:
        if not isinstance(v, Mapping):
            raise ValueError("expected a table such as {atten_mask = '_ 1 1 _'}, got " + _show(v))
        out: dict[str, tuple[int | None, ...]] = {}
        for k, pattern in v.items():
            if not isinstance(pattern, str) or not pattern.split():
                raise ValueError(f"if_shape.{k}: a shape pattern of sizes and '_', got "
                                 f"{_show(pattern)}")
            sizes: list[int | None] = []
            for tok in pattern.split():
                if tok == "_":
                    sizes.append(None)
                elif tok.isdigit():
                    sizes.append(int(tok))
                else:
                    raise ValueError(f"if_shape.{k}: {tok!r} is neither a size nor '_' "
                                     f"(in {pattern!r})")
            out[str(k)] = tuple(sizes)
        return out

    @model_validator(mode="after")
    def _some_condition(self) -> Case:
        if not (self.if_ or self.if_none or self.if_shape):
            raise ValueError("a case needs a condition: if, if_none or if_shape")
        return self

    @property
    def condition_names(self) -> tuple[str, ...]:
        """Every argument the condition reads."""
        return tuple(dict.fromkeys([*self.if_, *self.if_none, *self.if_shape]))

    @property
    def condition_text(self) -> str:
        parts = []
        for k, vals in self.if_.items():
            parts.append(f"{k} = {vals[0]!r}" if len(vals) == 1
                         else f"{k} in ({', '.join(map(repr, vals))})")
        parts += [f"{k} is None" for k in self.if_none]
        parts += [f"{k} has shape ({' '.join('_' if s is None else str(s) for s in sizes)})"
                  for k, sizes in self.if_shape.items()]
        return " and ".join(parts)


class Contract(_Frozen):
    """One operator's contract.

    ``Contract("my_op", {"x": Arg("bf16", "N H")}, targets=["pkg.mod.my_op"])``
    """

    op: str
    args: dict[str, Arg]
    targets: tuple[str, ...] = ()
    source: str | None = None
    layer: Layer | None = None
    """the layer whose check decides the rules (``LAYERS``): ``cann`` when op-plugin passes the
    call straight to aclnn, ``torch_npu`` for op-plugin's own ``TORCH_CHECK`` calls, ``mindspeed``
    for MindSpeed's checks, ``meta`` for the meta kernel's; ``list`` and violation messages show
    it next to the source"""
    when: When | None = None
    doc: str | None = None
    signature: tuple[str, ...] | None = None
    """parameter names in call order when the target's signature cannot be read"""
    same_device: StrictBool = False
    """check that every tensor argument is on the same device (``get_device()``, ~45 ns per
    tensor: opt-in, since most kernels' own dispatch already rejects mixed devices)"""
    cases: tuple[Case, ...] = ()
    """rules that hold only when arguments have given values (``Case``)"""
    replace: StrictBool = False
    """a user's contract that replaces the shipped contracts of its op where it applies; without
    it, a user's contract adds to them (a call must satisfy both)"""
    rules_of: str | None = None
    """another op reaching the same kernel (torch_npu's internal ``_npu_X`` of a public ``X``,
    a ``_grad_v2`` op of its ``_grad`` op): this contract takes every contract of that op, per
    version (its ``when`` intersected with this one's), keeping the arguments in this
    ``signature`` and overriding the fields this ``args`` sets"""
    file: str | None = Field(default=None, repr=False)

    def __init__(self, op: Any = None, args: Any = None, /, **data: Any) -> None:
        if op is not None:
            data["op"] = op
        if args is not None:
            data["args"] = args
        if data.get("rules_of") is not None:
            data.setdefault("args", {})  # the rules come from the other op's contracts
        label = _label(data.get("op"))
        file = data.get("file") if isinstance(data.get("file"), str) else None
        early = [q._replace(file=file, contract=label, obj="Contract") for q in _name_problems(data)]
        try:
            super().__init__(**data)
        except ValidationError as exc:  # the project's error: field, expected, got; no URL
            problems = _problems(exc, Contract, file=file, contract=label, obj="Contract")
            raise ContractFileError.of(_unique(early + problems)) from None
        if early:  # pragma: no cover - the model validator finds the same problems
            raise ContractFileError.of(early)

    @field_validator("op")
    @classmethod
    def _op(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("op must be a non-empty name")
        return v

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, v: Any) -> Any:
        if v is None:
            return ()
        if not isinstance(v, (str, list, tuple)):
            raise ValueError("targets must be a dotted path or a list of them, such as "
                             f"['torch_npu.npu_swiglu'], got {_show(v)}")
        items = [v] if isinstance(v, str) else list(v)
        for t in items:
            if not isinstance(t, str) or "." not in t or any(not p.isidentifier() for p in t.split(".")):
                raise ValueError(f"target must be a dotted path such as 'torch_npu.npu_swiglu', got {_show(t)}")
        return tuple(items)

    @model_validator(mode="after")
    def _relations(self) -> Contract:
        problems = _name_problems({"args": self.args, "signature": self.signature})
        out: list[tuple[str | None, str]] = [(p.field, p.message) for p in problems]
        # a rules_of contract takes the other op's arguments: partners may be any in its signature
        partners = set(self.args) | (set(self.signature or ()) if self.rules_of else set())
        for name, arg in self.args.items():
            if arg.dtype_of is not None and not self.rules_of:
                out.append((f"args.{name}.dtype_of", "takes the dtype rules of another op's "
                            "argument: it needs the contract's rules_of (else: dtype_value = "
                            "true with dtype)"))
            for field in ("same_dtype_as", "same_shape_as"):
                partner = getattr(arg, field)
                if partner is not None and partner not in partners:
                    out.append((f"args.{name}.{field}", f"names {partner!r}, which is not an "
                                f"argument of this contract (arguments: {', '.join(self.args)})"))
                elif partner == name:
                    out.append((f"args.{name}.{field}", "names the argument itself"))
            partner = arg.values.duplicates_where_zero if arg.values is not None else None
            if partner is not None and (partner not in self.args or partner == name):
                out.append((f"args.{name}.values.duplicates_where_zero",
                            f"names {partner!r}, which is not another argument of this contract "
                            f"(arguments: {', '.join(self.args)})"))
            for other in arg.dtype_if_present or {}:
                if other not in self.args or other == name:
                    out.append((f"args.{name}.dtype_if_present.{other}",
                                f"names {other!r}, which is not another argument of this contract "
                                "(declare it, e.g. with optional = true)"))
        if self.signature is not None:
            missing = [a for a in self.args if a not in self.signature]
            if missing:
                out.append(("signature", f"lacks the arguments {missing}"))
        known = set(self.args) | set(self.signature or ())
        for i, case in enumerate(self.cases):
            for k in case.condition_names:
                if k not in known:
                    out.append((f"cases.{i}.if.{k}", f"names {k!r}, which is neither an argument "
                                "of this contract nor in its signature"))
            for name, arg in case.args.items():
                for field in ("same_dtype_as", "same_shape_as"):
                    partner = getattr(arg, field)
                    if partner is not None and partner not in known | set(case.args):
                        out.append((f"cases.{i}.args.{name}.{field}",
                                    f"names {partner!r}, which is not an argument"))
        if out:
            raise _FieldProblems(out)
        return self


def _label(op: Any) -> str | None:
    """How a message names a contract: its op, when that is a usable string."""
    if isinstance(op, str) and op.strip():
        return op if len(op) <= 80 else op[:77] + "..."
    return None


def _name_problems(data: Mapping[str, Any]) -> list[FileProblem]:
    """Argument names that no generated checker can take as parameters (keywords, non-
    identifiers, the reserved prefix), and repeats in ``signature``; checked on the raw data
    too, so they are listed along with the type errors pydantic finds."""
    out: list[FileProblem] = []
    args = data.get("args")
    if isinstance(args, Mapping):
        for name in args:
            why = _name_problem(name)
            if why:
                out.append(FileProblem(why, field=f"args.{name}"))
    sig = data.get("signature")
    if isinstance(sig, (list, tuple)):
        seen: set[str] = set()
        for i, name in enumerate(sig):
            if not isinstance(name, str):
                continue  # pydantic reports it ("Input should be a valid string")
            why = _name_problem(name, "parameter name")
            if why is None and name in seen:
                why = f"names {name!r} twice"
            if why:
                out.append(FileProblem(why, field=f"signature[{i}]"))
            seen.add(name)
    return out


def _unique(problems: Sequence[FileProblem]) -> list[FileProblem]:
    return list(dict.fromkeys(problems))


_NESTED: dict[tuple[type[BaseModel], str], tuple[type[BaseModel], bool]] = {
    (Contract, "args"): (Arg, True),
    (Contract, "when"): (When, False),
    (Arg, "values"): (ValueRule, False),
    (Arg, "dims"): (DimBound, True),
}


def _known_fields(model: type[BaseModel]) -> list[str]:
    return sorted((f.alias or n) for n, f in model.model_fields.items() if f.repr)


def _unknown_field(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] | None = root
    parts, i = loc[:-1], 0
    while model is not None and i < len(parts):
        nxt = _NESTED.get((model, str(parts[i])))
        if nxt is None:
            model = None
            break
        model, keyed = nxt
        i += 2 if keyed else 1
    if model is None or not loc:
        return "unknown field"
    known = _known_fields(model)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown field{hint} ({model.__name__} fields: {', '.join(known)})"


def _problems(exc: ValidationError, root: type[BaseModel], *, file: str | None = None,
              contract: str | None = None, obj: str | None = None) -> list[FileProblem]:
    """Every error of a pydantic ``ValidationError`` as a ``FileProblem`` at its field."""
    out: list[FileProblem] = []
    for err in exc.errors(include_url=False):
        loc = _user_loc(err.get("loc", ()))
        ctx_err = (err.get("ctx") or {}).get("error")
        # problems found below this location: by a validator that names sub-fields, or by a
        # nested model's own __init__ (pydantic calls a custom __init__ for nested tables)
        subs: list[FileProblem] | None = None
        if isinstance(ctx_err, _FieldProblems):
            subs = [FileProblem(msg, field=sub) for sub, msg in ctx_err.problems]
        elif isinstance(ctx_err, ContractFileError):
            subs = list(ctx_err.problems)
        if subs is not None:
            for q in subs:
                field = ".".join(x for x in (_loc(loc), q.field) if x) or None
                out.append(FileProblem(q.message, file or q.file, contract or q.contract,
                                       field, obj))
            continue
        kind = err.get("type")
        msg = _clean(str(err.get("msg", "")))
        if kind == "extra_forbidden":
            msg = _unknown_field(root, loc)
        elif kind == "missing":
            msg = "missing required field"
            if loc == ("args",):
                msg += " (add [contract.args.NAME] tables)"
        elif kind not in ("value_error", "assertion_error"):
            msg = f"{msg}, got {_show(err.get('input'))}"
        out.append(FileProblem(msg, file, contract, _loc(loc) or None, obj))
    return _unique(out)


_PYDANTIC_STEP = re.compile(r"^[a-z-]+\[")  # 'function-after[_relations(), Contract]'


def _user_loc(loc: Sequence[Any]) -> tuple[Any, ...]:
    """A pydantic location without pydantic's own steps (validator and union names)."""
    return tuple(p for p in loc if not (isinstance(p, str) and _PYDANTIC_STEP.match(p)))


def _loc(loc: Sequence[Any]) -> str:
    """``("args", "a", "dtype")`` -> ``args.a.dtype``; list indices as ``signature[1]``."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + str(p)
    return out


def _clean(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _contract_from_table(table: Any, file: str, index: int) -> tuple[Contract | None,
                                                                     list[FileProblem]]:
    """The contract of one ``[[contract]]`` table, or every problem found in it."""
    if not isinstance(table, Mapping):
        return None, [FileProblem(f"each [[contract]] entry must be a table, got {_show(table)}",
                                  file, f"#{index}")]
    label = _label(table.get("op")) or f"#{index}"
    try:  # (pydantic calls Contract.__init__, which adds the argument-name problems)
        contract = Contract.model_validate({**table, "file": file})
    except ContractFileError as exc:
        return None, [q._replace(file=file, contract=label, obj=None) for q in exc.problems]
    except RecursionError:
        return None, [FileProblem("values nested too deeply", file, label)]
    except Exception as exc:  # noqa: BLE001 - a user's file never kills a job; say it is ours
        return None, [FileProblem(f"could not be validated ({type(exc).__name__}: {exc}); this is "
                                  "a bug in opcontracts, please report it", file, label)]
    return contract, []


def contracts_from_toml(text: str, file: str = "<string>") -> list[Contract]:
    """Parse TOML text holding ``[[contract]]`` tables; one ``ContractFileError`` lists every
    problem of the text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContractFileError(f"invalid TOML: {exc}", file=file) from None
    except RecursionError:  # tomllib's parser recurses on nested arrays and inline tables
        raise ContractFileError("invalid TOML: arrays or tables nested too deeply", file=file) from None
    except Exception as exc:  # noqa: BLE001 - whatever the parser raises, the file is at fault
        raise ContractFileError(f"invalid TOML ({type(exc).__name__}: {exc})", file=file) from None
    problems: list[FileProblem] = []
    unknown = [k for k in data if k != "contract"]
    if unknown:
        problems.append(FileProblem(f"unknown top-level key(s) {unknown}; expected [[contract]] "
                                    "tables", file, field=unknown[0]))
    tables = data.get("contract", [])
    if not isinstance(tables, list):
        problems.append(FileProblem("'contract' must be an array of tables ([[contract]]), got "
                                    f"{_show(tables)}", file, field="contract"))
        tables = []
    out: list[Contract] = []
    for i, t in enumerate(tables):
        c, found = _contract_from_table(t, file, i)
        problems.extend(found)
        if c is not None:
            out.append(c)
    if problems:
        raise ContractFileError.of(problems)
    return out


def contract_files(path: str | os.PathLike[str]) -> list[Path]:
    """The contract files at ``path``: the file itself, or every ``*.toml`` under a folder
    (sorted).  ``ContractFileError`` when there is nothing there."""
    p = Path(path)
    try:
        if p.is_dir():
            return sorted(f for f in p.rglob("*.toml"))
    except OSError as exc:
        raise ContractFileError(f"cannot list the folder: {exc}", file=str(p)) from None
    if not p.exists():
        raise ContractFileError("no such file or folder", file=str(p))
    return [p]


def _load_file(p: Path) -> list[Contract]:
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ContractFileError(f"cannot read: {exc}", file=str(p)) from None
    return contracts_from_toml(text, file=str(p))


def load_contracts(path: str | os.PathLike[str]) -> list[Contract]:
    """Load contracts from a TOML file or from every ``*.toml`` under a folder (sorted).

    Raises one ``ContractFileError`` listing every problem of every file (each names its
    file, contract and field).  ``opcontracts.use(path)`` also registers them.
    """
    out: list[Contract] = []
    problems: list[FileProblem] = []
    for f in contract_files(path):
        try:
            out.extend(_load_file(f))
        except ContractFileError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ContractFileError.of(problems)
    return out
