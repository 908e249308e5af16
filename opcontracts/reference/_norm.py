"""References of ``npu_rms_norm``, ``npu_swiglu`` and ``npu_rotary_mul`` (torch_npu 2.13/2.14
``_op_plugin_docs.py``), in fp32 (fp64 for fp64 inputs), cast back to the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._util import acc_dtype

__all__ = ["npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "rms_norm_dims", "rotate_transposed",
           "rotated"]


def rms_norm_dims(gamma: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(-gamma.dim(), 0)) if gamma.dim() else (-1,)


def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = x * rstd * gamma``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` over gamma's dims."""
    dims = rms_norm_dims(gamma)
    acc = acc_dtype(self)
    xf = self.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = xf * rstd * gamma.to(acc)
    # rstd is an output for the backward kernel only: torch_npu's derivative ignores a gradient
    # reaching it (npu_rms_norm_backward(grads[0], self, gamma, result1))
    return y.to(self.dtype), rstd.detach()


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(a) * b`` with ``a, b = chunk(x, 2, dim)``: the size of ``dim`` halves."""
    a, b = self.to(acc_dtype(self)).chunk(2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


def rotated(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """rotate_half (``'half'``: [-x2, x1]) or rotate_every_two (``'interleave'``)."""
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    if rotary_mode == "interleave":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([-odd, even], dim=-1).flatten(-2)
    raise NotImplementedError(f"rotary_mode {rotary_mode!r} is not covered")


def rotate_transposed(g: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """The adjoint of :func:`rotated` (used by the backward formula)."""
    if rotary_mode == "half":
        g1, g2 = g.chunk(2, dim=-1)
        return torch.cat([g2, -g1], dim=-1)
    even, odd = g[..., 0::2], g[..., 1::2]
    return torch.stack([odd, -even], dim=-1).flatten(-2)


def npu_rotary_mul(
    self: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x * cos + rotated(x) * sin`` (``r1`` = cos, ``r2`` = sin, broadcast); ``rotate`` unused."""
    acc = acc_dtype(self)
    xf = self.to(acc)
    y = xf * r1.to(acc) + rotated(xf, rotary_mode) * r2.to(acc)
    return y.to(self.dtype)
