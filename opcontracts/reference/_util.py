"""Helpers shared by the references: index arithmetic that never raises, and the dtype the math
runs in.

Index arguments may hold garbage (a kernel misreading bytes, or a caller's bug); a kernel reading
garbage indices does not raise, so neither do the references: out-of-range indices select zero
rows and their writes are dropped.  Every helper is differentiable in its floating inputs, so
autograd through a reference is its backward.
"""

from __future__ import annotations

import torch

__all__ = ["acc_dtype", "fit", "gather_rows", "safe_index", "scatter_add_rows"]


def acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype the math runs in: fp64 when the first floating tensor given is fp64, else fp32
    (the NPU kernels accumulate fp16/bf16 in fp32).  The compare hands the references up-cast
    copies (fp32 -> fp64), so they compute at the precision they are given."""
    for t in tensors:
        if t is not None and t.is_floating_point():
            return torch.float64 if t.dtype == torch.float64 else torch.float32
    return torch.float32


def safe_index(idx: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``idx`` as int64 clamped into ``[0, size)`` and the mask of the entries that were in range."""
    idx = idx.reshape(-1).long()
    valid = (idx >= 0) & (idx < size)
    return idx.clamp(0, max(size - 1, 0)), valid


def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` with rows of out-of-range indices set to zero (no IndexError)."""
    if src.size(0) == 0:
        return src.new_zeros((idx.numel(), *src.shape[1:]))
    safe, valid = safe_index(idx, src.size(0))
    rows = src.index_select(0, safe)  # a fresh tensor: zeroed in place (no data-dependent branch)
    return rows.masked_fill_(~valid.view(-1, *([1] * (src.dim() - 1))), 0)


def scatter_add_rows(out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor,
                     *, fresh: bool = False) -> torch.Tensor:
    """``out[idx] += rows`` (out of place), dropping rows whose index is out of range.  With
    ``fresh`` (``out`` and ``rows`` are buffers the caller made for this call) both are
    written in place instead of copied."""
    if out.size(0) == 0:
        return out
    safe, valid = safe_index(idx, out.size(0))
    invalid = ~valid.view(-1, *([1] * (rows.dim() - 1)))
    if fresh:
        return out.index_add_(0, safe, rows.masked_fill_(invalid, 0).to(out.dtype))
    return out.index_add(0, safe, rows.masked_fill(invalid, 0).to(out.dtype))


def fit(flat: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of 1-D ``flat``, zero-padded when it is shorter."""
    if flat.numel() >= n:
        return flat[:n]
    return torch.cat([flat, flat.new_zeros(n - flat.numel())])
