"""The signature memo: a C++ re-check for calls whose tensors were already found to conform.

A contract's rules (values aside) read only each tensor's type, dtype, shape, device and, for a
``contiguous`` rule, its strides.  A call whose positional tensors carry exactly the metadata of
an earlier conforming call therefore conforms too.  torch ships a C++ check for "these tensors
have exactly this metadata": dynamo's ``TensorGuards``, what a compiled graph uses to decide it
may be reused.  It reads ``at::Tensor`` fields directly, where Python pays a C getter per
``.dtype`` and a fresh ``torch.Size`` per ``.shape``: three tensors cost ~230 ns against ~330 ns
for merely reading their dtypes and shapes in Python (``benchmarks/bench_overhead.py``).

The guard in ``_enforce`` keeps up to ``CAPACITY`` such checks per number of positional
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

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CAPACITY", "available", "learn", "learnable"]

CAPACITY = 8
"""signatures remembered per guard and number of positional arguments"""

Check = Callable[..., bool]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses may override .dtype/.shape in Python
_state: list[bool | None] = [None]


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
        if os.environ.get("OPCONTRACTS_MEMO", "").strip().lower() in ("0", "false", "no", "off"):
            ok = False
        else:
            try:
                ok = _self_test()
            except Exception:  # private API moved: stay on the generated checker
                ok = False
        _state[0] = ok
    return ok


def learnable(args: tuple[Any, ...]) -> bool:
    """Whether ``args`` are all plain dense tensors (what a learnt check can describe)."""
    if not args or not available():
        return False
    for t in args:
        if type(t) not in _PLAIN or t.layout is not torch.strided or t.is_nested:
            return False
    return True


def learn(args: tuple[Any, ...], static_strides: bool) -> Check | None:
    """A C++ check that passes exactly the calls whose positional arguments have the type,
    dtype, sizes, device and autograd state of ``args`` (and their strides when
    ``static_strides``); None when ``args`` are not all plain dense tensors."""
    if not learnable(args):
        return None
    try:
        return _build(args, static_strides)
    except Exception:  # symbolic sizes, exotic devices: not memoised
        return None
