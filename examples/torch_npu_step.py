"""A torch_npu training step as it is written for an NPU, with no emulation code in it.

On an Ascend machine this runs on the NPU.  On a machine without one, run it on opcontracts'
emulated torch_npu 2.13 and npu device:

    opcontracts run --emulate examples/torch_npu_step.py                 # trains; exit 0
    OPCONTRACTS_TARGETS=cann=8.0.RC3 opcontracts run --emulate --mode strict \
        examples/torch_npu_step.py --fp32-probs                           # stops at the unpermute

The router's probs reach ``torch_npu.npu_moe_token_unpermute`` in bf16; ``--fp32-probs`` passes
them in fp32, the incident's bug on the incident's stack (CANN 8.0.RC3, whose unpermute kernel
reads bf16 only; CANN 8.0.0 and later accept fp32, so with CANN unknown the call is a
conditional verdict: warned, not raised; docs/targets.md).  The backward runs on the
device's autograd worker thread, as on an NPU (printed).
"""

from __future__ import annotations

import argparse
import threading

import torch
import torch_npu
from torch import nn


class MoE(nn.Module):
    def __init__(self, hidden: int = 32, experts: int = 4, topk: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.topk = topk

    def forward(self, x: torch.Tensor, fp32_probs: bool) -> torch.Tensor:
        probs, indices = torch.topk(self.router(x).float().softmax(-1), self.topk, dim=-1)
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(x, indices)
        counts = torch.bincount(indices.flatten(), minlength=len(self.experts)).tolist()
        out = torch.cat([e(rows) for e, rows in zip(self.experts, permuted.split(counts))])
        if not fp32_probs:
            probs = probs.to(torch.bfloat16)  # the kernel takes bf16 probs only
        return torch_npu.npu_moe_token_unpermute(out, sorted_indices, probs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp32-probs", action="store_true", help="pass fp32 probs (the bug)")
    args = parser.parse_args()
    torch.npu.set_device(0)
    torch.manual_seed(0)
    model = MoE().to(torch.bfloat16).npu()
    x = torch.randn(16, 32, dtype=torch.bfloat16).npu()
    loss = model(x, args.fp32_probs).float().square().mean()
    threads: list[int] = []
    loss.register_hook(lambda grad: threads.append(threading.get_ident()))
    loss.backward()
    torch.npu.synchronize()
    grads_finite = all(bool(p.grad.isfinite().all()) for p in model.parameters()
                       if p.grad is not None)
    where = "the caller's thread" if threads == [threading.get_ident()] else "a worker thread"
    print(f"{torch.npu.get_device_name()}: loss {loss.item():.4f}, backward on {where}, "
          f"gradients {'finite' if grads_finite else 'NOT finite'}")
    return 0 if grads_finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
