"""One MoE training step with the bug of the first-step NaN incident.

The router computes its probs in fp32 (Megatron's ``moe_router_dtype=fp32``) and hands them
to MindSpeed's fused unpermute, whose kernel takes bf16 only.  Nothing rejects the call: the
forward pass is fine and the gradients are NaN.  Without torch_npu, opcontracts' CPU
emulation of the kernels stands in (profile "incident": the NPU's behaviour in the incident).

    python examples/moe_step.py                                   # grads NaN: exit status 1
    opcontracts run --mode strict examples/moe_step.py            # stops at the unpermute call
    opcontracts run --mode fix examples/moe_step.py               # probs cast to bf16: exit 0
    opcontracts run --mode off --nan-check examples/moe_step.py   # names the op that made NaN

``examples/moe_step_fixed.py`` is the same step with the one-line fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch
import torch.nn.functional as F
from torch import nn

if importlib.util.find_spec("torch_npu") is None:
    # no NPU stack on this machine: the CPU emulation provides torch_npu and mindspeed.ops
    from opcontracts import emulation

    emulation.install("incident")

# a user's model file imports MindSpeed's fused ops like this
from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute  # noqa: E402
from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # noqa: E402


class MoE(nn.Module):
    """Top-2 routing over 4 small experts with MindSpeed's fused permute / unpermute."""

    def __init__(self, hidden: int = 64, ffn: int = 128, experts: int = 4, topk: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn), nn.SiLU(), nn.Linear(ffn, hidden))
            for _ in range(experts))
        self.topk = topk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.router.weight.float())  # the router runs in fp32
        probs, indices = torch.topk(logits.softmax(-1), self.topk, dim=-1)
        permuted, sorted_indices = npu_moe_token_permute(x, indices)  # rows sorted by expert
        counts = torch.bincount(indices.flatten(), minlength=len(self.experts)).tolist()
        out = torch.cat([e(rows) for e, rows in zip(self.experts, permuted.split(counts))])
        return self.unpermute(out, sorted_indices, probs)

    def unpermute(self, out: torch.Tensor, sorted_indices: torch.Tensor,
                  probs: torch.Tensor) -> torch.Tensor:
        return npu_moe_token_unpermute(out, sorted_indices, probs)  # BUG: probs is fp32


def main(moe_class: type[MoE] = MoE) -> int:
    p = argparse.ArgumentParser(description="one MoE training step")
    p.add_argument("--tokens", type=int, default=256)
    # seed 1: some misread fp32 probs are NaN/inf bit patterns, so the gradients are NaN as in
    # the incident; with other seeds they are finite garbage (~1e33) and the norm overflows
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    model = moe_class().to(torch.bfloat16)
    x = torch.randn(args.tokens, 64, dtype=torch.bfloat16, requires_grad=True)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None]))
    print(f"step 1 ({args.tokens} tokens): loss {loss.item():.6f}, grad norm {norm.item():.4f}")
    if not torch.isfinite(norm):  # what a trainer's NaN/inf check on the grad norm sees
        print("grad norm is not finite: training diverges at step 1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
