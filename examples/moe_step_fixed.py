"""The step of ``moe_step.py`` with the incident's one-line fix.

MindSpeed's fused unpermute takes bf16 probs only, so cast them at the call:

    python examples/moe_step_fixed.py                         # finite gradients: exit 0
    opcontracts run --mode strict examples/moe_step_fixed.py  # no violation
"""

from __future__ import annotations

import sys

import torch
from moe_step import MoE, main, npu_moe_token_unpermute  # examples/moe_step.py


class FixedMoE(MoE):
    def unpermute(self, out: torch.Tensor, sorted_indices: torch.Tensor,
                  probs: torch.Tensor) -> torch.Tensor:
        probs = probs.to(torch.bfloat16)  # the fix
        return npu_moe_token_unpermute(out, sorted_indices, probs)


if __name__ == "__main__":
    sys.exit(main(FixedMoE))
