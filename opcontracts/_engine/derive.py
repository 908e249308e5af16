"""Contracts taken from another op's: one kernel reached by several op names.

torch_npu reaches some kernels by more than one op: from 2.13 the public
``npu_moe_token_unpermute`` is an autograd-only kernel calling ``_npu_moe_token_unpermute``,
whose backward calls ``npu_moe_token_unpermute_grad_v2`` where 2.12.0 called
``npu_moe_token_unpermute_grad`` (same aclnn kernels).  A contract with ``rules_of = "X"``
takes every contract of ``X`` instead of copying its rules, so the rules of one kernel live in
one place and follow it when they change (per CANN, per release):

* per contract of ``X``: its ``when`` intersected with this contract's (which names the
  releases that have the op), its arguments kept where this contract's ``signature`` lists
  them (a ``_grad_v2`` op takes row counts and dtypes instead of some tensors), every field
  this contract's ``args`` sets overriding the taken one (``optional = true`` for an argument
  that became optional), partner rules (``same_dtype_as``) naming a dropped argument dropped;
  an argument with ``dtype_of = "t"`` (a dtype passed as a value, as the ``_grad_v2`` ops take
  ``permuted_tokens_dtype``) checked against the dtypes the taken contract allows ``t``;
* ``op``, ``targets``, ``source`` (its own, then ``rules of X: X's source``) and ``doc`` are
  this contract's; everything else (``cases`` on kept arguments, ``same_device``, any field a
  later version adds) is ``X``'s.

Chains are not followed (a ``rules_of`` contract of ``X`` is not taken).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..spec import Arg, Contract, When

__all__ = ["derive", "intersect"]

_VERSIONED = ("torch_npu", "cann", "mindspeed", "torch")


def intersect(a: When | None, b: When | None) -> When | None:
    """Both conditions at once (alternatives ``x || y`` of each field combined pairwise)."""
    from ..spec import When

    if a is None or b is None:
        return a if b is None else b
    fields: dict[str, Any] = {}
    for name in _VERSIONED:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            fields[name] = x if y is None else y
        else:
            fields[name] = [f"{p},{q}" for p in x.split(" || ") for q in y.split(" || ")]
    if a.soc is None or b.soc is None:
        fields["soc"] = a.soc if b.soc is None else b.soc
    else:
        fields["soc"] = tuple(s for s in a.soc if s in b.soc)
    return When(**{k: v for k, v in fields.items() if v is not None})


def _kept(arg: Arg, names: set[str]) -> Arg:
    update: dict[str, Any] = {}
    for field in ("same_dtype_as", "same_shape_as"):
        if getattr(arg, field) is not None and getattr(arg, field) not in names:
            update[field] = None
            if field == "same_dtype_as":
                update["same_dtype_except"] = None
    if arg.dtype_if_present and any(k not in names for k in arg.dtype_if_present):
        update["dtype_if_present"] = {k: v for k, v in arg.dtype_if_present.items() if k in names} or None
    return arg.model_copy(update=update) if update else arg


def derive(contract: Contract, sources: Iterable[Contract]) -> list[Contract]:
    """The contracts ``contract`` (with ``rules_of``) takes from ``sources`` (its op's)."""

    out: list[Contract] = []
    for src in sources:
        if src.rules_of:
            continue
        sig = contract.signature or src.signature
        names = set(sig) if sig is not None else set(src.args)
        args = {n: _kept(a, names) for n, a in src.args.items() if n in names}
        for n, a in contract.args.items():
            if a.dtype_of is not None:  # a dtype passed as a value: the named argument's dtypes
                taken = src.args.get(a.dtype_of)
                if taken is None or taken.dtype is None:
                    continue  # this version's rules say nothing of that argument's dtype
                hint = a.hint or (f"this is the dtype of the forward's {a.dtype_of}: cast that "
                                  f"tensor to {taken.dtype[0]} before the forward call")
                args[n] = a.model_copy(update={"dtype": taken.dtype, "dtype_value": True,
                                               "dtype_of": None, "hint": hint,
                                               "source": a.source or taken.source,
                                               "layer": a.layer or taken.layer})
                continue
            base = args.get(n)
            args[n] = a if base is None else base.model_copy(
                update={f: getattr(a, f) for f in a.model_fields_set})
        cases = tuple(
            c.model_copy(update={"args": {n: _kept(a, names) for n, a in c.args.items() if n in names}})
            for c in src.cases if all(k in names for k in c.if_))
        out.append(src.model_copy(update={
            "op": contract.op, "targets": contract.targets, "args": args, "signature": sig,
            "when": intersect(contract.when, src.when), "cases": cases, "rules_of": None,
            "source": join_sources(contract.source, f"rules of {src.op}: {src.source}"),
            "doc": contract.doc or src.doc,
            # a user's replacing contract keeps its file: the registry tells it from the
            # shipped ones by where it comes from, and it stands for them here too
            "file": src.file if src.replace else contract.file,
        }))
    return out


def join_sources(*sources: str | None) -> str | None:
    """Several sources as one text, each named once: a source that lists several (``a + b;
    c``) is split into its parts first, so merging merged contracts never repeats a part."""
    parts: dict[str, None] = {}
    for s in sources:
        for chunk in (s or "").split(";"):
            for p in chunk.split(" + "):
                if p.strip():
                    parts[p.strip()] = None
    return "; ".join(parts) or None
