"""What ``opcontracts preflight`` runs without a script: the demo's model at DeepSeek-V3 size.

The demo's MoE transformer (``demo_model.py``, loaded as the user's ``moe_block.py``) with
DeepSeek-V3's sizes: hidden 7,168, 128 heads, 256 routed experts of 2,048, top-8, 61 layers, a
vocabulary of 129,280, 4,096 tokens per micro-batch; the experts held as MindSpeed's
GroupedMLP holds them (``grouped=True``: one grouped matmul, no host read of the routing).
One training step (forward, backward, AdamW's step) in bf16 on the emulated ``npu`` device,
under :class:`~opcontracts._tools.preflight.preflight`: the router's fp32 probs reach
MindSpeed's bf16-only unpermute at ``moe_block.py:107`` in every layer, as in the incident.
Without declared targets it is judged on the incident's stack (``INCIDENT_TARGETS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .preflight import preflight

__all__ = ["DEEPSEEK_V3", "INCIDENT_TARGETS", "Size", "run_demo"]

INCIDENT_TARGETS = "cann=8.0.RC3,soc=Ascend910B3,name=incident"
"""an Atlas A2 training stack of the DeepSeek-V3 line (CANN 8.0.RC3, Ascend910B3)"""


@dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    ffn: int
    experts: int
    topk: int
    layers: int
    vocab: int
    tokens: int  # per micro-batch (one sequence)

    def text(self) -> str:
        return (f"hidden {self.hidden:,}, {self.heads} heads, {self.experts} experts of "
                f"{self.ffn:,}, top-{self.topk}, {self.layers} layers, vocab {self.vocab:,}, "
                f"{self.tokens:,} tokens")


DEEPSEEK_V3 = Size(hidden=7168, heads=128, ffn=2048, experts=256, topk=8, layers=61,
                   vocab=129280, tokens=4096)


def run_demo(size: Size = DEEPSEEK_V3, targets: str | list[str] | None = None,
             steps: int = 1) -> preflight:
    """Preflight ``steps`` training steps of the demo's model at ``size``; the finished
    :class:`preflight` (its ``report``)."""
    import torch

    from .._lang import targets as _t
    from . import demo

    if targets is None and not _t.declared()[0]:
        targets = INCIDENT_TARGETS
    with demo._environment() as mod:
        with preflight(targets, steps=steps) as pf:
            with torch.device("npu"):
                model = mod.MoEModel(vocab=size.vocab, hidden=size.hidden, heads=size.heads,
                                     ffn=size.ffn, experts=size.experts, topk=size.topk,
                                     layers=size.layers, grouped=True)
            model = model.to(torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(steps):
                ids = torch.randint(0, size.vocab, (1, size.tokens), device="npu")
                targets_ = torch.randint(0, size.vocab, (1, size.tokens), device="npu")
                loss = model(ids, targets_)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    return pf
