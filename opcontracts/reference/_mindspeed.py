"""References of MindSpeed's fused ops (``mindspeed.ops.*``, op names ``mindspeed.<fn>``), with
MindSpeed's own signatures (MindSpeed master, docs/ops/*.md): thin adapters over the torch_npu
references they are built on, as MindSpeed's ops are over the CANN kernels."""

from __future__ import annotations

from typing import Any

import torch

from . import _matmul, _moe, _norm
from ._attention import npu_ring_attention_update

__all__ = ["npu_gmm", "npu_gmm_v2", "npu_moe_token_permute", "npu_moe_token_unpermute",
           "npu_ring_attention_update", "npu_rotary_position_embedding"]


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: torch.Tensor | None = None, padded_mode: bool = False,
                            restore_shape: Any = None) -> torch.Tensor:
    """MindSpeed docs/ops/npu_moe_token_unpermute.md (the CANN unpermute kernel)."""
    return _moe.npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode,
                                        restore_shape)


def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor,
                          num_out_tokens: int | None = None, padded_mode: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """MindSpeed docs/ops/npu_moe_token_permute.md (the CANN permute kernel)."""
    return _moe.npu_moe_token_permute(tokens, indices, num_out_tokens, padded_mode)


def _group_list_tensor(group_list: Any, x: torch.Tensor) -> torch.Tensor | None:
    if group_list is None or isinstance(group_list, torch.Tensor):
        return group_list
    return torch.tensor(list(group_list), dtype=torch.int64, device=x.device)


def _gmm(x: torch.Tensor, weight: torch.Tensor, bias: Any, group_list: Any, group_type: int,
         group_list_type: int) -> torch.Tensor:
    return _matmul.npu_grouped_matmul(
        [x], [weight], bias=[bias] if bias is not None else None,
        group_list=_group_list_tensor(group_list, x), split_item=3, group_type=group_type,
        group_list_type=group_list_type)[0]


def npu_gmm(x: torch.Tensor, weight: torch.Tensor, *, bias: Any = None, group_list: Any = None,
            group_type: int = 0, gemm_fusion: bool = False, original_weight: Any = None
            ) -> torch.Tensor:
    """MindSpeed docs/ops/gmm.md: ``group_list`` holds cumulative row ends (group_list_type 0);
    ``gemm_fusion`` / ``original_weight`` (fused weight-gradient accumulation) are ignored."""
    return _gmm(x, weight, bias, group_list, group_type, 0)


def npu_gmm_v2(x: torch.Tensor, weight: torch.Tensor, *, bias: Any = None,
               group_list: Any = None, group_type: int = 0, gemm_fusion: bool = False,
               original_weight: Any = None) -> torch.Tensor:
    """Like :func:`npu_gmm`, but ``group_list`` holds per-group row counts (group_list_type 1)."""
    return _gmm(x, weight, bias, group_list, group_type, 1)


def npu_rotary_position_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  mode: int = 0) -> torch.Tensor:
    """MindSpeed docs/ops/npu_rotary_position_embedding.md: mode 0 rotates halves, mode 1
    interleaved pairs (the kernel of ``npu_rotary_mul``)."""
    return _norm.npu_rotary_mul(x, cos, sin, "half" if mode == 0 else "interleave")
