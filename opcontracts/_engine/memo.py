"""The signature memo: a C++ re-check for calls whose tensors were already found to conform.

A contract's rules (values aside) read only each tensor's type, dtype, shape, device and, for a
``contiguous`` rule, its strides.  A call whose positional tensors carry exactly the metadata of
an earlier conforming call therefore conforms too.  torch ships a C++ check for "these tensors
have exactly this metadata": dynamo's ``TensorGuards``, what a compiled graph uses to decide it
may be reused.  It reads ``at::Tensor`` fields directly, where Python pays a C getter per
``.dtype`` and a fresh ``torch.Size`` per ``.shape``: three tensors cost ~230 ns against ~330 ns
for merely reading their dtypes and shapes in Python (``benchmarks/bench_overhead.py``).

The guard in ``_engine.enforce`` keeps up to ``CAPACITY`` such checks per number of positional
arguments, learnt from calls the generated checker passed; a call that matches none of them goes
through the generated checker as before.  A check holds no reference to any tensor (only types,
dtypes, sizes and device indices), and a learnt check is never consulted while value checks are
on for a contract that has value rules.

``TensorGuards`` is private API: ``available()`` builds one and checks that it accepts and
rejects what it must before the memo is used at all.  Any surprise (another torch, a changed
signature) leaves the memo off and the generated checker does all the work.
``OPCONTRACTS_MEMO=0`` turns it off by hand.
"""

from __future__ import annotations

import itertools
import keyword
import linecache
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CAPACITY", "SHAPES", "available", "form", "learn", "learnable"]

CAPACITY = 8
"""signatures remembered per guard and call shape"""
SHAPES = 16
"""call shapes (positional count, keywords in order) learnt per guard"""

Check = Callable[..., bool]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses may override .dtype/.shape in Python
_state: list[bool | None] = [None]


def form(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """A call's form, what a learnt check is kept by: the number of positional arguments, and
    the keywords in order (a check learnt for one form cannot be called with another)."""
    return (len(args), *kwargs) if kwargs else len(args)


def _build(tensors: tuple[Any, ...], static_strides: bool) -> Check:
    from torch._C._dynamo.guards import TensorGuards

    sizes: Any = [list(t.shape) for t in tensors]  # the stub is narrower than the C++ code
    strides: Any = [list(t.stride()) if static_strides else [None] * t.dim() for t in tensors]
    return TensorGuards(*tensors, dynamic_dims_sizes=sizes,  # type: ignore[call-arg]
                        dynamic_dims_strides=strides).check


def _self_test() -> bool:
    a = torch.zeros(2, 3, dtype=torch.bfloat16)
    b = torch.zeros(6, dtype=torch.int32)
    check = _build((a, b), False)
    static = _build((a, b), True)
    return (check(a, b) is True and check(torch.ones(2, 3, dtype=torch.bfloat16), b) is True
            and check(a.float(), b) is False and check(a, b.long()) is False
            and check(torch.zeros(3, 2, dtype=torch.bfloat16), b) is False
            and check(a, b[:5]) is False and check(a.unsqueeze(0), b) is False
            and check(a, None) is False and check(a, 6) is False
            and check(a.t().contiguous().t(), b) is True
            and static(a.t().contiguous().t(), b) is False
            and check(a.requires_grad_(), b) is False)


def available() -> bool:
    """Whether the memo works with this torch (decided once, on first use)."""
    ok = _state[0]
    if ok is None:
        raw = os.environ.get("OPCONTRACTS_MEMO", "").strip().lower()
        if raw not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
            from .._lang.envwarn import warn_setting  # only speed depends on it: a warning

            warn_setting("OPCONTRACTS_MEMO", f"cannot read {raw!r}; expected 0/off (memo off) "
                         "or 1/on; the memo stays on")
        if raw in ("0", "false", "no", "off"):
            ok = False
        else:
            try:
                ok = _self_test()
            except Exception:  # private API moved: stay on the generated checker
                ok = False
        _state[0] = ok
    return ok


_CONSTANTS = (bool, int, float, str)  # compared by exact type and value
_counter = itertools.count()


def _describable(v: Any) -> bool:
    if v is None or type(v) in _CONSTANTS:
        return v == v  # not NaN
    return type(v) in _PLAIN and v.layout is torch.strided and not v.is_nested


def learnable(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether a learnt check can describe this call: every argument a plain dense tensor,
    None, or a bool, int, float or str constant, and at least one tensor."""
    if not available():
        return False
    values = (*args, *kwargs.values()) if kwargs else args
    return (all(_describable(v) for v in values)
            and any(type(v) in _PLAIN for v in values))


def learn(args: tuple[Any, ...], static_strides: bool,
          kwargs: dict[str, Any] | None = None) -> Check | None:
    """A check, called as ``check(*args, **kwargs)``, that passes exactly the calls of this
    shape (the same number of positional arguments, the same keywords in the same order) whose
    tensors have the type, dtype, sizes, device and autograd state of these (and their strides
    when ``static_strides``) and whose other arguments are these constants; None when
    ``learnable`` says no.  For all-tensor positional calls it is the C++ check itself;
    otherwise a small generated function (in ``linecache``) that compares the constants and
    hands the tensors to the C++ check."""
    if not learnable(args, kwargs):
        return None
    kwargs = kwargs or {}
    if not all(k.isidentifier() and not keyword.iskeyword(k) and not k.startswith("_")
               for k in kwargs):
        return None
    try:
        if not kwargs and all(type(a) in _PLAIN for a in args):
            return _build(args, static_strides)
        names = [f"_{i}" for i in range(len(args))] + [f"{k}" for k in kwargs]
        values = [*args, *kwargs.values()]
        tensors = [(n, v) for n, v in zip(names, values) if type(v) in _PLAIN]
        ns: dict[str, Any] = {"_same": _build(tuple(v for _, v in tensors), static_strides)}
        tests = []
        for n, v in zip(names, values):
            if v is None or type(v) is bool:
                tests.append(f"{n} is {v!r}")
            elif type(v) in _CONSTANTS:
                ns[f"_c{n}"] = v
                tests.append(f"type({n}) is {type(v).__name__} and {n} == _c{n}")
        tests.append(f"_same({', '.join(n for n, _ in tensors)})")
        params = ", ".join(names[:len(args)]) + (", *, " + ", ".join(names[len(args):]) if kwargs else "")
        src = f"def same({params}):\n    return {' and '.join(tests)}\n"
        filename = f"<opcontracts memo #{next(_counter)}>"
        exec(compile(src, filename, "exec"), ns)
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        weakref.finalize(ns["same"], linecache.cache.pop, filename, None)  # freed with the memo
        return ns["same"]  # type: ignore[no-any-return]
    except Exception:  # symbolic sizes, exotic devices, a keyword that is no identifier
        return None
