"""The demo's model: a small MoE transformer in plain PyTorch, written like a user's model file.

``opcontracts demo`` loads this file as user code (``demo._load_model``), after the emulation is
installed and ``opcontracts.patch`` is applied, under the file name ``moe_block.py``: the
MindSpeed imports below then bind the guarded ops exactly as in a training job, and the call
sites that contract violations and the NaN sentinel report point at the lines of this file
(files inside the opcontracts package count as opcontracts' own and are skipped).

The MoE layer has two paths over the same weights:

* ``fused=True``: MindSpeed's fused permute / unpermute (the NPU path of the incident), with
  the router's fp32 probs handed to the unpermute as they come (``moe_router_dtype=fp32``);
* ``fused=False``: the unfused Megatron-style path in plain PyTorch (the "GPU golden path"):
  multiply by the probs in fp32, cast back to the tokens' dtype.

``cast_probs=True`` is the incident's one-line fix written by hand (``probs.to(torch.bfloat16)``
before the fused unpermute): a run that conforms, for measuring what the guards cost.
``Float16Module`` is how Megatron holds the model in a distributed job (as ``.module``, in
bf16); ``opcontracts demo --ranks N`` shards it with FSDP the way the incident's job did, which
gives the incident's module paths (``_fsdp_wrapped_module.module.layers.2._fsdp_wrapped_module.mlp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute
from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class Router(nn.Module):
    """Top-k softmax router computed in fp32, as Megatron's ``moe_router_dtype=fp32``."""

    def __init__(self, hidden: int, experts: int, topk: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) * hidden ** -0.5)
        self.topk = topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        probs, indices = torch.topk(torch.softmax(logits, dim=-1), self.topk, dim=-1)
        return probs / probs.sum(-1, keepdim=True), indices  # fp32 (N, K), int64 (N, K)


class MoELayer(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, topk: int) -> None:
        super().__init__()
        self.router = Router(hidden, experts, topk)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(experts))
        self.fused = True
        self.cast_probs = False

    def _run_experts(self, permuted: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        # rows are sorted by expert id: expert e takes the next counts[e] rows
        counts = torch.bincount(indices.reshape(-1), minlength=len(self.experts)).tolist()
        chunks = permuted.split(counts)
        return torch.cat([expert(c) for expert, c in zip(self.experts, chunks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, indices = self.router(tokens)
        if self.fused:
            permuted, sorted_indices = npu_moe_token_permute(tokens, indices)
            expert_out = self._run_experts(permuted, indices)
            if self.cast_probs:
                probs = probs.to(torch.bfloat16)  # the fix
            # the incident: probs are fp32 here, and MindSpeed's unpermute takes bf16 only
            out = npu_moe_token_unpermute(expert_out, sorted_indices, probs)
        else:
            out = self._reference(tokens, probs, indices)
        return out.view(shape)

    def _reference(self, tokens: torch.Tensor, probs: torch.Tensor,
                   indices: torch.Tensor) -> torch.Tensor:
        """Megatron's unfused permute / unpermute: gather rows by expert, weight in fp32."""
        topk = indices.size(1)
        order = torch.argsort(indices.reshape(-1), stable=True)
        owner = order // topk
        expert_out = self._run_experts(tokens.index_select(0, owner), indices)
        weighted = expert_out.float() * probs.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return out.index_add(0, owner, weighted).to(tokens.dtype)


class GroupedMoELayer(MoELayer):
    """The experts as MindSpeed's GroupedMLP holds them: one weight per projection for all of
    them, (E, hidden, ffn) and (E, ffn, hidden), run over the rows sorted by expert.  Under
    ``opcontracts preflight`` (fake tensors: no routing values to split the rows by) the
    routing is taken as balanced, every expert taking N*K/E rows: one batched matmul of the
    shapes the grouped one has.  This is how a model gives preflight a value it cannot read."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int) -> None:
        nn.Module.__init__(self)
        self.router = Router(hidden, experts, topk)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) * ffn ** -0.5)
        self.fused = True
        self.cast_probs = False

    def _run_experts(self, permuted: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        import opcontracts

        if opcontracts.preflight.active():  # balanced routing: (E, N*K/E, hidden)
            x = permuted.view(self.w1.size(0), -1, permuted.size(-1))
            return torch.bmm(F.silu(torch.bmm(x, self.w1)), self.w2).view(permuted.shape)
        counts = torch.bincount(indices.reshape(-1), minlength=self.w1.size(0)).tolist()
        return torch.cat([F.silu(c @ w1) @ w2 for c, w1, w2
                          in zip(permuted.split(counts), self.w1, self.w2)])


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, topk: int,
                 grouped: bool = False) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.norm2 = RMSNorm(hidden)
        self.mlp = (GroupedMoELayer if grouped else MoELayer)(hidden, ffn, experts, topk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MoEModel(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, ffn: int = 128,
                 experts: int = 4, topk: int = 2, layers: int = 3, grouped: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, ffn, experts, topk, grouped)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def set_fused(self, fused: bool, cast_probs: bool = False) -> None:
        for m in self.modules():
            if isinstance(m, MoELayer):
                m.fused = fused
                m.cast_probs = cast_probs

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Float16Module(nn.Module):
    """Megatron's wrapper of the model in a training job: the model in bf16, as ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module.to(torch.bfloat16)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.module(ids, targets)
