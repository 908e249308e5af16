"""What the emulated ops' backward nodes keep alive: the tensors the release's node saves
(``Functions.h`` of the wheels: one ``SavedVariable`` each), nothing more, as a saved-tensor
hook (activation offloading, msprobe-style memory tools) sees on the NPU.

From the releases with ``_npu_moe_token_unpermute`` its node saves ``probs``,
``sorted_indices`` and the op's second output, which op-plugin's glue makes the permuted
tokens themselves only when ``probs`` is given, before CANN 9.1.0 or on an Ascend 950, and
leaves undefined otherwise (op-plugin master, "Optimize moe token unpermute backward memory").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import opcontracts

BF16 = torch.bfloat16


@pytest.fixture
def release(request: pytest.FixtureRequest, emulated: Callable[..., None]) -> Iterator[str]:
    emulated("wide", version=request.param)
    try:
        yield request.param
    finally:
        opcontracts.set_versions(cann=None)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _saved_by_unpermute(probs: bool) -> tuple[set[int], dict[str, int], Any]:
    """The storages the unpermute's node saves (through saved-tensor hooks), the inputs'
    storages, and the gradients."""
    import torch_npu  # type: ignore[import-not-found]  # the emulation's stand-in

    gen = torch.Generator().manual_seed(0)
    tokens = (torch.randint(-8, 9, (6, 16), generator=gen) / 8).to(BF16)
    indices = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
    permuted = permuted.detach().requires_grad_()
    p = (torch.randint(1, 9, (6, 2), generator=gen) / 8).to(BF16).requires_grad_() if probs \
        else None
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(_storage(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=p)
    out.float().sum().backward()
    storages = {"permuted": _storage(permuted), "sorted_indices": _storage(sorted_indices)}
    if p is not None:
        storages["probs"] = _storage(p)
    assert permuted.grad is not None
    return saved, storages, (permuted.grad, None if p is None else p.grad)


@pytest.mark.parametrize("release", ["2.13.0", "2.14.0"], indirect=True)
def test_without_probs_on_cann_9_1_the_permuted_tokens_are_not_kept(release: str) -> None:
    opcontracts.set_versions(cann="9.1.0")
    saved, storages, grads = _saved_by_unpermute(probs=False)
    assert storages["permuted"] not in saved
    assert storages["sorted_indices"] in saved
    opcontracts.set_versions(cann="8.0.RC3")  # the glue keeps them before 9.1.0
    saved_old, storages_old, grads_old = _saved_by_unpermute(probs=False)
    assert storages_old["permuted"] in saved_old
    torch.testing.assert_close(grads[0], grads_old[0])  # the same gradient either way


@pytest.mark.parametrize("release", ["2.14.0"], indirect=True)
def test_with_probs_the_permuted_tokens_are_kept_and_not_copied(release: str) -> None:
    opcontracts.set_versions(cann="9.1.0")
    saved, storages, grads = _saved_by_unpermute(probs=True)
    assert {storages["permuted"], storages["probs"], storages["sorted_indices"]} <= saved
    assert len(saved) == 3  # nothing else: not the output, not a copy of the tokens
    assert grads[1] is not None


def test_on_an_ascend_950_the_permuted_tokens_are_kept(emulated: Callable[..., None]) -> None:
    from opcontracts.emulation import _glue

    emulated("wide", version="2.14.0", device="Ascend950PR")  # the device it reports
    opcontracts.set_versions(cann="9.1.0")
    try:
        assert _glue._on_ascend950()
        saved, storages, _ = _saved_by_unpermute(probs=False)
    finally:
        opcontracts.set_versions(cann=None)
    assert storages["permuted"] in saved


@pytest.mark.parametrize("release", ["2.12.0"], indirect=True)
def test_the_plain_unpermute_node_saves_its_three_inputs_and_not_its_output(release: str
                                                                            ) -> None:
    """2.12.0's ``NpuMoeTokenUnpermuteBackward0`` (on the public op): ``permuted_tokens_``,
    ``probs_``, ``sorted_indices_``."""
    saved, storages, _ = _saved_by_unpermute(probs=True)
    assert saved == set(storages.values())


@pytest.mark.parametrize("release", ["2.14.0"], indirect=True)
def test_a_node_saves_what_its_formula_reads_and_keeps_the_rest_by_shape(release: str) -> None:
    """``NpuSwigluBackward0`` saves ``self_`` only: the output is not kept, and the backward
    still runs (the rest reaches it by shape and dtype)."""
    import torch_npu

    x = torch.randn(4, 8, dtype=torch.float32, requires_grad=True)
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = torch_npu.npu_swiglu(x, dim=-1)
    assert [_storage(t) for t in kept] == [_storage(x)]
    y.sum().backward()
    a, b = x.detach().chunk(2, dim=-1)
    expected = torch.cat([torch.sigmoid(a) * (1 + a * (1 - torch.sigmoid(a))) * b,
                          a * torch.sigmoid(a)], dim=-1)
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("release", ["2.14.0"], indirect=True)
def test_the_routing_map_permute_node_saves_the_map_and_the_sorted_indices(release: str
                                                                           ) -> None:
    """``NpuMoeTokenPermuteWithRoutingMapBackward0`` (2.7.1 .. 2.14.0): ``routing_map_`` and
    ``result2_`` only, not the tokens nor the probs (their row count and dtype suffice), while
    the gradients are those of the node that saves everything."""
    import torch_npu

    n, e = 6, 4
    rmap = torch.zeros(n, e, dtype=torch.bool)
    for i in range(n):
        rmap[i, [i % e, (i + 1) % e]] = True
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(n, 8, generator=gen).to(BF16).requires_grad_()
    probs = torch.rand(n, e, generator=gen).to(BF16).requires_grad_()
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        permuted, permuted_probs, sorted_indices = torch_npu.npu_moe_token_permute_with_routing_map(
            tokens, rmap, probs=probs, num_out_tokens=2 * n)
    assert sorted({_storage(t) for t in kept}) == sorted({_storage(rmap),
                                                           _storage(sorted_indices)})
    (permuted.float().sum() + permuted_probs.float().sum()).backward()
    assert tokens.grad is not None and probs.grad is not None
    # each token row is sent to two experts: its gradient is 2 in every element
    torch.testing.assert_close(tokens.grad.float(), torch.full((n, 8), 2.0))


@pytest.mark.parametrize("release", ["2.14.0"], indirect=True)
def test_the_cross_entropy_node_does_not_keep_the_logits(release: str) -> None:
    """``NpuCrossEntropyLossBackward0``: ``target_``, ``weight_``, ``result1_`` (log_prob),
    ``result3_`` (lse): the logits, a large-vocabulary model's largest activation, are not kept
    for backward, and the gradient is softmax minus one-hot."""
    import torch_npu

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=gen, requires_grad=True)
    target = torch.tensor([1, 3, 5, 7])
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss, log_prob, _, _ = torch_npu.npu_cross_entropy_loss(logits, target, reduction="sum")
    storages = {_storage(t) for t in kept}
    assert _storage(logits) not in storages
    assert {_storage(target), _storage(log_prob)} <= storages
    loss.backward()
    expected = torch.softmax(logits.detach(), -1) - torch.nn.functional.one_hot(target, 10)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-4, atol=1e-5)


# The permute node's list changes inside one line of releases (the wheels' Functions.h, read into
# the digest): 2.7.1.post6 saves tokens, indices and sorted_indices (result1), 2.7.1.post8 (the v2
# grad op) only sorted_indices.  The emulation keeps what the installed release's node keeps.
@pytest.mark.parametrize(("release", "kept"), [("2.7.1.post6", {"tokens", "indices", 1}),
                                               ("2.7.1.post8", {1})], indirect=["release"])
def test_the_permute_node_keeps_what_the_installed_release_keeps(release: str, kept: set[Any]
                                                                 ) -> None:
    import torch_npu

    from opcontracts.wheel import digest

    assert set(digest.load().release(release).node_saves("npu_moe_token_permute") or ()) == kept
    tokens = torch.randn(6, 16).to(BF16).requires_grad_()
    indices = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
    named = {"tokens": tokens, "indices": indices, 1: sorted_indices}
    assert {_storage(t) for t in saved} == {_storage(named[k]) for k in kept}
    permuted.float().sum().backward()  # the backward runs on what was kept
    assert tokens.grad is not None and torch.equal(tokens.grad, torch.full_like(tokens, 2))
