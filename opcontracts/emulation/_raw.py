"""What a dtype-blind kernel reads: an argument's bytes reinterpreted as the dtype it assumes.

This is the behaviour the project exists to catch: torch_npu hands a wrongly typed tensor
straight to the CANN kernel, which reads the memory as its compiled-in dtype. Nothing raises
and nothing warns; the numbers are garbage (or NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _profiles

__all__ = ["fake_view", "kernel_view", "reinterpret"]


def reinterpret(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s contiguous bytes read as ``dtype``: the first ``t.numel()`` elements, in ``t``'s shape.

    A buffer too short for that is padded with zero bytes (a kernel reading past the end of a
    buffer reads whatever lies there; zeros keep the emulation deterministic). The result never
    aliases ``t``.
    """
    if t.dtype == dtype:
        return t
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    need = t.numel() * dtype.itemsize
    if raw.numel() < need:
        raw = torch.cat([raw, raw.new_zeros(need - raw.numel())])
    raw = raw[:need].clone()  # a fresh, aligned buffer
    out = raw != 0 if dtype == torch.bool else raw.view(dtype)
    return out.view(t.shape)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def kernel_view(kernel: str, arg: str, value: Any) -> Any:
    """``value`` as ``kernel`` reads it under the active profile (tensors and tensor lists)."""
    profile = _profiles.active()
    supported = profile.supported(kernel, arg) if profile is not None else None
    if not supported:
        return value

    def read(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype in supported else reinterpret(t, supported[0])

    return _map_tensors(value, read)


def fake_view(kernel: str, arg: str, value: Any) -> Any:
    """The fake-tensor counterpart of :func:`kernel_view`: same shapes, the assumed dtype.

    The fake implementations derive output dtypes from their inputs, so handing them inputs
    in the dtype the kernel assumes keeps ``torch.compile``'s view of the outputs identical to
    what the kernel really produces.
    """
    profile = _profiles.active()
    supported = profile.supported(kernel, arg) if profile is not None else None
    if not supported:
        return value

    def read(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype in supported else t.new_empty(t.shape, dtype=supported[0])

    return _map_tensors(value, read)
