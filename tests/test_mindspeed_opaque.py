"""MindSpeed's stand-ins per MindSpeed line (issue 22): what MindSpeed itself checks, and what
our guards add on the line that does not check.

MindSpeed master's ``mindspeed/ops/csrc/cann/npu_moe_token_unpermute.cpp`` ``TORCH_CHECK``s bf16
``permuted_tokens`` / ``probs`` and int32 ``sorted_indices``; ``2.0.0_core_r0.8.0`` (the
DeepSeek-V3 line) checks ranks only.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opcontracts
from opcontracts import ContractViolation, emulation, patch
from opcontracts.dispatch import ContractDispatchMode


@pytest.fixture
def line(request: pytest.FixtureRequest, emulated: Callable[..., None]) -> str:
    """The incident profile with MindSpeed's line ``request.param``, the patch applied."""
    emulated("incident", mindspeed_line=request.param)
    return str(request.param)


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


# --------------------------------------------------------------------------- opaque kernels
# On the real stack MindSpeed's unpermute / permute are JIT-built C++ (op_builder:
# torch.utils.cpp_extension.load) calling aclnn directly: no torch_npu op is reached inside them.


class _NpuOps(TorchDispatchMode):
    """The ``npu`` / ``mindspeed`` ops that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace in ("npu", "mindspeed"):
            self.ops.append(f"{func.namespace}::{func._opname}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("line", ["core_r0.8.0"], indirect=True)
def test_core_r0_8_0_only_the_guard_on_mindspeeds_function_sees_a_wrong_dtype(line: str) -> None:
    """int64 sorted_indices (the kernel reads int32): MindSpeed's core_r0.8.0 C++ does not
    check, and torch_npu's unpermute contract, which would, is never reached: the one record is
    the MindSpeed contract's, with nothing nested under it."""
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # type: ignore[import-not-found]

    tokens, sorted_indices, probs = _args(torch.bfloat16)
    bad = sorted_indices.long()
    opcontracts.reset_report()
    with opcontracts.mode("warn"), pytest.warns(opcontracts.ContractWarning):
        npu_moe_token_unpermute(tokens, bad, probs)
    records = opcontracts.report().records
    assert [(r.op, r.arg) for r in records] == [("mindspeed.npu_moe_token_unpermute", "sorted_indices")]
    assert records[0].nested == []
    # the extension itself (what MindSpeed's function calls) is reached by no guard at all
    from mindspeed.op_builder import MoeTokenUnpermuteOpBuilder  # type: ignore[import-not-found]

    ext = MoeTokenUnpermuteOpBuilder().load()
    with opcontracts.mode("strict"), _NpuOps() as seen, ContractDispatchMode():
        ext.npu_moe_token_unpermute(tokens, bad, probs, False, None)  # silently misread
    assert seen.ops == []
    # the control: the same arguments into torch_npu's op are caught at the dispatcher
    import torch_npu  # type: ignore[import-not-found]

    with opcontracts.mode("strict"), ContractDispatchMode(), pytest.raises(
            ContractViolation, match="sorted_indices"):
        torch.ops.npu.npu_moe_token_unpermute.default(tokens, bad, probs)
    assert torch_npu.npu_moe_token_unpermute is torch.ops.npu.npu_moe_token_unpermute


@pytest.mark.parametrize("line", ["core_r0.8.0", "master"], indirect=True)
def test_a_train_step_through_mindspeed_dispatches_no_npu_op(line: str) -> None:
    """Forward and backward of MindSpeed's permute + unpermute: nothing of torch_npu's reaches
    the dispatcher (a ContractDispatchMode has nothing to check), and the gradients are right
    (bf16 everywhere, which every line and profile accepts)."""
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute  # type: ignore[import-not-found]
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # type: ignore[import-not-found]

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(4, 8, generator=gen).bfloat16().requires_grad_()
    indices = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    probs = torch.rand(4, 2, generator=gen).bfloat16().requires_grad_()
    with _NpuOps() as seen:
        permuted, sorted_indices = npu_moe_token_permute(tokens, indices)
        out = npu_moe_token_unpermute(permuted, sorted_indices, probs)
        out.float().sum().backward()
    assert seen.ops == []
    assert tokens.grad is not None and probs.grad is not None
    torch.testing.assert_close(tokens.grad.float(), probs.float().sum(1, keepdim=True).expand(4, 8),
                               rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(probs.grad.float(), tokens.detach().float().sum(1)[:, None].expand(4, 2),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("line", ["core_r0.8.0"], indirect=True)
def test_core_r0_8_0_casts_to_fp32_and_the_bf16_grad_kernel_misreads_it(line: str) -> None:
    """The incident on MindSpeed's DeepSeek-V3 line: fp32 probs make its C++ cast the tokens to
    fp32; the forward kernel (fp32 in the ``incident`` profile, as torch_npu 2.13 documents)
    is right, the backward kernel (bf16 only) reads the fp32 buffers as bf16: garbage
    gradients, silently."""
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # type: ignore[import-not-found]

    tokens, sorted_indices, probs = _args(torch.float32)
    tokens.requires_grad_()
    probs.requires_grad_()
    with opcontracts.mode("off"):
        out = npu_moe_token_unpermute(tokens, sorted_indices, probs)
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16  # cast back to the tokens' dtype
    expected = npu_reference(tokens.detach().float(), sorted_indices, probs.detach())
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)  # forward: fine
    assert probs.grad is not None
    want = tokens.detach().float()[sorted_indices.long()].sum(1).view(4, 2)
    assert not torch.allclose(probs.grad, want, rtol=1e-2, atol=1e-2)  # backward: garbage


def npu_reference(tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor
                  ) -> torch.Tensor:
    from opcontracts import reference

    ref = reference.get("npu_moe_token_unpermute")
    assert ref is not None
    return ref.forward(tokens, sorted_indices, probs)  # type: ignore[no-any-return]


@pytest.mark.parametrize("line", ["master"], indirect=True)
def test_master_checks_the_permute_too_and_the_ranks(line: str) -> None:
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute  # type: ignore[import-not-found]
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute  # type: ignore[import-not-found]

    with opcontracts.mode("off"):
        with pytest.raises(RuntimeError, match=r"Input tensor tokens dtype \[Float\] is invalid, "
                                               r"should be bfloat16"):
            npu_moe_token_permute(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64))
        with pytest.raises(RuntimeError, match=r"Input tensor sorted_indices dtype \[Long\] is "
                                               r"invalid, should be int32"):
            npu_moe_token_unpermute(torch.randn(8, 4).bfloat16(), torch.arange(8))
        with pytest.raises(RuntimeError, match="The dims of input permuted_tokens should be 2 "
                                               "dimensional, but got 3-dimensional."):
            npu_moe_token_unpermute(torch.randn(8, 4, 1).bfloat16(), torch.arange(8).int())


# --------------------------------------------------------------------------- the JIT extensions


def test_op_builder_load_is_a_cached_extension_module() -> None:
    emulation.install()
    try:
        import sys as _sys

        from mindspeed.op_builder import MoeTokenUnpermuteOpBuilder  # type: ignore[import-not-found]
        from mindspeed.ops import npu_moe_token_unpermute as ms  # type: ignore[import-not-found]

        ext = ms.moe_token_unpermute_op_builder.load()
        assert ext is MoeTokenUnpermuteOpBuilder().load()  # MindSpeed's _loaded_ops cache
        assert ext.__name__ == "npu_moe_token_unpermute" and ext.__file__.endswith(".so")
        assert ext.__name__ not in _sys.modules  # as cpp_extension.load leaves it
    finally:
        emulation.uninstall()


# --------------------------------------------------------------------------- torch.ops.mindspeed


def test_mindspeed_library_lives_with_the_install_and_npu_gmm_goes_through_it() -> None:
    assert not hasattr(torch.ops.mindspeed, "npu_gmm")
    emulation.install()
    try:
        # defined when MindSpeed's GMMOpBuilder is built (at import of mindspeed.ops.gmm)
        assert not hasattr(torch.ops.mindspeed, "npu_gmm")
        from mindspeed.ops.gmm import npu_gmm, npu_gmm_v2  # type: ignore[import-not-found]

        assert sorted(torch.ops.mindspeed.npu_gmm.overloads()) == ["List", "Tensor"]
        assert "Tensor original_weight, Tensor x, Tensor weight, *" in str(
            torch.ops.mindspeed.npu_gmm.Tensor._schema)
        x = torch.randn(5, 3, requires_grad=True)
        w = torch.randn(2, 3, 4, requires_grad=True)
        with _NpuOps() as seen, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's autograd fallback: no Autograd kernel
            y = npu_gmm(x, w, group_list=[2, 5])
            y.sum().backward()
            y2 = npu_gmm_v2(x.detach(), w.detach(), group_list=torch.tensor([2, 3]))
        assert seen.ops == ["mindspeed::npu_gmm", "mindspeed::npu_gmm_v2"]  # no npu op inside
        expected = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
        torch.testing.assert_close(y, expected)
        torch.testing.assert_close(y2, expected.detach())
        assert x.grad is not None and w.grad is not None
        torch.testing.assert_close(w.grad[0], x[:2].detach().T @ torch.ones(2, 4))
    finally:
        emulation.uninstall()
    assert not hasattr(torch.ops.mindspeed, "npu_gmm")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mindspeed.ops.gmm")


# --------------------------------------------------------------------------- the routing-map path


def _routing_args() -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    from opcontracts.reference import _examples

    args, kwargs = _examples.unpermute_routing(torch.Generator().manual_seed(0))
    permuted, sorted_indices, restore_shape = args
    return permuted, sorted_indices, restore_shape, kwargs["probs"], kwargs["routing_map"]


def test_mindspeed_fused_unpermute_reaches_the_internal_ops_contract() -> None:
    """MindSpeed 2.2+'s MoeUnpermuteMaskMap calls torch_npu._npu_moe_token_unpermute_with_
    routing_map itself: the internal op's contract (rules of the public op) guards that call."""
    was = patch.is_applied()
    emulation.install("wide", version="2.13.0")
    patch.apply()
    try:
        from mindspeed.te.pytorch.permutation import MoeUnpermuteMaskMap  # type: ignore[import-not-found]

        permuted, sorted_indices, restore_shape, probs, routing_map = _routing_args()
        with opcontracts.mode("strict"):
            out = MoeUnpermuteMaskMap.apply(permuted, sorted_indices, restore_shape, probs,
                                            routing_map)
            assert out.shape == tuple(restore_shape)
            with pytest.raises(ContractViolation) as info:
                MoeUnpermuteMaskMap.apply(permuted, sorted_indices.long(), restore_shape, probs,
                                          routing_map)
        assert (info.value.op, info.value.arg) == (
            "_npu_moe_token_unpermute_with_routing_map", "sorted_indices")
        # and torch_npu's public routing-map unpermute reaches it below autograd
        import torch_npu  # type: ignore[import-not-found]

        with _NpuOps() as seen:
            torch_npu.npu_moe_token_unpermute_with_routing_map(
                permuted, sorted_indices, restore_shape, probs=probs, routing_map=routing_map)
        assert seen.ops == ["npu::_npu_moe_token_unpermute_with_routing_map"]
    finally:
        emulation.uninstall()
        if not was:
            patch.unpatch()


@pytest.mark.parametrize(("version", "internal"), [("2.6.0", False), ("2.6.0.post3", True),
                                                   ("2.7.1", True), ("2.14.0", True)])
def test_the_internal_routing_map_op_exists_where_the_release_has_it(version: str,
                                                                     internal: bool) -> None:
    emulation.install(version=version)
    try:
        assert hasattr(torch.ops.npu, "_npu_moe_token_unpermute_with_routing_map") is internal
    finally:
        emulation.uninstall()
