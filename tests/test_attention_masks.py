"""npu_fusion_attention's full mask (sparse modes 0 and 1) has Sq and Skv last in every input
layout: a broadcastable (B, 1, 1, Skv) mask is rejected whatever the layout (diffusers PR 13490
met it in BNSD; the kernel reads the mask the same way in BSND, BSH and SBH)."""

from __future__ import annotations

import pytest
import torch

import opcontracts
from opcontracts import ContractViolation

B, N, S, D = 2, 4, 16, 16
_QUERY = {"BNSD": (B, N, S, D), "BSND": (B, S, N, D), "BSH": (B, S, N * D), "SBH": (S, B, N * D)}


def _call(layout: str, mask_shape: tuple[int, ...]) -> None:
    q = torch.randn(*_QUERY[layout], dtype=torch.bfloat16)
    mask = torch.zeros(*mask_shape, dtype=torch.bool)
    with opcontracts.versions(torch_npu="2.7.1.post8", cann="8.3.RC1", soc="Ascend910B3"):
        opcontracts.check("npu_fusion_attention", q, q, q, N, layout, atten_mask=mask,
                          scale=0.25, keep_prob=1.0, sparse_mode=0)


@pytest.mark.parametrize("layout", sorted(_QUERY))
def test_a_broadcastable_mask_is_rejected_in_every_layout(layout: str) -> None:
    with pytest.raises(ContractViolation, match="atten_mask"):
        _call(layout, (B, 1, 1, S))


@pytest.mark.parametrize("layout", sorted(_QUERY))
@pytest.mark.parametrize("mask", [(B, 1, S, S), (1, 1, S, S), (B, N, S, S), (S, S)])
def test_the_documented_mask_shapes_pass_in_every_layout(layout: str, mask: tuple[int, ...]) -> None:
    _call(layout, mask)


_FIA_QUERY = {"BNSD": (B, N, S, D), "BSND": (B, S, N, D), "BSH": (B, S, N * D)}


def _fia(layout: str, pse_shape: tuple[int, ...]) -> None:
    q = torch.randn(*_FIA_QUERY[layout], dtype=torch.bfloat16)
    pse = torch.randn(*pse_shape, dtype=torch.bfloat16)
    with opcontracts.versions(torch_npu="2.9.0.post2", cann="9.0.0", soc="Ascend910B3"):
        opcontracts.check("npu_fused_infer_attention_score", q, q, q, pse_shift=pse,
                          num_heads=N, input_layout=layout, scale=0.25)


@pytest.mark.parametrize("layout", sorted(_FIA_QUERY))
def test_a_broadcastable_pse_shift_is_rejected_in_every_layout(layout: str) -> None:
    # npu_fused_infer_attention_score's pse_shift is (B|1, N, Q_S, KV_S): (1, 1, 1, KV_S) is not
    with pytest.raises(ContractViolation, match="pse_shift"):
        _fia(layout, (1, 1, 1, S))


@pytest.mark.parametrize("layout", sorted(_FIA_QUERY))
@pytest.mark.parametrize("pse", [(B, N, S, S), (1, N, S, S)])
def test_the_documented_pse_shift_shapes_pass(layout: str, pse: tuple[int, ...]) -> None:
    _fia(layout, pse)
