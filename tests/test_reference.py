"""``opcontracts.reference``: one plain-PyTorch reference per shipped op, looked up by op name.

The references are the emulation's kernels (with a dtype profile on top), the shadow compare's
golden values and the probe's yardstick; these tests hold them to what each of those needs:
every shipped and emulated op has one, lookups accept the names contracts and targets use,
autograd through the forward agrees with the composite backward formulas the emulation runs,
and no reference writes into its inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from opcontracts import reference
from opcontracts._engine import registry
from opcontracts.emulation import OP_NAMES
from opcontracts.reference._unmodelled import UNMODELLED


def _example(name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    ref = reference.get(name)
    assert ref is not None and ref.example is not None, name
    return ref.example(torch.Generator().manual_seed(0))


def test_every_shipped_contract_op_and_every_emulated_op_has_a_reference_and_example() -> None:
    registry.load_shipped()
    ops = {c.op for c in registry.all_contracts()} | set(OP_NAMES)
    # the documented exceptions (reference._unmodelled): shipped, not emulated, no reference
    assert not set(UNMODELLED) & set(OP_NAMES)
    assert not [op for op in UNMODELLED if reference.get(op) is not None]
    ops -= set(UNMODELLED)
    missing = [op for op in sorted(ops) if reference.get(op) is None]
    assert missing == []
    no_example = [op for op in sorted(ops) if reference.get(op).example is None]  # type: ignore[union-attr]
    assert no_example == []
    for op in ops:
        ref = reference.get(op)
        assert ref is not None and ref.source, op  # every reference says what it follows


@pytest.mark.parametrize(("name", "key"), [
    ("npu_swiglu", "npu_swiglu"),
    ("torch.ops.npu.npu_swiglu", "npu_swiglu"),
    ("torch.ops.npu.npu_swiglu.default", "npu_swiglu"),
    ("torch_npu.npu_swiglu", "npu_swiglu"),
    ("npu::npu_swiglu", "npu_swiglu"),
    ("mindspeed.ops.gmm.npu_gmm", "mindspeed.npu_gmm"),
    ("mindspeed.npu_gmm", "mindspeed.npu_gmm"),
])
def test_lookup_accepts_op_names_and_target_paths(name: str, key: str) -> None:
    ref = reference.get(name)
    assert ref is not None and ref.name == key


def test_register_replace_and_unregister() -> None:
    def mine(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    try:
        ref = reference.register("tests.my_op", mine, source="test")
        assert reference.get("tests.my_op") is ref and ref.forward is mine
        assert "tests.my_op" in reference.names()
        with pytest.raises(ValueError, match="already has a reference"):
            reference.register("tests.my_op", mine)
        reference.register("tests.my_op", torch.neg, replace=True)
        assert reference.get("tests.my_op").forward is torch.neg  # type: ignore[union-attr]
        with pytest.raises(TypeError, match="callable"):
            reference.register("tests.other", 3)  # type: ignore[arg-type]
    finally:
        reference.unregister("tests.my_op")
    assert reference.get("tests.my_op") is None


def _float_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


@pytest.mark.parametrize("name", [n for n in sorted(OP_NAMES)
                                  if reference.get(n) is not None
                                  and reference.get(n).backward is not None])  # type: ignore[union-attr]
def test_autograd_through_the_forward_agrees_with_the_backward_formula(name: str) -> None:
    """The compare judges gradients against autograd through the forward; the emulation runs
    the composite formula: two derivations of one gradient must agree (fp64, so rounding
    cannot hide a wrong formula)."""
    ref = reference.get(name)
    assert ref is not None and ref.backward is not None
    args, kwargs = _example(name)
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.double().requires_grad_() if t.is_floating_point() else t,
        (args, kwargs))
    out = ref.forward(*args, **kwargs)
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point()
             and o.requires_grad and o.numel() else None for o in outs]
    inputs = _float_leaves((args, kwargs))
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    auto = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                               allow_unused=True)
    import inspect

    names = list(inspect.signature(ref.forward).parameters)
    bound = inspect.signature(ref.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    flat_out, spec = pytree.tree_flatten(out)
    it = iter(grads)
    grad_tree = pytree.tree_unflatten(
        [next(it) if isinstance(o, torch.Tensor) else None for o in flat_out], spec)
    formula = ref.backward({n: bound.arguments[n] for n in names},
                           pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out), grad_tree)
    by_id = {id(t): g for t, g in zip(inputs, auto)}
    compared = 0
    for arg, g in formula.items():
        if g is None:
            continue
        value = bound.arguments[arg]
        for t, gf in zip(pytree.tree_leaves(value), pytree.tree_leaves(g)):
            expected = by_id.get(id(t))
            if expected is None:
                expected = torch.zeros_like(t)
            torch.testing.assert_close(gf.double(), expected.double(), rtol=1e-6, atol=1e-6,
                                       msg=f"{name}: gradient of {arg}")
            compared += 1
    assert compared, name


@pytest.mark.parametrize("name", sorted(set(OP_NAMES) | {"mindspeed.npu_gmm",
                                                         "mindspeed.npu_ring_attention_update"}))
def test_references_never_write_into_their_inputs(name: str) -> None:
    args, kwargs = _example(name)
    before = [t.clone() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    reference.get(name).forward(*args, **kwargs)  # type: ignore[union-attr]
    after = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_out_of_range_rows_are_zero_and_the_callers_tensors_untouched() -> None:
    from opcontracts.reference import _moe
    from opcontracts.reference._util import gather_rows, scatter_add_rows

    src = torch.tensor([[float("inf"), 1.0], [2.0, 3.0]])
    # an index past the end reads no row: zeros, not the clamped row times zero (inf * 0 = nan)
    assert gather_rows(src, torch.tensor([1, 5, -1])).tolist() == [[2.0, 3.0], [0.0, 0.0], [0.0, 0.0]]
    out, rows = torch.zeros(2, 2), src.clone()
    assert scatter_add_rows(out, torch.tensor([0, 7]), rows).tolist() == [[float("inf"), 1.0], [0.0, 0.0]]
    assert out.tolist() == [[0.0, 0.0], [0.0, 0.0]] and torch.equal(rows, src)  # out of place
    grad, permuted = torch.randn(4, 3), torch.randn(4, 3)
    before = grad.clone()
    _moe.npu_moe_token_unpermute_grad(permuted, grad, torch.tensor([0, 1, 9, -2], dtype=torch.int32))
    assert torch.equal(grad, before)
