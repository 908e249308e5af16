"""MindSpeed's stand-ins per MindSpeed line (issue 22): what MindSpeed itself checks, and what
our guards add on the line that does not check.

MindSpeed master's ``mindspeed/ops/csrc/cann/npu_moe_token_unpermute.cpp`` ``TORCH_CHECK``s bf16
``permuted_tokens`` / ``probs`` and int32 ``sorted_indices``; ``2.0.0_core_r0.8.0`` (the
DeepSeek-V3 line) checks ranks only.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import opcontracts
from opcontracts import ContractViolation, emulation, patch


@pytest.fixture
def line(request: pytest.FixtureRequest) -> Iterator[str]:
    was = patch.is_applied()
    emulation.install("incident", mindspeed_line=request.param)
    patch.apply()
    try:
        yield request.param
    finally:
        emulation.uninstall()
        if not was:
            patch.unpatch()


def _args(probs_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randn(8, 4).to(torch.bfloat16)
    sorted_indices = torch.randperm(8).to(torch.int32)
    return tokens, sorted_indices, torch.rand(4, 2).to(probs_dtype)


@pytest.mark.parametrize("line", ["master"], indirect=True)
def test_master_raises_mindspeeds_own_check_before_any_kernel(line: str) -> None:
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # type: ignore[import-not-found]

    with opcontracts.mode("off"), pytest.raises(
            RuntimeError, match=r"Input tensor probs dtype \[Float\] is invalid, should be bfloat16"):
        npu_moe_token_unpermute(*_args(torch.float32))


@pytest.mark.parametrize("line", ["core_r0.8.0"], indirect=True)
def test_core_r0_8_0_lets_fp32_probs_through_and_only_our_guard_stops_them(line: str) -> None:
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # type: ignore[import-not-found]

    with opcontracts.mode("off"):
        out = npu_moe_token_unpermute(*_args(torch.float32))  # the incident: nothing raises
    assert out.shape == (4, 4)
    with opcontracts.mode("strict"), pytest.raises(ContractViolation, match="probs"):
        npu_moe_token_unpermute(*_args(torch.float32))


def test_unknown_line_is_refused() -> None:
    with pytest.raises(ValueError, match="mindspeed_line='r0.9': one of core_r0.8.0, master"):
        emulation.install(mindspeed_line="r0.9")
    assert not emulation.installed()
