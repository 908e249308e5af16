"""Autograd-only public ops: torch_npu's ``AutogradPrivateUse1`` kernels, emulated.

From torch_npu 2.7.1.post11 / 2.9.0.post9 / 2.12.0.post3 / 2.13 / 2.14 the public
``npu_moe_token_unpermute`` has no backend kernel and no autograd node of its own: the yaml
registers it for ``AutogradPrivateUse1`` only, and that kernel calls
``npu::_npu_moe_token_unpermute`` through the dispatcher.  The internal op carries the
derivative (``libtorch_npu.so`` has ``VariableType::_npu_moe_token_unpermute`` and no
``VariableType::npu_moe_token_unpermute``; ``Functions.h``: ``NpuMoeTokenUnpermuteBackward0``
saves the internal op's ``permuted_tokens_for_backward``), so a dispatch mode below autograd
sees ``_npu_moe_token_unpermute``, never the public name.  On our CPU emulation the public
kernel sits at ``Autograd`` (the key CPU tensors hit); the internal op has the usual emulated
kernels (``_ops``).

Below autograd (``torch.inference_mode()``) the emulation runs the internal op and returns its
first output: what the real op does there is not known from the wheels (no backend kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["autograd_only"]


def autograd_only(internal: torch._ops.OpOverload, first: bool = True
                  ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The ``Autograd`` kernel of a public op that only calls ``internal`` (captured once) and
    its kernel below autograd; with ``first``, the public op returns the internal's first
    output."""

    def public(*args: Any, **kwargs: Any) -> Any:
        out = internal(*args, **kwargs)
        return out[0] if first else out

    def autograd_kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        return public(*args, **kwargs)

    return autograd_kernel, public
