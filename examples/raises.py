"""A job that violates a contract and then crashes.

``opcontracts run`` still prints the violation report (and writes ``--report FILE``) and
exits with the script's status, 1, after the traceback:

    opcontracts run --report report.json examples/raises.py
"""

from __future__ import annotations

import importlib.util

import torch

if importlib.util.find_spec("torch_npu") is None:  # no NPU stack: the CPU emulation
    from opcontracts import emulation

    emulation.install("incident")

from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # noqa: E402

tokens = torch.randn(8, 16, dtype=torch.bfloat16)
sorted_indices = torch.randperm(8, dtype=torch.int32)
probs = torch.rand(4, 2)  # fp32: MindSpeed's unpermute takes bf16 only (warned and recorded)
out = npu_moe_token_unpermute(tokens, sorted_indices, probs)
print("unpermuted:", tuple(out.shape))

raise RuntimeError("the data loader died after the first step")
