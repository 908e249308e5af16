"""The grouped GEMM family through ``import opcontracts.patch`` on the CPU emulation (issue 15).

Per op: conforming calls pass in strict mode; each rule's violation is caught naming the
argument; fix mode repairs what it can and the gradients still reach the caller (ops trained
through); one ``torch.compile`` call through the fake; the reference's math against a plain
formula.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import opcontracts
from opcontracts import ContractFixWarning, ContractViolation, emulation, patch
from opcontracts.reference import _matmul

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I8, I32, I64 = torch.int8, torch.int32, torch.int64


@pytest.fixture
def npu() -> Iterator[Any]:
    """The emulation (narrow profile) and the patch, both put back afterwards; the stand-in
    ``torch_npu`` module."""
    was = patch.is_applied()
    patch.unpatch()
    emulation.install()
    patch.apply()
    import torch_npu

    try:
        yield torch_npu
    finally:
        patch.unpatch()
        emulation.uninstall()
        opcontracts.set_value_checks(False)
        if was:
            patch.apply()


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vals(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in every float dtype."""
    return (torch.randint(-16, 17, shape, generator=_g(seed)) / 8).to(dtype)


def _ints(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-8, 8, shape, generator=_g(seed)).to(I8)


def _violation(fn: Any, *args: Any, **kwargs: Any) -> ContractViolation:
    with opcontracts.mode("strict"), pytest.raises(ContractViolation) as info:
        fn(*args, **kwargs)
    return info.value


# =========================================================================== npu_grouped_matmul
def _gmm_grouped(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
    """MindSpeed's call: one x (M, K), one 3-D weight (E, K, N), cumulative group_list."""
    return [_vals(6, 8, seed=seed)], [_vals(3, 8, 5, seed=seed + 1)], {
        "group_list": torch.tensor([2, 5, 6]), "split_item": 3, "group_type": 0,
        "group_list_type": 0}


def test_grouped_matmul_conforming_calls_pass_strict(npu: Any) -> None:
    x, w, kw = _gmm_grouped()
    with opcontracts.mode("strict"):
        (y,) = npu.npu_grouped_matmul(x, w, **kw)
        ref = torch.cat([x[0][a:b].float() @ w[0][g].float()
                         for g, (a, b) in enumerate([(0, 2), (2, 5), (5, 6)])])
        torch.testing.assert_close(y.float(), ref.to(BF16).float())
        # counts (group_list_type 1), list weights with fp32 bias (the doc's bf16 row)
        ws = [_vals(8, 5, seed=s) for s in range(3)]
        bias = [_vals(5, dtype=FP32, seed=s) for s in range(3)]
        (y2,) = npu.npu_grouped_matmul(x, ws, bias=bias, group_list=torch.tensor([2, 3, 1]),
                                       split_item=2, group_type=0, group_list_type=1)
        assert y2.shape == (6, 5) and y2.dtype == BF16
        # list mode (group_type -1): one output per pair, 3-D x with split_item 0
        outs = npu.npu_grouped_matmul([_vals(2, 3, 8), _vals(4, 8)], ws[:2], group_type=-1)
        assert [o.shape for o in outs] == [(2, 3, 5), (4, 5)]
        # K split (group_type 2), as MindSpeed's mc2 experts compute weight gradients
        (gw,) = npu.npu_grouped_matmul([_vals(6, 8).T], [_vals(6, 5)], bias=None,
                                       group_list=torch.tensor([2, 3, 1]), split_item=3,
                                       group_type=2, group_list_type=1)
        assert gw.shape == (3, 8, 5)
    assert not opcontracts.report()


def test_grouped_matmul_quantized_modes_pass_only_with_their_scales(npu: Any) -> None:
    x, w = [_ints(6, 8)], [_ints(3, 8, 5, seed=1)]
    gl = torch.tensor([2, 5, 6])
    scale, pts = [torch.rand(3, 5, generator=_g(2)) + 0.5], [torch.rand(6, generator=_g(3))]
    with opcontracts.mode("strict"):
        # per-token quantization (int8 x and weight, fp32 scales), bf16 out: vllm-ascend's w8a8
        (y,) = npu.npu_grouped_matmul(x, w, scale=scale, per_token_scale=pts, group_list=gl,
                                      split_item=2, group_type=0, output_dtype=BF16)
        # antiquant: bf16 x, int8 weight with its bf16 scale
        (y2,) = npu.npu_grouped_matmul([_vals(6, 8)], w, antiquant_scale=[_vals(3, 5) + 3],
                                       group_list=gl, split_item=3, group_type=0)
    assert y.dtype == BF16 and y.shape == (6, 5) and y2.dtype == BF16
    rows = [(0, 2), (2, 5), (5, 6)]
    want = torch.cat([(x[0][a:b].float() @ w[0][g].float()) * scale[0][g] * pts[0][a:b, None]
                      for g, (a, b) in enumerate(rows)])
    torch.testing.assert_close(y.float(), want.to(BF16).float())
    exc = _violation(npu.npu_grouped_matmul, x, w, group_list=gl, split_item=2, group_type=0)
    assert (exc.arg, exc.rule) == ("x[0]", "dtype")
    assert "int8 when scale is passed" in exc.expected
    exc = _violation(npu.npu_grouped_matmul, [_vals(6, 8)], w, group_list=gl, split_item=2,
                     group_type=0)
    assert (exc.arg, exc.rule) == ("weight[0]", "dtype")
    # int32 bias belongs to the quantized mode only
    exc = _violation(npu.npu_grouped_matmul, [_vals(6, 8)], [_vals(3, 8, 5)],
                     bias=[torch.zeros(3, 5, dtype=I32)], group_list=gl, split_item=2,
                     group_type=0)
    assert (exc.arg, exc.rule) == ("bias[0]", "dtype")


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"bias": [torch.zeros(5, dtype=BF16)] * 3}, "bias[0]", "dtype"),  # the doc: fp32 with bf16
    ({"group_list": torch.tensor([2, 5, 6], dtype=I32)}, "group_list", "dtype"),
    ({"group_list": torch.tensor([[2, 5, 6]])}, "group_list", "rank"),
    ({"group_type": 1}, "group_type", "allowed"),
    ({"split_item": 4}, "split_item", "allowed"),
    ({"group_list_type": 2}, "group_list_type", "allowed"),
    ({"act_type": 3}, "act_type", "allowed"),  # "3: not supported"
    ({"scale": [torch.ones(5, dtype=FP16)]}, "scale[0]", "dtype"),
    ({"per_token_scale": [torch.ones(6, dtype=BF16)]}, "per_token_scale[0]", "dtype"),
])
def test_grouped_matmul_each_rule_names_its_argument(npu: Any, change: dict[str, Any], arg: str,
                                                     rule: str) -> None:
    x, w, kw = _gmm_grouped()
    exc = _violation(npu.npu_grouped_matmul, x, w, **{**kw, **change})
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_grouped_matmul_list_limits_and_group_count(npu: Any) -> None:
    ws = [_vals(8, 2)] * 129
    exc = _violation(npu.npu_grouped_matmul, [_vals(1, 8)] * 129, ws, group_type=-1)
    assert (exc.arg, exc.rule) == ("x", "list_len")
    x, w, kw = _gmm_grouped()
    exc = _violation(npu.npu_grouped_matmul, x, w, **{**kw, "group_list": torch.arange(1025)})
    assert (exc.arg, exc.rule) == ("group_list", "shape") and "1024" in exc.expected
    exc = _violation(npu.npu_grouped_matmul, [_vals(6, 8)], [_vals(1, 1, 8, 5)], **kw)
    assert (exc.arg, exc.rule) == ("weight[0]", "rank")


def test_grouped_matmul_negative_group_sizes_need_value_checks(npu: Any) -> None:
    x, w, kw = _gmm_grouped()
    bad = {**kw, "group_list": torch.tensor([2, -1, 6]), "group_list_type": 1}
    with opcontracts.mode("strict"):
        npu.npu_grouped_matmul(x, w, **bad)  # off by default: values are not read
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_grouped_matmul, x, w, **bad)
    assert (exc.arg, exc.rule) == ("group_list", "value") and "negative" in str(exc)


def test_grouped_matmul_list_group_list_is_the_list_overload() -> None:
    """torch_npu's ``npu_grouped_matmul.List`` takes group_list as a list of ints; the contract
    accepts it (the emulation registers the Tensor overload only, so check() is used)."""
    x, w, kw = _gmm_grouped()
    opcontracts.check("npu_grouped_matmul", x, w, **{**kw, "group_list": [2, 5, 6]})


def test_grouped_matmul_fix_casts_the_bias_and_gradients_reach_the_caller(npu: Any) -> None:
    x = [_vals(6, 8).requires_grad_()]
    ws = [_vals(8, 5, seed=s).requires_grad_() for s in range(3)]
    bias = [_vals(5, seed=s).requires_grad_() for s in range(3)]  # bf16: the doc wants fp32
    gl = torch.tensor([2, 5, 6])
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        (y,) = npu.npu_grouped_matmul(x, ws, bias=bias, group_list=gl, split_item=3,
                                      group_type=0)
    assert any(issubclass(w.category, ContractFixWarning) for w in seen)
    want = _matmul.npu_grouped_matmul(x, ws, bias=[b.float() for b in bias], group_list=gl,
                                      split_item=3, group_type=0)[0]
    torch.testing.assert_close(y, want)
    y.float().sum().backward()
    for t in (x[0], *ws, *bias):
        assert t.grad is not None and t.grad.dtype == t.dtype and bool(t.grad.abs().sum() > 0)
    torch.testing.assert_close(bias[1].grad, torch.full((5,), 3.0, dtype=BF16))  # 3 rows


def test_grouped_matmul_k_split_gradients_match_plain_pytorch(npu: Any) -> None:
    xt = _vals(6, 8).T.contiguous().requires_grad_()  # (M=8, K=6)
    dy = _vals(6, 5, seed=1).requires_grad_()
    (y,) = npu.npu_grouped_matmul([xt], [dy], group_list=torch.tensor([2, 5, 6]), split_item=3,
                                  group_type=2, group_list_type=0)
    x2, d2 = xt.detach().float().requires_grad_(), dy.detach().float().requires_grad_()
    ref = torch.stack([x2[:, a:b] @ d2[a:b] for a, b in [(0, 2), (2, 5), (5, 6)]])
    torch.testing.assert_close(y.float(), ref.to(BF16).float())
    up = _vals(*y.shape, dtype=FP32, seed=4)  # exact in bf16: both sides see the same grads
    (y.float() * up).sum().backward()
    (ref * up).sum().backward()
    torch.testing.assert_close(xt.grad.float(), x2.grad.to(BF16).float())  # type: ignore[union-attr]
    torch.testing.assert_close(dy.grad.float(), d2.grad.to(BF16).float())  # type: ignore[union-attr]


def test_grouped_matmul_compiles_through_the_fake(npu: Any) -> None:
    x, w, kw = _gmm_grouped()
    w = [w[0].float().requires_grad_()]
    x = [x[0].float()]

    def f(x0: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
        (y,) = torch.ops.npu.npu_grouped_matmul([x0], [w0], **kw)
        (gw,) = torch.ops.npu.npu_grouped_matmul([x0.T], [y], group_list=kw["group_list"],
                                                 split_item=3, group_type=2)
        return y.sum() + gw.sum()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(x[0], w[0])
    assert explain.graph_break_count == 0
    with opcontracts.mode("strict"):
        out = torch.compile(f, backend="eager")(x[0], w[0])
    torch.testing.assert_close(out, f(x[0], w[0]))
    torch._dynamo.reset()


def test_grouped_matmul_reference_antiquant_int4_and_activations() -> None:
    # per-group antiquant: (w + offset) * scale, 2 groups of 4 rows along K
    x, w = _vals(3, 8, dtype=FP32), _ints(8, 5)
    s, o = torch.rand(2, 5, generator=_g(1)), _vals(2, 5, dtype=FP32)
    (y,) = _matmul.npu_grouped_matmul([x], [w], antiquant_scale=[s], antiquant_offset=[o],
                                      group_type=-1)
    deq = (w.float() + o.repeat_interleave(4, 0)) * s.repeat_interleave(4, 0)
    torch.testing.assert_close(y, x @ deq)
    # int4 carried in int32: 8 values per element, low nibble first; N grows 8x
    vals = torch.randint(-8, 8, (8, 16), generator=_g(2))
    nib = (vals & 0xF).to(torch.int64)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8).view(I32)
    assert packed.shape == (8, 2)
    torch.testing.assert_close(_matmul.int4_unpack(packed), vals.to(I8))
    (y4,) = _matmul.npu_grouped_matmul([x], [packed], antiquant_scale=[torch.ones(16)],
                                       group_type=-1)
    torch.testing.assert_close(y4, x @ vals.float())
    for act, fn in [(1, torch.relu), (2, lambda t: F.gelu(t, approximate="tanh")),
                    (4, lambda t: t * torch.sigmoid(1.702 * t)), (5, F.silu)]:
        (ya,) = _matmul.npu_grouped_matmul([x], [w.float()], act_type=act, group_type=-1)
        torch.testing.assert_close(ya, fn(x @ w.float()))
    # per-channel requantization to int8: rounded half to even, saturated
    (yq,) = _matmul.npu_grouped_matmul([_ints(3, 8)], [_ints(8, 5, seed=3)],
                                       scale=[torch.full((5,), 0.5)], output_dtype=1,
                                       group_type=-1)
    assert yq.dtype == I8
