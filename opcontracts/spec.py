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

Every error names the file, the contract and the field.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._dtypes import dtype_name, parse_dtype
from ._shapes import parse_shape
from .errors import ContractFileError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Arg", "Contract", "When", "ValueRule", "DimBound", "load_contracts",
           "contracts_from_toml"]

_Bound = int | str  # an integer or a shape expression over bound names ("N*K", "E")


def _check_bound(v: Any) -> Any:
    if v is None or isinstance(v, bool):
        if isinstance(v, bool):
            raise ValueError("expected an integer or a shape expression, got a boolean")
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        spec = parse_shape(v)
        if len(spec.dims) != 1 or spec.dims[0].kind in ("any", "ellipsis"):
            raise ValueError(f"expected one integer or expression such as 'N*K', got {v!r}")
        return v
    raise ValueError(f"expected an integer or a shape expression, got {v!r}")


class _Frozen(BaseModel):
    # defer_build: the validators are built on first use, not at import (import time matters:
    # `import opcontracts.patch` sits at the top of training scripts)
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True,
                              arbitrary_types_allowed=True, defer_build=True)


class ValueRule(_Frozen):
    """Checks that read tensor values; they run only when value checks are enabled."""

    permutation: bool = False
    """the values are a permutation of ``[0, numel)`` (no duplicates, none out of range)"""
    nonnegative: bool = False
    nondecreasing: bool = False
    increasing: bool = False
    lt: _Bound | None = None
    """every value is below this bound (an integer or an expression such as ``E``)"""
    last: _Bound | None = None
    """the last value equals this"""
    sum: _Bound | None = None
    """the values sum to this"""
    finite: bool = False

    _v = field_validator("lt", "last", "sum", mode="before")(_check_bound)


class DimBound(_Frozen):
    """Limits on one named size of a shape (``dims = {K = {le = 512}}``): kernels document
    such limits (topK <= 512, head dim < 896) and fail or misbehave beyond them."""

    ge: int | None = None
    le: int | None = None
    lt: int | None = None

    @model_validator(mode="after")
    def _some(self) -> DimBound:
        if (self.ge, self.le, self.lt) == (None, None, None):
            raise ValueError("give at least one of ge, le, lt")
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
    same_dtype_as: str | None = None
    same_dtype_except: dict[str, tuple[str, ...]] | None = None
    """with ``same_dtype_as``: extra dtypes allowed for a given partner dtype ({bf16 = ["fp32"]})"""
    same_shape_as: str | None = None
    optional: bool = False
    """``None`` (or leaving the argument out) is allowed"""
    fix: Literal["cast", "never"] | None = None
    """``fix`` mode: floats are cast by default; ``cast`` also allows integer narrowing when the
    values fit; ``never`` forbids repairs"""
    contiguous: bool = False
    tensor_list: bool = Field(default=False, alias="list")
    """the argument is a list/tuple of tensors; rules apply to every element"""
    max_len: int | None = None
    ge: _Bound | None = None
    le: _Bound | None = None
    lt: _Bound | None = None
    allowed: tuple[Any, ...] | None = None
    """for non-tensor arguments: the values that are supported"""
    values: ValueRule | None = None
    dims: dict[str, DimBound] | None = None
    """bounds on sizes named in this argument's shape: ``dims = {K = {le = 512}}``"""
    numel_lt: int | None = None
    """the tensor has fewer than this many elements (kernels index with 24- or 32-bit ints)"""
    int_list: bool = False
    """a list or tuple of ints is accepted too, checked as a 1-D int64 tensor (MindSpeed's gmm
    takes ``group_list`` either way)"""
    source: str | None = None
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
        super().__init__(**data)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtypes(cls, v: Any) -> Any:
        if v is None:
            return v
        items = [v] if isinstance(v, str) or not isinstance(v, Iterable) else list(v)
        if not items:
            raise ValueError("dtype list is empty")
        return tuple(dtype_name(parse_dtype(x)) for x in items)

    @field_validator("same_dtype_except", mode="before")
    @classmethod
    def _except(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, Mapping):
            raise ValueError("expected a table such as {bf16 = ['fp32']}")
        out = {}
        for k, vals in v.items():
            vals = [vals] if isinstance(vals, str) else list(vals)
            out[dtype_name(parse_dtype(k))] = tuple(dtype_name(parse_dtype(x)) for x in vals)
        return out

    @field_validator("shape", mode="before")
    @classmethod
    def _shapes(cls, v: Any) -> Any:
        if v is None:
            return v
        items = [v] if isinstance(v, str) else list(v)
        if not items:
            raise ValueError("shape list is empty")
        ranks = set()
        for s in items:
            spec = parse_shape(s)
            key = ("...", spec.fixed_rank) if spec.has_ellipsis else spec.fixed_rank
            if key in ranks:
                raise ValueError(f"shape alternatives must differ in rank, {s!r} repeats one")
            ranks.add(key)
        if len(items) > 1 and any(parse_shape(s).has_ellipsis for s in items):
            raise ValueError("shape alternatives cannot use '...'")
        return tuple(items)

    @field_validator("rank", mode="before")
    @classmethod
    def _rank(cls, v: Any) -> Any:
        if v is None:
            return v
        items = [v] if isinstance(v, int) else list(v)
        for r in items:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(f"rank must be a non-negative integer, got {r!r}")
        return tuple(items)

    _b = field_validator("ge", "le", "lt", mode="before")(_check_bound)

    @model_validator(mode="after")
    def _dims_named(self) -> Arg:
        if self.dims:
            named = {n for s in (self.shape or ()) for n in parse_shape(s).names}
            missing = [n for n in self.dims if n not in named]
            if missing:
                raise ValueError(f"dims names {missing}, which the shape of this argument "
                                 "does not mention")
        return self

    @property
    def torch_dtypes(self) -> tuple[Any, ...] | None:
        return None if self.dtype is None else tuple(parse_dtype(d) for d in self.dtype)

    @property
    def is_tensor(self) -> bool:
        """Arguments are tensors (or tensor lists) unless they carry only scalar rules
        (``allowed``, ``ge``, ``le``, ``lt``)."""
        return self.allowed is None and self.ge is None and self.le is None and self.lt is None


class When(_Frozen):
    """Version conditions: packaging specifiers (``">=2.13"``) and chip names."""

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

        try:
            SpecifierSet(str(v))
        except InvalidSpecifier:
            raise ValueError(f"not a version specifier: {v!r} (try '>=8.0.0')") from None
        return str(v)

    @field_validator("soc", mode="before")
    @classmethod
    def _soc(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v


class Contract(_Frozen):
    """One operator's contract.

    ``Contract("my_op", {"x": Arg("bf16", "N H")}, targets=["pkg.mod.my_op"])``
    """

    op: str
    args: dict[str, Arg]
    targets: tuple[str, ...] = ()
    source: str | None = None
    when: When | None = None
    doc: str | None = None
    signature: tuple[str, ...] | None = None
    """parameter names in call order when the target's signature cannot be read"""
    same_device: bool = False
    """check that every tensor argument is on the same device (``get_device()``, ~45 ns per
    tensor: opt-in, since most kernels' own dispatch already rejects mixed devices)"""
    file: str | None = Field(default=None, repr=False)

    def __init__(self, op: Any = None, args: Any = None, /, **data: Any) -> None:
        if op is not None:
            data["op"] = op
        if args is not None:
            data["args"] = args
        super().__init__(**data)

    @field_validator("op")
    @classmethod
    def _op(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("op must be a non-empty name")
        return v

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else list(v or ())
        for t in items:
            if not isinstance(t, str) or "." not in t or any(not p.isidentifier() for p in t.split(".")):
                raise ValueError(f"target must be a dotted path such as 'torch_npu.npu_swiglu', got {t!r}")
        return tuple(items)

    @model_validator(mode="after")
    def _relations(self) -> Contract:
        for name, arg in self.args.items():
            for field in ("same_dtype_as", "same_shape_as"):
                partner = getattr(arg, field)
                if partner is not None and partner not in self.args:
                    raise ValueError(
                        f"args.{name}.{field} names {partner!r}, which is not an argument of this contract"
                    )
        if self.signature is not None:
            missing = [a for a in self.args if a not in self.signature]
            if missing:
                raise ValueError(f"signature lacks the arguments {missing}")
        return self


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if p not in ("function-after[_relations(), Contract]",))


def _clean(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _contract_from_table(table: Any, file: str, index: int) -> Contract:
    if not isinstance(table, Mapping):
        raise ContractFileError("each [[contract]] entry must be a table", file=file,
                                contract=f"#{index}")
    label = str(table.get("op") or f"#{index}")
    if "op" not in table:
        raise ContractFileError("missing required field", file=file, contract=label, field="op")
    if "args" not in table:
        raise ContractFileError("missing required field (add [contract.args.NAME] tables)",
                                file=file, contract=label, field="args")
    try:
        return Contract.model_validate({**table, "file": file})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = _loc(tuple(err.get("loc", ()))) or None
        msg = _clean(err.get("msg", str(exc)))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        more = len(exc.errors()) - 1
        if more:
            msg += f" (and {more} more problem{'s' if more > 1 else ''})"
        raise ContractFileError(msg, file=file, contract=label, field=field) from None
    except ValueError as exc:  # from our own validators outside pydantic's wrapping
        raise ContractFileError(str(exc), file=file, contract=label) from None


def contracts_from_toml(text: str, file: str = "<string>") -> list[Contract]:
    """Parse TOML text holding ``[[contract]]`` tables."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContractFileError(f"invalid TOML: {exc}", file=file) from None
    unknown = [k for k in data if k != "contract"]
    if unknown:
        raise ContractFileError(f"unknown top-level key(s) {unknown}; expected [[contract]] tables",
                                file=file, field=unknown[0])
    tables = data.get("contract", [])
    if not isinstance(tables, list):
        raise ContractFileError("'contract' must be an array of tables ([[contract]])", file=file,
                                field="contract")
    return [_contract_from_table(t, file, i) for i, t in enumerate(tables)]


def load_contracts(path: str | os.PathLike[str]) -> list[Contract]:
    """Load contracts from a TOML file or from every ``*.toml`` under a folder (sorted)."""
    p = Path(path)
    if p.is_dir():
        out: list[Contract] = []
        for f in sorted(p.rglob("*.toml")):
            out.extend(load_contracts(f))
        return out
    if not p.exists():
        raise ContractFileError("no such file or folder", file=str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ContractFileError(f"cannot read: {exc}", file=str(p)) from None
    return contracts_from_toml(text, file=str(p))
