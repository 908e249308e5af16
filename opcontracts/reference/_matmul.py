"""Reference of ``npu_grouped_matmul`` (aclnnGroupedMatmulV4, non-quantized), torch_npu 2.13/2.14
``_op_plugin_docs.py``: ``y_i = x_i @ w_i (+ b_i)`` per group, accumulated in fp32 (fp64 for
fp64 inputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._util import acc_dtype, fit

__all__ = ["group_sizes", "grouped_weights", "is_grouped", "npu_grouped_matmul"]


def group_sizes(group_list: torch.Tensor, group_list_type: int | None, n_groups: int) -> list[int]:
    """Rows per group from ``group_list`` (type 0: cumulative ends; type 1: counts)."""
    values = fit(group_list.reshape(-1).long(), n_groups)
    if group_list_type == 1:
        sizes = values
    else:
        sizes = torch.diff(values, prepend=values.new_zeros(1))
    return [max(int(s), 0) for s in sizes.tolist()]


def grouped_weights(weight: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One (K, N) matrix per group: a single 3-D (E, K, N) weight or a list of 2-D ones."""
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))
    return list(weight)


def is_grouped(x: Sequence[torch.Tensor], group_type: int | None) -> bool:
    return group_type is not None and group_type >= 0 and len(x) == 1


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
) -> list[torch.Tensor]:
    """aclnnGroupedMatmulV4, non-quantized: ``y_i = x_i @ w_i (+ b_i)`` per group.

    Two modes. List mode (``group_type`` None/-1, or several x): one matmul per pair.
    Grouped mode (``group_type`` 0, one x of shape (M, K)): rows of x split by
    ``group_list``, group ``g`` multiplied by ``weight[g]`` (a 3-D (E, K, N) weight or a list).
    ``split_item`` 2/3 returns one tensor (concatenated rows; rows past the last group are
    zero), 0/1 one tensor per group. Only group_type 0 (split along M) is covered.
    """
    ws = grouped_weights(weight)
    bs = list(bias) if bias else []
    if is_grouped(x, group_type):
        if group_type != 0:
            raise NotImplementedError("npu_grouped_matmul reference supports group_type 0 only")
        xs = x[0]
        acc = acc_dtype(xs)
        if group_list is None:
            sizes = [xs.size(0)] + [0] * (len(ws) - 1)
        else:
            sizes = group_sizes(group_list, group_list_type, len(ws))
        outs: list[torch.Tensor] = []
        start = 0
        for g, w in enumerate(ws):
            stop = min(start + sizes[g], xs.size(0))
            y = xs[start:stop].to(acc) @ w.to(acc)
            if g < len(bs):
                y = y + bs[g].to(acc)
            outs.append(y.to(xs.dtype))
            start = stop
        if split_item in (2, 3):
            n_out = ws[0].size(-1) if ws else 0
            tail = xs.new_zeros((xs.size(0) - start, n_out))
            return [torch.cat([*outs, tail], 0)]
        return outs
    outs = []
    for i, xi in enumerate(x):
        acc = acc_dtype(xi)
        y = xi.to(acc) @ ws[i].to(acc)
        if i < len(bs):
            y = y + bs[i].to(acc)
        outs.append(y.to(xi.dtype))
    if split_item in (2, 3):
        return [torch.cat(outs, 0)]
    return outs
