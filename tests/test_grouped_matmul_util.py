"""MindSpeed's ``grouped_matmul_util`` stand-in (#22): what its MoE experts train through, and
which SoC's path a guard can see (Ascend 950: ``torch_npu.npu_grouped_matmul``; Atlas A2 / A3:
the gmm extension, called directly, as on the real stack)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts import ContractViolation

A2, A3, A5 = "Ascend910B3", "Ascend910_9382", "Ascend950PR_9579"


@pytest.fixture
def util(request: pytest.FixtureRequest, emulated: Callable[..., None]) -> Any:
    """The stand-in module on an emulated device reporting the SoC ``request.param``, with the
    patch applied."""
    emulated("narrow", device=request.param)
    return importlib.import_module("mindspeed.core.transformer.moe.grouped_matmul_util")


def _experts(dtype: torch.dtype = torch.bfloat16, device: str = "npu"
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, generator=gen).to(dtype)
    w = torch.randn(3, 4, 5, generator=gen).to(torch.bfloat16)
    return x.to(device).requires_grad_(), w.to(device).requires_grad_(), [2, 0, 5]


def _reference(x: torch.Tensor, w: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    rows = torch.split(x.detach().cpu().float(), tokens)
    return torch.cat([r @ w.detach().cpu().float()[g] for g, r in enumerate(rows)])


@pytest.mark.parametrize("util", [A2, A3, A5], indirect=True)
def test_bf16_gmm_trains_the_experts_on_every_soc(util: Any) -> None:
    cls = util.get_gmm_op_cls()
    assert cls is util.BF16GMMFunction
    x, w, tokens = _experts()
    out = cls.gmm_apply(x, w, None, tokens, w)
    torch.testing.assert_close(out.cpu().float(), _reference(x, w, tokens), rtol=2e-2, atol=2e-2)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16().to(out.device)
    out.backward(g)
    xr = x.detach().cpu().float().requires_grad_()
    wr = w.detach().cpu().float().requires_grad_()
    _reference_graph = torch.cat([r @ wr[i] for i, r in enumerate(torch.split(xr, tokens))])
    _reference_graph.backward(g.cpu().float())
    assert x.grad is not None and w.grad is not None
    torch.testing.assert_close(x.grad.cpu().float(), xr.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(w.grad.cpu().float(), wr.grad, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("util", [A5], indirect=True)
def test_on_ascend_950_the_guard_sees_a_wrong_dtype(util: Any) -> None:
    assert util.check_npu_version(util.NPUVersion.A5)
    x, w, tokens = _experts(torch.float64)  # fp64 activations: no grouped matmul reads them
    with opcontracts.mode("strict"), pytest.raises(ContractViolation, match="npu_grouped_matmul"):
        util.BF16GMMFunction.gmm_apply(x, w, None, tokens, w)


@pytest.mark.parametrize("util", [A2, A3], indirect=True)
def test_on_a2_and_a3_the_extension_is_called_and_no_guard_sees_it(util: Any) -> None:
    """As on the real stack: MindSpeed's gmm extension is C++ calling aclnn; the wrong dtype
    the Ascend 950 path rejects goes through unseen."""
    assert not util.check_npu_version(util.NPUVersion.A5)
    x, w, tokens = _experts(torch.float64)
    seen: list[str] = []
    import torch_npu  # type: ignore[import-not-found]

    guard = torch_npu.npu_grouped_matmul

    def spy(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - must not be called
        seen.append("npu_grouped_matmul")
        return guard(*args, **kwargs)

    torch_npu.npu_grouped_matmul = spy
    try:
        with opcontracts.mode("strict"):
            util.BF16GMMFunction.gmm_apply(x, w, None, tokens, w)  # no violation: unguarded
    finally:
        torch_npu.npu_grouped_matmul = guard
    assert seen == []


@pytest.mark.parametrize("util", [A2, A5], indirect=True)
def test_the_fused_weight_gradient_accumulates_into_main_grad(util: Any) -> None:
    from mindspeed.args_utils import get_full_args  # type: ignore[import-not-found]

    args = get_full_args()
    args.gemm_gradient_accumulation_fusion = True
    x, w, tokens = _experts()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    out = util.BF16GMMFunction.gmm_apply(x, w, None, tokens, w)
    out.float().sum().backward()
    assert w.grad is None  # no grad_added_to_main_grad: the weight gradient went to main_grad
    xr = x.detach().cpu().float()
    want = torch.stack([r.T @ torch.ones(r.shape[0], 5) if r.shape[0] else torch.zeros(4, 5)
                        for r in torch.split(xr, tokens)])
    torch.testing.assert_close(w.main_grad.cpu(), want, rtol=2e-2, atol=2e-2)
    w.grad_added_to_main_grad = False
    util.BF16GMMFunction.gmm_apply(x, w, None, tokens, w).float().sum().backward()
    assert w.grad_added_to_main_grad is True and w.grad is not None  # the placeholder
    torch.testing.assert_close(w.main_grad.cpu(), 2 * want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("util", [A2], indirect=True)
def test_fp8_picks_its_function_and_says_it_is_not_emulated(util: Any) -> None:
    from mindspeed.args_utils import get_full_args  # type: ignore[import-not-found]

    args = get_full_args()
    args.fp8, args.fp8_recipe = "e4m3", "mxfp8"
    cls = util.get_gmm_op_cls()
    assert cls is util.MXFP8GMMFunction
    x, w, tokens = _experts()
    with pytest.raises(NotImplementedError, match=r"MXFP8GMMFunction\.op_forward is fp8 and not emulated"):
        cls.gmm_apply(x, w, None, tokens, w)
    args.fp8_recipe = "blockwise"  # no fp8 GMM for it: bf16
    assert util.get_gmm_op_cls() is util.BF16GMMFunction
    args.use_gmm_fp8 = False
    args.fp8_recipe = "tensorwise"
    assert util.get_gmm_op_cls() is util.BF16GMMFunction


@pytest.mark.parametrize("util", [A2, A3, A5], indirect=True)
def test_the_soc_is_read_from_the_device(util: Any) -> None:
    import torch_npu  # type: ignore[import-not-found]
    from mindspeed.ops.npu_matmul_add import NPUVersion, get_npu_version  # type: ignore[import-not-found]

    name = torch_npu.npu.get_device_name()
    want = {A2: NPUVersion.A2, A3: NPUVersion.A3, A5: NPUVersion.A5}[name]
    assert get_npu_version() is want
