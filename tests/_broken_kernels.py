"""Kernels that go wrong on purpose, shared by the sentinel's tests."""

from __future__ import annotations

from typing import Any

import torch


class NanGrad(torch.autograd.Function):
    """Finite forward (2x), NaN gradient: a kernel whose backward is broken."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * float("nan")
