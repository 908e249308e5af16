"""The guarded op the observer benchmarks share: ``x * w`` in a module of its own, patched
with a small contract, and the inputs and the three-call chain they time."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch


@dataclass
class GuardedScale:
    mod: types.ModuleType
    x: torch.Tensor
    w: torch.Tensor
    xg: torch.Tensor
    wg: torch.Tensor

    def chain(self) -> None:
        """Three guarded calls with grad, then backward."""
        s = self.mod.scale
        y = s(s(s(self.xg, self.wg), self.wg), self.wg)
        y.sum().backward()

    def close(self) -> None:
        del sys.modules[self.mod.__name__]


def guarded_scale(module_name: str) -> GuardedScale:
    """Create ``module_name.scale`` and guard it with ``opcontracts.patch``."""
    import opcontracts.patch as patch
    from opcontracts import Arg, Contract

    mod = types.ModuleType(module_name)

    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[module_name] = mod
    patch.apply([Contract("bench.scale", {"x": Arg("fp32", "N H"),
                                          "w": Arg(same_dtype_as="x", shape="H")},
                          targets=[f"{module_name}.scale"], source="benchmark")])
    x, w = torch.randn(64, 64), torch.randn(64)
    return GuardedScale(mod, x, w, x.clone().requires_grad_(), w.clone().requires_grad_())


__all__ = ["GuardedScale", "guarded_scale"]
