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
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Key", "call_within", "outer"]

Key = tuple[str, "str | None", str, str, str]  # a report record's key

class _State(threading.local):
    """Per thread: the stack of violating calls running, and the one whose backward is."""

    def __init__(self) -> None:
        self.stack: list[Key] = []
        self.bwd: tuple[Key, int, int] | None = None  # (record, node, backward pass)


_tls = _State()


def outer() -> Key | None:
    """The record of the violating call this one runs inside (forward or its backward)."""
    st = _tls.stack
    if st:
        return st[-1]
    bwd = _tls.bwd
    if bwd is None:
        return None
    if bwd[2] != torch._C._current_graph_task_id():
        # set by a backward pass that is over: one that raised inside the node never ran its
        # post-hook, and a later, unrelated violation must not be attached to that record
        _tls.bwd = None
        return None
    return bwd[0]


def _nodes(out: Any) -> list[Any]:
    """The distinct ``grad_fn`` nodes of the tensors ``out`` holds (none: a plain list)."""
    items = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) \
        else ()
    nodes: list[Any] = []
    for t in items:
        node = t.grad_fn if isinstance(t, torch.Tensor) else None
        if node is not None and all(node is not n for n in nodes):
            nodes.append(node)
    return nodes


def _hook_backward(nodes: list[Any], key: Key) -> None:
    for node in nodes:
        node_id = id(node)

        def pre(grad_outputs: Any, node_id: int = node_id) -> None:
            _tls.bwd = (key, node_id, torch._C._current_graph_task_id())

        def post(grad_inputs: Any, grad_outputs: Any, node_id: int = node_id) -> None:
            cur = _tls.bwd
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
    st = _tls.stack
    st.append(key)
    try:
        out = fn(*args, **kwargs)
    finally:
        st.pop()
    if out is not None and torch.is_grad_enabled():
        nodes = _nodes(out)
        if nodes:  # only outputs in an autograd graph get hooks
            _hook_backward(nodes, key)
    return out
