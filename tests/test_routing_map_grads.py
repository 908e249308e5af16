"""The routing-map grad ops (issue 22): ``npu_moe_token_permute_with_routing_map_grad`` and
``npu_moe_token_unpermute_with_routing_map_grad``, emulated where the release has them.

torch_npu defines both from 2.6.0.post3 on (the wheel digest); MindSpeed 2.2+'s
``te/pytorch/permutation.py`` (``MoePermuteMaskMap`` / ``MoeUnpermuteMaskMap``) calls them from
its Python backward, and op-plugin's ``derivatives.yaml`` names them as the routing-map ops'
derivatives.  Their references must be the gradients of the forward references; a wrong dtype
is CANN's to reject (aclnn: the permuted probs' gradient in the tokens' gradient's dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opcontracts
from opcontracts import ContractViolation, emulation
from opcontracts.reference import _grads, _moe

N, E, H, K = 6, 4, 5, 2
F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
PERMUTE_GRAD = "npu_moe_token_permute_with_routing_map_grad"
UNPERMUTE_GRAD = "npu_moe_token_unpermute_with_routing_map_grad"


def _routing_map(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rmap = torch.zeros(N, E, dtype=torch.bool)
    for n in range(N):
        rmap[n, torch.randperm(E, generator=gen)[:K]] = True
    return rmap


def _rand(*shape: int, dtype: torch.dtype = F64, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _out_tokens(drop_and_pad: bool) -> int:
    return 2 * E if drop_and_pad else N * K  # capacity 2 per expert / top-k 2 per token


@pytest.fixture
def release(request: pytest.FixtureRequest, emulated: Callable[..., None]) -> str:
    """The emulation of ``request.param`` (wide profile) with the patch applied."""
    emulated("wide", version=request.param)
    return str(request.param)


class _NpuOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "npu":
            self.ops.append(func._opname)
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- the references
@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("with_probs", [True, False])
def test_grad_references_are_the_gradients_of_the_forward_references(
        drop_and_pad: bool, with_probs: bool) -> None:
    """In fp64: each grad kernel's reference, called as MindSpeed calls it, equals autograd
    through the forward reference (drop_and_pad: the internal op's out_index and
    permuted_token_id; otherwise sorted_indices for both)."""
    rmap = _routing_map()
    tokens = _rand(N, H).requires_grad_()
    probs = _rand(N, E, seed=2).requires_grad_() if with_probs else None
    permuted, permuted_probs, sorted_indices = _moe.npu_moe_token_permute_with_routing_map(
        tokens, rmap, probs=probs, num_out_tokens=_out_tokens(drop_and_pad),
        drop_and_pad=drop_and_pad)
    g_rows, g_probs = _rand(*permuted.shape, seed=3), _rand(*permuted_probs.shape, seed=4)
    loss = (permuted * g_rows).sum() + ((permuted_probs * g_probs).sum() if with_probs else 0)
    want = torch.autograd.grad(loss, [t for t in (tokens, probs) if t is not None])
    got = _grads.npu_moe_token_permute_with_routing_map_grad(
        g_rows, g_probs if with_probs else None, sorted_indices, rmap, E, N, drop_and_pad)
    torch.testing.assert_close(got[0], want[0])
    assert (got[1] is None) is (not with_probs)
    if with_probs:
        torch.testing.assert_close(got[1], want[1])

    rows = permuted.detach().clone().requires_grad_()
    weights = _rand(N, E, seed=5).requires_grad_() if with_probs else None
    out, out_index, token_id, _ = _moe._npu_moe_token_unpermute_with_routing_map(
        rows, sorted_indices, [N, H], probs=weights, routing_map=rmap, drop_and_pad=drop_and_pad)
    g_out = _rand(N, H, seed=6)
    want = torch.autograd.grad((out * g_out).sum(), [t for t in (rows, weights) if t is not None])
    index = (out_index, token_id) if drop_and_pad else (sorted_indices, sorted_indices)
    got = _grads.npu_moe_token_unpermute_with_routing_map_grad(
        g_out, *index, rmap, rows if with_probs else None, weights, drop_and_pad, [N, H])
    torch.testing.assert_close(got[0], want[0])
    assert (got[1] is None) is (not with_probs)
    if with_probs:
        torch.testing.assert_close(got[1], want[1])


def test_drop_and_pad_index_outputs_are_cannss_sort_of_sorted_indices() -> None:
    """aclnnMoeTokenPermuteWithRoutingMapGrad: ``permuteTokenId, outIndex =
    sortedIndices.sort()``; row ``out_index[i]`` holds token ``permuted_token_id[i]``."""
    rmap = _routing_map()
    _, _, sorted_indices = _moe.npu_moe_token_permute_with_routing_map(
        _rand(N, H), rmap, num_out_tokens=2 * E, drop_and_pad=True)
    _, out_index, token_id, _ = _moe._npu_moe_token_unpermute_with_routing_map(
        _rand(2 * E, H), sorted_indices, [N, H], routing_map=rmap, drop_and_pad=True)
    assert out_index.dtype == token_id.dtype == torch.int32
    assert torch.equal(token_id, sorted_indices.sort(stable=True).values)
    assert torch.equal(sorted_indices[out_index.long()], token_id)


# --------------------------------------------------------------------------- MindSpeed's path
def _mindspeed_step(dtype: torch.dtype, drop_and_pad: bool
                    ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """Forward and backward of MindSpeed's permute + unpermute (te/pytorch/permutation.py);
    the npu ops its backward dispatches, the gradients, and the leaves (fp64 copies)."""
    from mindspeed.te.pytorch.permutation import (  # type: ignore[import-not-found]
        MoePermuteMaskMap,
        MoeUnpermuteMaskMap,
    )

    rmap = _routing_map()
    leaves = [_rand(N, H, dtype=dtype).requires_grad_(),
              _rand(N, E, dtype=dtype, seed=2).requires_grad_(),
              _rand(N, E, dtype=dtype, seed=5).requires_grad_()]
    tokens, probs, weights = leaves
    permuted, permuted_probs, sorted_indices = MoePermuteMaskMap.apply(
        tokens, rmap, probs, _out_tokens(drop_and_pad), drop_and_pad)
    out = MoeUnpermuteMaskMap.apply(permuted, sorted_indices, tokens.shape, weights, rmap,
                                    drop_and_pad)
    loss = (out.double() * _rand(N, H, seed=6)).sum() + \
        (permuted_probs.double() * _rand(*permuted_probs.shape, seed=4)).sum()
    with _NpuOps() as seen:
        loss.backward()
    return seen.ops, [t.grad for t in leaves], [t.detach().double() for t in leaves]


def _reference_grads(leaves: list[torch.Tensor], drop_and_pad: bool) -> tuple[torch.Tensor, ...]:
    """The same step through the forward references, by autograd, in fp64."""
    tokens, probs, weights = (t.clone().requires_grad_() for t in leaves)
    rmap = _routing_map()
    permuted, permuted_probs, sorted_indices = _moe.npu_moe_token_permute_with_routing_map(
        tokens, rmap, probs=probs, num_out_tokens=_out_tokens(drop_and_pad),
        drop_and_pad=drop_and_pad)
    out = _moe.npu_moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, [N, H], probs=weights, routing_map=rmap,
        drop_and_pad=drop_and_pad)
    loss = (out * _rand(N, H, seed=6)).sum() + \
        (permuted_probs * _rand(*permuted_probs.shape, seed=4)).sum()
    return torch.autograd.grad(loss, [tokens, probs, weights])


@pytest.mark.parametrize("release", ["2.6.0.post3", "2.14.0"], indirect=True)
@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_mindspeed_permutation_trains_through_the_grad_ops(release: str,
                                                           drop_and_pad: bool) -> None:
    """Backward runs the two grad ops (at the dispatcher, under the strict guards) and gives
    autograd's gradients of the forward references."""
    with opcontracts.mode("strict"):
        ops, grads, leaves = _mindspeed_step(F32, drop_and_pad)
    assert ops == [UNPERMUTE_GRAD, PERMUTE_GRAD]
    for got, want in zip(grads, _reference_grads(leaves, drop_and_pad), strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("release", ["2.6.0"], indirect=True)
def test_releases_without_the_grad_ops_fail_as_the_real_stack(release: str) -> None:
    """2.6.0 has no routing-map ops at all (the digest): MindSpeed's permute fails on its first
    torch_npu call, with the AttributeError the real module raises."""
    import torch_npu  # type: ignore[import-not-found]

    for name in (PERMUTE_GRAD, UNPERMUTE_GRAD, "npu_moe_token_permute_with_routing_map"):
        assert not hasattr(torch_npu, name) and not hasattr(torch.ops.npu, name)
    with pytest.raises(AttributeError, match="npu_moe_token_permute_with_routing_map"):
        _mindspeed_step(F32, False)


# --------------------------------------------------------------------------- the contracts
def _permute_grad_args(probs_dtype: torch.dtype, index_dtype: torch.dtype = torch.int32
                       ) -> tuple[Any, ...]:
    rmap = _routing_map()
    _, _, sorted_indices = _moe.npu_moe_token_permute_with_routing_map(
        _rand(N, H), rmap, num_out_tokens=N * K)
    return (_rand(N * K, H, dtype=BF16), _rand(N * K, dtype=probs_dtype),
            sorted_indices.to(index_dtype), rmap, E, N, False)


@pytest.mark.parametrize("release", ["2.14.0"], indirect=True)
def test_wrong_dtypes_trip_the_grad_ops_contracts(release: str) -> None:
    import torch_npu  # type: ignore[import-not-found]

    with opcontracts.mode("strict"):
        grad_tokens, grad_probs = torch_npu.npu_moe_token_permute_with_routing_map_grad(
            *_permute_grad_args(BF16))
        assert grad_tokens.shape == (N, H) and grad_probs.shape == (N, E)
        with pytest.raises(ContractViolation) as info:  # aclnn: probs grad like tokens grad
            torch_npu.npu_moe_token_permute_with_routing_map_grad(*_permute_grad_args(F32))
        assert (info.value.op, info.value.arg) == (PERMUTE_GRAD, "probs_grad")
        with pytest.raises(ContractViolation) as info:
            torch_npu.npu_moe_token_permute_with_routing_map_grad(
                *_permute_grad_args(BF16, torch.int64))
        assert info.value.arg == "sorted_indices"
        rows = _rand(N * K, H, dtype=BF16)
        index = torch.randperm(N * K).to(torch.int32)
        torch_npu.npu_moe_token_unpermute_with_routing_map_grad(
            _rand(N, H, dtype=BF16), index, index, _routing_map(), rows,
            _rand(N, E, dtype=F32), False, [N, H])  # fp32 probs with bf16: allowed
        with pytest.raises(ContractViolation) as info:
            torch_npu.npu_moe_token_unpermute_with_routing_map_grad(
                _rand(N, H, dtype=BF16), index.long(), index, _routing_map(), rows, None,
                False, [N, H])
        assert (info.value.op, info.value.arg) == (UNPERMUTE_GRAD, "out_index")


@pytest.mark.parametrize("release", ["2.14.0"], indirect=True)
def test_bf16_tokens_with_fp32_probs_fail_in_backward(release: str) -> None:
    """The forward takes bf16 tokens with fp32 probs; the permute grad kernel does not (aclnn
    ``OP_CHECK_DTYPE_NOT_MATCH``): MindSpeed's backward trips the grad op's contract."""
    from mindspeed.te.pytorch.permutation import MoePermuteMaskMap  # type: ignore[import-not-found]

    tokens = _rand(N, H, dtype=BF16).requires_grad_()
    probs = _rand(N, E, dtype=F32, seed=2).requires_grad_()
    with opcontracts.mode("strict"):
        permuted, permuted_probs, _ = MoePermuteMaskMap.apply(tokens, _routing_map(), probs, N * K)
        with pytest.raises(ContractViolation) as info:
            (permuted.float().sum() + permuted_probs.sum()).backward()
    assert (info.value.op, info.value.arg) == (PERMUTE_GRAD, "probs_grad")


def test_wheel_verify_knows_the_grad_ops_as_routes() -> None:
    """The routing-map ops' C++ nodes reach the grad ops: verify fails where no contract of a
    grad op covers a release that has it, and passes with the shipped contracts."""
    from opcontracts._engine import registry
    from opcontracts.spec import load_contracts
    from opcontracts.wheel import digest, verify

    assert emulation.structure("2.14.0").routes()["npu_moe_token_permute_with_routing_map"] == (
        PERMUTE_GRAD,)
    assert emulation.structure("2.6.0").routes()["npu_moe_token_unpermute_with_routing_map"] == ()
    shipped = load_contracts(registry.shipped_contracts_dir())
    d = digest.load()
    assert not any(r.fails for r in verify.verify(shipped, d, ["2.6.0.post3", "2.14.0"],
                                                  "*routing_map*", routes=True))
    without = [c for c in shipped if c.op not in (PERMUTE_GRAD, UNPERMUTE_GRAD)]
    failing = {r.op for r in verify.verify(without, d, ["2.14.0"], "*routing_map*", routes=True)
               if r.fails}
    assert failing == {PERMUTE_GRAD, UNPERMUTE_GRAD}
