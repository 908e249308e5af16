"""fix mode: autograd-tracked casts, integer narrowing only when allowed and safe, no in-place."""

from __future__ import annotations

import warnings

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractFixWarning, ContractViolation

C = Contract("unpermute", {
    "tokens": Arg("bf16", "N*K H"),
    "indices": Arg("int32", "N*K", fix="cast"),
    "probs": Arg("bf16", "N K", optional=True),
})
seen: list[torch.dtype] = []


@opcontracts.enforce(C)
def unpermute(tokens, indices, probs=None):
    seen.append(probs.dtype if probs is not None else None)
    n, k = probs.shape
    rows = tokens[indices.long()].view(n, k, -1)
    return (rows * probs.unsqueeze(-1)).sum(1)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(8, 16, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.randperm(8, generator=g).to(torch.int32)
    probs = torch.softmax(torch.randn(4, 2, generator=g), -1).requires_grad_()  # fp32, as Megatron
    return tokens, idx, probs


def test_fix_casts_and_gradients_match_hand_cast_reference():
    tokens, idx, probs = inputs()
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = unpermute(tokens, idx, probs)
    assert seen[-1] is torch.bfloat16
    assert any(issubclass(x.category, ContractFixWarning) for x in w)
    out.float().pow(2).sum().backward()
    # the caller's fp32 tensor receives its gradient, in its own dtype
    assert probs.grad is not None and probs.grad.dtype is torch.float32
    assert probs.dtype is torch.float32  # never modified in place

    t2, i2, p2 = inputs()
    ref = unpermute.__wrapped__(t2, i2, p2.to(torch.bfloat16))  # the one-line fix, by hand
    ref.float().pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(probs.grad, p2.grad)
    torch.testing.assert_close(tokens.grad, t2.grad)


def test_fix_gradcheck_through_the_cast():
    c = Contract("scale", {"x": Arg("fp64"), "w": Arg(same_dtype_as="x")})

    @opcontracts.enforce(c)
    def scale(x, w):
        assert w.dtype is torch.float64
        return x * w

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float32, requires_grad=True)
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.autograd.gradcheck(lambda a: scale(a, w.detach().double().float()), (x,))
        y = scale(x, w)
    y.sum().backward()
    assert w.grad is not None and w.grad.dtype is torch.float32
    torch.testing.assert_close(w.grad, x.detach().float())


def test_integer_narrowing_only_when_values_fit():
    tokens, idx, probs = inputs()
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unpermute(tokens, idx.long(), probs.detach().bfloat16())
        big = idx.long().clone()
        big[0] = 2**40
        with pytest.raises(ContractViolation, match="indices"):
            unpermute(tokens, big, probs.detach().bfloat16())


def test_integer_narrowing_needs_permission():
    c = Contract("u", {"idx": Arg("int32")})

    @opcontracts.enforce(c)
    def f(idx):
        return idx

    with opcontracts.mode("fix"), pytest.raises(ContractViolation, match="idx"):
        f(torch.arange(3))


def test_shape_violations_are_not_fixed():
    tokens, idx, probs = inputs()
    with opcontracts.mode("fix"), pytest.raises(ContractViolation) as ei:
        unpermute(tokens, idx, probs[:, :1])
    assert ei.value.rule == "shape"


def test_fix_never_and_report_counts_fixes():
    c = Contract("n", {"x": Arg("bf16", fix="never")})

    @opcontracts.enforce(c)
    def f(x):
        return x

    with opcontracts.mode("fix"), pytest.raises(ContractViolation):
        f(torch.ones(2))
    tokens, idx, probs = inputs()
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("default")
        for _ in range(3):
            unpermute(tokens, idx, probs)
    assert len([x for x in w if issubclass(x.category, ContractFixWarning)]) == 1
    rec = [r for r in opcontracts.report().records if r.op == "unpermute"]
    assert rec[0].count == 3 and rec[0].fixed == 3


def test_several_fixes_in_one_call_and_lists_are_copied():
    c = Contract("gmm", {"x": Arg("bf16", list=True), "w": Arg("bf16", list=True)})

    @opcontracts.enforce(c)
    def gmm(x, w):
        return [a.dtype for a in x] + [b.dtype for b in w]

    xs = [torch.ones(2), torch.ones(2, dtype=torch.bfloat16)]
    ws = (torch.ones(2, dtype=torch.float16),)
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert gmm(xs, ws) == [torch.bfloat16] * 3
    assert xs[0].dtype is torch.float32 and ws[0].dtype is torch.float16  # caller's objects intact


def test_contiguous_fix():
    c = Contract("c", {"x": Arg(contiguous=True)})

    @opcontracts.enforce(c)
    def f(x):
        return x.is_contiguous()

    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert f(torch.ones(2, 3).t()) is True


def test_repeated_fixes_at_one_site_replay_and_fall_back_correctly():
    tokens, idx, probs = inputs()
    variants = [
        (idx, probs),                                  # fp32 probs
        (idx, probs.detach().half()),                  # fp16 probs: the cached cast still applies
        (idx.long(), probs.detach().double()),         # a second rule breaks too: slow path
    ]
    seen.clear()
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [unpermute(tokens, i, p) for i, p in variants]  # one call site
    assert seen == [torch.bfloat16] * 3
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0])
    recs = {r.arg: r for r in opcontracts.report().records}
    assert recs["probs"].fixed == 3 and recs["indices"].fixed == 1


def test_same_metadata_at_one_site_takes_the_learnt_repair():
    from opcontracts._engine.violations import _site_cache

    tokens, idx, probs = inputs()
    seen.clear()
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = []
        for _ in range(3):
            p = probs.detach().clone().requires_grad_()
            outs.append((unpermute(tokens, idx, p), p))  # one call site, same metadata
    entries = [e for e in _site_cache.values() if e.same is not None]
    assert len(entries) == 1 and entries[0].casts == ((2, torch.bfloat16),)
    assert seen == [torch.bfloat16] * 3
    for o, p in outs:
        torch.testing.assert_close(o, outs[0][0])
        o.float().sum().backward()  # the replayed cast is autograd-tracked
        assert p.grad is not None and p.dtype is torch.float32  # the caller's tensor untouched
    rec = next(r for r in opcontracts.report().records if r.arg == "probs")
    assert rec.count == 3 and rec.fixed == 3


def test_learnt_repair_is_not_taken_for_other_metadata():
    contig = opcontracts.enforce(Contract("fix_contig", {
        "x": Arg("fp32", "M N", contiguous=True), "w": Arg("fp32", "N")}))(
        lambda x, w: (x.is_contiguous(), x.dtype, w.dtype))
    x = torch.zeros(4, 6)
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [contig(a, w) for a, w in [
            (x.t(), torch.zeros(4)),                     # copied to contiguous
            (x.t(), torch.zeros(4)),                     # the same: learnt repair
            (x.double().t(), torch.zeros(4)),            # another dtype: cast and copy
            (torch.zeros(6, 4), torch.zeros(4).half()),  # contiguous already, w cast
        ]]
    assert got == [(True, torch.float32, torch.float32)] * 4
    with opcontracts.mode("fix"), pytest.raises(ContractViolation):
        contig(torch.zeros(6, 4).t(), torch.zeros(5))  # shape: nothing can repair it
