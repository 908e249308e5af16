"""An Autograd-key kernel for dispatcher ops, with keyword-only and list-of-Tensor inputs.

``torch.library.register_autograd`` refuses ops with keyword-only Tensor arguments, and the
real NPU schemas have them (``bias``/``group_list`` of ``npu_grouped_matmul``, ``probs`` of the
routing-map ops). This module does what ``register_autograd`` does internally (an
``autograd.Function`` that redispatches below Autograd), but flattens *every* argument with
pytree so tensors anywhere in the call are differentiable.

A backward formula is a plain function ``backward(inputs, outputs, grads) -> {name: grad}``:
``inputs`` maps every schema argument name to its value, ``outputs`` and ``grads`` have the
op's output structure. Names it leaves out get no gradient.

What the node keeps for backward is what torch_npu's generated node keeps (``saves``: the
release's ``Functions.h``, one ``SavedVariable`` per saved argument or output, read into the
wheel digest): only those tensors are saved (through ``save_for_backward``, so saved-tensor
hooks see exactly them); every other tensor argument or output reaches the formula as a meta
tensor of the same shape and dtype (what a node keeps as ``sym_argsize`` / ``scalar_type``),
which holds no memory.  Without a node (``saves`` None) every tensor input and output is saved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["BackwardFn", "make_autograd_kernel"]

BackwardFn = Callable[[dict[str, Any], Any, Any], dict[str, Any]]


def _shape_only(t: torch.Tensor) -> torch.Tensor:
    """A tensor's shape and dtype, no data (what a node keeps of a tensor it does not save)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@dataclass
class _CallInfo:
    keyset: Any
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec | None = None
    leaf_names: list[str] | None = None  # the argument each input leaf belongs to (``saves``)


def make_autograd_kernel(op: torch._ops.OpOverload, backward: BackwardFn,
                         saves: Iterable[str | int] | None = None) -> Callable[..., Any]:
    """A kernel for ``lib.impl(name, kernel, "Autograd", with_keyset=True)``; ``saves``: the
    argument names and output indices the node keeps (None: every tensor)."""
    schema = op._schema
    names = [a.name for a in schema.arguments]
    kwarg_only = [a.kwarg_only for a in schema.arguments]
    after_autograd = torch._C._after_autograd_keyset
    keeps = None if saves is None else frozenset(saves)

    def redispatch(keyset: Any, values: list[Any]) -> Any:
        args = [v for v, kw in zip(values, kwarg_only, strict=True) if not kw]
        kwargs = {n: v for n, v, kw in zip(names, values, kwarg_only, strict=True) if kw}
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & after_autograd, *args, **kwargs)

    class Generated(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, info: _CallInfo, *flat: Any) -> Any:
            values = pytree.tree_unflatten(list(flat), info.in_spec)
            out = redispatch(info.keyset, values)
            flat_out, info.out_spec = pytree.tree_flatten(out)
            in_pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
            out_pos = [i for i, v in enumerate(flat_out) if isinstance(v, torch.Tensor)]
            ctx.in_plain = [None if isinstance(v, torch.Tensor) else v for v in flat]
            ctx.out_plain = [None if isinstance(v, torch.Tensor) else v for v in flat_out]
            if keeps is not None:  # the node's: the rest by shape and dtype only
                assert info.leaf_names is not None
                kept_in = [i for i in in_pos if info.leaf_names[i] in keeps]
                kept_out = [i for i in out_pos if i in keeps]
                for i in set(in_pos) - set(kept_in):
                    ctx.in_plain[i] = _shape_only(flat[i])
                for i in set(out_pos) - set(kept_out):
                    ctx.out_plain[i] = _shape_only(flat_out[i])
                in_pos, out_pos = kept_in, kept_out
            ctx.save_for_backward(*(flat[i] for i in in_pos), *(flat_out[i] for i in out_pos))
            ctx.info = info
            ctx.in_pos, ctx.out_pos = in_pos, out_pos
            return tuple(flat_out)

        @staticmethod
        def backward(ctx: Any, *flat_grads: Any) -> Any:
            info: _CallInfo = ctx.info
            saved = ctx.saved_tensors
            flat_in, flat_out = list(ctx.in_plain), list(ctx.out_plain)
            for i, t in zip(ctx.in_pos, saved[: len(ctx.in_pos)], strict=True):
                flat_in[i] = t
            for i, t in zip(ctx.out_pos, saved[len(ctx.in_pos) :], strict=True):
                flat_out[i] = t
            assert info.out_spec is not None
            values = pytree.tree_unflatten(flat_in, info.in_spec)
            outputs = pytree.tree_unflatten(flat_out, info.out_spec)
            grads = pytree.tree_unflatten(list(flat_grads), info.out_spec)
            result = backward(dict(zip(names, values, strict=True)), outputs, grads)
            flat_grads_in: list[Any] = []
            for name, value in zip(names, values, strict=True):
                n_leaves = len(pytree.tree_leaves(value))
                grad = result.get(name)
                if grad is None:
                    flat_grads_in.extend([None] * n_leaves)
                elif isinstance(grad, (list, tuple)):
                    flat_grads_in.extend(grad)
                else:
                    flat_grads_in.append(grad)
            return (None, *flat_grads_in)

    Generated.__name__ = f"NpuEmulated_{op._opname}"

    def autograd_kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = torch._library.utils.fill_defaults(schema, args, kwargs)
        positional = iter(args)
        values = [kwargs[n] if kw else next(positional) for n, kw in zip(names, kwarg_only, strict=True)]
        flat, spec = pytree.tree_flatten(values)
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in flat
        )
        if not needs_grad:
            return redispatch(keyset, values)
        info = _CallInfo(keyset=keyset, in_spec=spec)
        if keeps is not None:
            info.leaf_names = [n for n, v in zip(names, values, strict=True)
                               for _ in pytree.tree_leaves(v)]
        flat_out = Generated.apply(info, *flat)
        assert info.out_spec is not None
        return pytree.tree_unflatten(list(flat_out), info.out_spec)

    return autograd_kernel
