"""Small conforming inputs per op, for ``opcontracts probe`` and the tests.

Each builder takes a ``torch.Generator`` and returns ``(args, kwargs)``: tensors in a dtype the
shipped contract accepts and every emulation profile reads correctly (floats bf16, index and
mask arguments in the width the kernel documents), every optional tensor argument given (so the
probe can vary its dtype too).  Floating values are multiples of 1/8 in [-2, 2] (probs and
scales: multiples of 1/16 in (0, 1]): exact in bf16, fp16, fp32 and fp64, so casting an input
to another floating dtype does not change the math, only the bytes a kernel reads.
"""

from __future__ import annotations

from typing import Any

import torch

from ._moe import npu_moe_token_permute_with_routing_map

__all__ = ["Example"]

Example = tuple[tuple[Any, ...], dict[str, Any]]

N, K, E, H = 4, 2, 4, 8  # tokens, top-k, experts, hidden
BF16 = torch.bfloat16


def _vals(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(BF16)


def _probs(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randint(1, 17, shape, generator=gen) / 16).to(BF16)


def _experts(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) distinct expert ids per row, in [0, E)."""
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]).to(dtype)


def _perm(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=gen).to(torch.int32)


def _routing_map(gen: torch.Generator) -> torch.Tensor:
    m = torch.zeros(N, E, dtype=torch.bool)
    return m.scatter(1, _experts(gen, torch.int64), True)


def permute(gen: torch.Generator) -> Example:
    return (_vals(gen, N, H), _experts(gen, torch.int64)), {}


def permute_grad(gen: torch.Generator) -> Example:
    return (_vals(gen, N, H), _vals(gen, N * K, H), _experts(gen, torch.int64),
            _perm(gen, N * K)), {}


def unpermute(gen: torch.Generator) -> Example:
    return (_vals(gen, N * K, H), _perm(gen, N * K)), {"probs": _probs(gen, N, K)}


def unpermute_grad(gen: torch.Generator) -> Example:
    return (_vals(gen, N * K, H), _vals(gen, N, H), _perm(gen, N * K)), \
        {"probs": _probs(gen, N, K)}


def internal_unpermute(gen: torch.Generator) -> Example:
    return unpermute(gen)


def unpermute_grad_v2(gen: torch.Generator) -> Example:
    permuted, grad, sorted_indices = _vals(gen, N * K, H), _vals(gen, N, H), _perm(gen, N * K)
    return (grad, sorted_indices, N * K, BF16), {"probs": _probs(gen, N, K),
                                                 "permuted_tokens": permuted}


def permute_grad_v2(gen: torch.Generator) -> Example:
    return (_vals(gen, N * K, H), _perm(gen, N * K), N, BF16, K), {}


def permute_routing(gen: torch.Generator) -> Example:
    return (_vals(gen, N, H), _routing_map(gen)), {"probs": _probs(gen, N, E),
                                                   "num_out_tokens": N * K}


def unpermute_routing(gen: torch.Generator) -> Example:
    rmap, probs = _routing_map(gen), _probs(gen, N, E)
    permuted, _, sorted_indices = npu_moe_token_permute_with_routing_map(
        _vals(gen, N, H), rmap, probs=probs, num_out_tokens=N * K)
    return (permuted, sorted_indices, [N, H]), {"probs": probs, "routing_map": rmap}


def permute_routing_grad(gen: torch.Generator) -> Example:
    """As the permute's node calls it: the forward's sorted_indices and routing map."""
    (tokens, rmap), kw = permute_routing(gen)
    permuted, permuted_probs, sorted_indices = npu_moe_token_permute_with_routing_map(
        tokens, rmap, **kw)
    return (_vals(gen, *permuted.shape), _probs(gen, *permuted_probs.shape), sorted_indices,
            rmap, E, N, False), {}


def unpermute_routing_grad(gen: torch.Generator) -> Example:
    """As MindSpeed's MoeUnpermuteMaskMap.backward calls it without drop_and_pad
    (sorted_indices for out_index and permuted_token_id)."""
    (permuted, sorted_indices, restore_shape), kw = unpermute_routing(gen)
    return (_vals(gen, N, H), sorted_indices, sorted_indices, kw["routing_map"], permuted,
            kw["probs"], False, restore_shape), {}


def init_routing(gen: torch.Generator) -> Example:
    row_idx = torch.arange(N * K, dtype=torch.int32).view(K, N).t().contiguous()
    return (_vals(gen, N, H), row_idx, _experts(gen, torch.int32), N), {}


def finalize_routing(gen: torch.Generator) -> Example:
    return (_vals(gen, N * K, H), _vals(gen, N, H), _vals(gen, N, H), _vals(gen, E, H),
            _probs(gen, N, K), _perm(gen, N * K), _experts(gen, torch.int32)), \
        {"drop_pad_mode": 0}


def gating(gen: torch.Generator) -> Example:
    finished = torch.tensor([False, True, False, False])
    return (_vals(gen, N, E),), {"finished": finished, "k": K}


def expert_tokens(gen: torch.Generator) -> Example:
    ids = torch.sort(torch.randint(0, E, (N * K,), generator=gen)).values.to(torch.int32)
    return (ids, E), {}


def grouped_matmul(gen: torch.Generator) -> Example:
    # "single x, several weights, single y" (torch_npu 2.14.0 doc, group_type 0): weights as a
    # list of 2-D ones, one 1-D bias each (fp32 with bf16 x, as the doc's table says)
    return ([_vals(gen, 6, H)], [_vals(gen, H, 5) for _ in range(3)]), {
        "bias": [_vals(gen, 5).float() for _ in range(3)],
        "group_list": torch.tensor([2, 5, 6]), "split_item": 3, "group_type": 0,
        "group_list_type": 0}


def rms_norm(gen: torch.Generator) -> Example:
    return (_vals(gen, N, H), _vals(gen, H)), {}


def rms_norm_backward(gen: torch.Generator) -> Example:
    x, gamma = _vals(gen, N, H), _vals(gen, H)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (_vals(gen, N, H), x, gamma, rstd), {}


def swiglu(gen: torch.Generator) -> Example:
    return (_vals(gen, N, 2 * H),), {}


def rotary_mul(gen: torch.Generator) -> Example:
    return (_vals(gen, 1, 4, 2, H), _vals(gen, 1, 4, 1, H), _vals(gen, 1, 4, 1, H)), {}


def rotary_mul_backward(gen: torch.Generator) -> Example:
    x, r1, r2 = rotary_mul(gen)[0]
    return (_vals(gen, *x.shape), x, r1, r2), {}


def gmm(gen: torch.Generator) -> Example:
    return (_vals(gen, 6, H), _vals(gen, 3, H, 5)), {"group_list": [2, 5, 6]}


def gmm_v2(gen: torch.Generator) -> Example:
    return (_vals(gen, 6, H), _vals(gen, 3, H, 5)), {"group_list": torch.tensor([2, 3, 1])}


def rope(gen: torch.Generator) -> Example:
    return (_vals(gen, 1, 4, 2, H), _vals(gen, 1, 4, 1, H), _vals(gen, 1, 4, 1, H)), {"mode": 0}


def ring(gen: torch.Generator) -> Example:
    s, b, n = 4, 1, 2
    stats = [(torch.randint(8, 17, (b, n, s, 8), generator=gen) / 8) for _ in range(4)]
    return (_vals(gen, s, b, H), stats[0], stats[1], _vals(gen, s, b, H), stats[2],
            stats[3]), {}
