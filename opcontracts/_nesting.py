"""Which violating guarded call is running, so that violations inside it count as one bug.

A user's wrong call of a guarded MindSpeed op reaches the guarded torch_npu op its kernel calls,
and, in backward, the guarded ``*_grad`` op its autograd runs: three guards see the same wrong
argument.  The user made one mistake at one line, so the report keeps one record for that line
and attaches the others to it (``Record.nested``) instead of counting three violations at three
sites and warning three times.

How the enforcer uses this (only on its slow path, after a violation in ``warn`` or ``fix``
mode, when the kernel is called anyway):

* ``call_within(key, fn, args, kwargs)`` runs the kernel with ``key`` (the outer record's) on a
  thread-local stack, so guards called inside see it as their ``outer()``;
* if the kernel's outputs are part of an autograd graph, their ``grad_fn`` nodes get a pre-hook
  that makes ``key`` the outer record while that node's backward runs (on whatever thread the
  autograd engine runs it: the hook and the node run on the same one), and a post-hook that
  clears it again.  The hooks die with the graph.

A conforming call never comes here: the hot path of a guard is untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Key", "call_within", "outer"]

Key = tuple[str, "str | None", str, str, str]  # a report record's key

_tls = threading.local()


def outer() -> Key | None:
    """The record of the violating call this one runs inside (forward or its backward)."""
    st = getattr(_tls, "stack", None)
    if st:
        return st[-1]  # type: ignore[no-any-return]
    bwd = getattr(_tls, "bwd", None)
    return bwd[0] if bwd is not None else None


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o


def _hook_backward(out: Any, key: Key) -> None:
    seen: set[int] = set()
    for t in _tensors(out):
        node = t.grad_fn
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        node_id = id(node)

        def pre(grad_outputs: Any, node_id: int = node_id) -> None:
            _tls.bwd = (key, node_id)

        def post(grad_inputs: Any, grad_outputs: Any, node_id: int = node_id) -> None:
            cur = getattr(_tls, "bwd", None)
            if cur is not None and cur[1] == node_id:
                _tls.bwd = None

        try:
            node.register_prehook(pre)
            node.register_hook(post)
        except (RuntimeError, AttributeError):  # a node that takes no hooks: forward only
            pass


def call_within(key: Key | None, fn: Callable[..., Any], args: tuple[Any, ...] | list[Any],
                kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` with ``key`` as the outer record for the guards it reaches, in
    forward and in the backward of what it returns."""
    if key is None:
        return fn(*args, **kwargs)
    st = getattr(_tls, "stack", None)
    if st is None:
        st = _tls.stack = []
    st.append(key)
    try:
        out = fn(*args, **kwargs)
    finally:
        st.pop()
    if torch.is_grad_enabled():
        _hook_backward(out, key)
    return out
