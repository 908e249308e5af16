"""The grouped GEMM family through ``import opcontracts.patch`` on the CPU emulation (issue 15).

Per op: conforming calls pass in strict mode; each rule's violation is caught naming the
argument; fix mode repairs what it can and the gradients still reach the caller (ops trained
through); one ``torch.compile`` call through the fake; the reference's math against a plain
formula.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _strict import violation as _violation

import opcontracts
from opcontracts import ContractFixWarning, ContractViolation
from opcontracts.reference import _matmul

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I8, I32, I64 = torch.int8, torch.int32, torch.int64


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vals(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in every float dtype."""
    return (torch.randint(-16, 17, shape, generator=_g(seed)) / 8).to(dtype)


def _ints(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-8, 8, shape, generator=_g(seed)).to(I8)


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
    # int8 x and weight without any scale is the int8|int8|int32 mode (op-plugin master's doc
    # row; vllm-ascend's W8A8 MC2 gate_up): the contract lets it through (issue 23)
    opcontracts.check("npu_grouped_matmul", x, w, group_list=gl, split_item=3, group_type=0,
                      output_dtype=torch.int32)
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


def test_grouped_matmul_list_group_list_is_the_list_overload(npu: Any) -> None:
    """torch_npu's ``npu_grouped_matmul.List`` takes group_list as a list of ints (the
    emulation registers it with the default overload's kernel, fake and backward); through the
    guarded packet a list picks it, conforms and computes what the tensor call computes (no
    derivative, like the default overload: ``_no_derivative``); the list's values are checked
    like the tensor's (opt-in)."""
    x, w, kw = _gmm_grouped()
    assert "List" in torch.ops.npu.npu_grouped_matmul.overloads()
    xs, ws = [x[0].clone().requires_grad_()], [w[0].clone().requires_grad_()]
    with opcontracts.mode("strict"):
        (y,) = npu.npu_grouped_matmul(xs, ws, **{**kw, "group_list": [2, 5, 6]})
        (want,) = npu.npu_grouped_matmul(x, w, **kw)
        (direct,) = torch.ops.npu.npu_grouped_matmul.List(x, w, **{**kw, "group_list": [2, 5, 6]})
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(direct, want)
    _no_derivative(y, *xs, *ws)
    assert not opcontracts.report()
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_grouped_matmul, x, w, **{**kw, "group_list": [2, 5, 7]})
    assert (exc.arg, exc.rule) == ("group_list", "value")

    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.ops.npu.npu_grouped_matmul([t], w, **{**kw, "group_list": [2, 5, 6]})[0]

    opcontracts.set_value_checks(False)
    torch._dynamo.reset()
    try:
        with opcontracts.mode("strict"):
            out = torch.compile(f, backend="aot_eager", fullgraph=True)(x[0])
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, want)


def _no_derivative(out: torch.Tensor, *leaves: torch.Tensor) -> None:
    """What a backward through an op without a derivative does on the NPU: torch_npu registers
    no autograd kernel for it (no ``derivatives.yaml`` entry, no ``VariableType`` kernel in
    ``libtorch_npu.so``), so torch's autograd fallback (torch_npu's ``VariableFallbackKernel.cpp``,
    mode ``warn``) warns and sends its inputs no gradient.  MindSpeed's own autograd.Functions
    (``npu_gmm``, the MC2 wrappers) supply the backward where training needs one."""
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        out.float().sum().backward()
    assert all(t.grad is None for t in leaves)


def test_grouped_matmul_fix_casts_the_bias_and_has_no_derivative(npu: Any) -> None:
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
    _no_derivative(y, x[0], *ws, *bias)


def test_grouped_matmul_k_split_matches_plain_pytorch(npu: Any) -> None:
    xt = _vals(6, 8).T.contiguous()  # (M=8, K=6)
    dy = _vals(6, 5, seed=1)
    (y,) = npu.npu_grouped_matmul([xt], [dy], group_list=torch.tensor([2, 5, 6]), split_item=3,
                                  group_type=2, group_list_type=0)
    x2, d2 = xt.float(), dy.float()
    ref = torch.stack([x2[:, a:b] @ d2[a:b] for a, b in [(0, 2), (2, 5), (5, 6)]])
    torch.testing.assert_close(y.float(), ref.to(BF16).float())


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


# =========================================================================== finalize routing
def _finalize_args(**change: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from opcontracts.reference import _fam_gemm_comm as fam

    args, kwargs = fam.finalize_routing_example(_g())
    kwargs.update(change)
    return args, kwargs


def test_finalize_routing_conforming_call_and_its_math(npu: Any) -> None:
    (x, w, gl), kw = _finalize_args()
    with opcontracts.mode("strict"):
        y = npu.npu_grouped_matmul_finalize_routing(x, w, gl, **kw)
    assert y.shape == (4, 256) and y.dtype == FP32
    # per row: (x @ w[expert]) * scale[expert] * pertoken_scale * logit, scatter-added at
    # row_index; the shared expert's output added at rows [offset, offset + rows)
    expert = torch.repeat_interleave(torch.arange(2), gl)
    mm = torch.stack([(x[i].float() @ w[expert[i]].float()) * kw["scale"][expert[i]]
                      for i in range(x.size(0))])
    mm = mm * (kw["pertoken_scale"] * kw["logit"]).unsqueeze(1)
    want = torch.zeros(4, 256)
    want[1:3] += kw["shared_input"].float()
    want.index_add_(0, kw["row_index"], mm)
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"x": _ints(8, 24)}, "x", "shape"),  # k a multiple of 16
    ({"w": _ints(2, 32)}, "w", "rank"),
    ({"group_list": torch.tensor([3, 5], dtype=I32)}, "group_list", "dtype"),
    ({"scale": torch.ones(2, 128)}, "scale", "shape"),  # (e, n) with w's n
    ({"pertoken_scale": torch.ones(7)}, "pertoken_scale", "shape"),
    ({"shared_input": torch.zeros(2, 256, dtype=FP16)}, "shared_input", "dtype"),
    ({"logit": torch.ones(16)[::2]}, "logit", "contiguous"),
    ({"row_index": torch.zeros(8, dtype=I32).to(torch.int16)}, "row_index", "dtype"),
    ({"group_list_type": 2}, "group_list_type", "allowed"),
    ({"output_bs": -1}, "output_bs", "bound"),
])
def test_finalize_routing_each_rule_names_its_argument(npu: Any, change: dict[str, Any],
                                                       arg: str, rule: str) -> None:
    (x, w, gl), kw = _finalize_args()
    pos = {"x": x, "w": w, "group_list": gl}
    pos.update({k: v for k, v in change.items() if k in pos})
    kw.update({k: v for k, v in change.items() if k not in pos})
    exc = _violation(npu.npu_grouped_matmul_finalize_routing, pos["x"], pos["w"],
                     pos["group_list"], **kw)
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_finalize_routing_2_5_1_takes_fp16_shared_input(npu: Any) -> None:
    """The 2.5.1 doc lists bf16 and fp16 for shared_input; every later one bf16 only."""
    (x, w, gl), kw = _finalize_args(shared_input=torch.zeros(2, 256, dtype=FP16))
    opcontracts.set_versions(torch_npu="2.5.1")
    try:
        with opcontracts.mode("strict"):
            npu.npu_grouped_matmul_finalize_routing(x, w, gl, **kw)
    finally:
        opcontracts.set_versions(torch_npu=None)


def test_finalize_routing_negative_row_index_needs_value_checks(npu: Any) -> None:
    (x, w, gl), kw = _finalize_args()
    kw["row_index"] = kw["row_index"].clone()
    kw["row_index"][0] = -1
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_grouped_matmul_finalize_routing, x, w, gl, **kw)
    assert (exc.arg, exc.rule) == ("row_index", "value")


def test_finalize_routing_compiles_through_the_fake(npu: Any) -> None:
    (x, w, gl), kw = _finalize_args()

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.npu.npu_grouped_matmul_finalize_routing(x, w, gl, **kw) * 2

    torch._dynamo.reset()
    with opcontracts.mode("strict"):
        out = torch.compile(f, backend="eager")(x)
    torch.testing.assert_close(out, f(x))
    torch._dynamo.reset()


# =========================================================================== all-to-all GEMMs
E_LOCAL, WORLD = 2, 8
COUNTS = [1, 2, 0, 1, 1, 0, 2, 1] + [0] * 8  # counts[r * e + j], e = 2 local experts


def _a2a(dtype: torch.dtype = BF16, h: int = 8, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return _vals(sum(COUNTS), h, dtype=dtype), _vals(E_LOCAL, h, n, dtype=dtype, seed=1)


def test_alltoallv_gmm_conforming_calls_and_the_loopback_round_trip(npu: Any) -> None:
    x, _ = _a2a()
    eye = torch.eye(8, dtype=BF16).expand(E_LOCAL, 8, 8).contiguous()
    with opcontracts.mode("strict"):
        y, mm_y, permuted = npu.npu_alltoallv_gmm(x, eye, "ep", WORLD, COUNTS, COUNTS,
                                                  permute_out_flag=True)
        back, none = npu.npu_gmm_alltoallv(permuted, eye, "ep", WORLD, COUNTS, COUNTS)
    assert mm_y is None and none is None
    torch.testing.assert_close(y, permuted)  # identity experts: the permuted tokens
    torch.testing.assert_close(back, x)  # permute, then unpermute: the tokens come home
    # expert-major: expert 0's rows from every rank first
    blocks = x.split(COUNTS)
    order = [blocks[r * E_LOCAL + j] for j in range(E_LOCAL) for r in range(WORLD)]
    torch.testing.assert_close(permuted, torch.cat(order))


def test_alltoallv_gmm_at_world_size_one_is_the_grouped_matmul() -> None:
    """The reference at world size 1 (the collective is the identity), against plain math."""
    from opcontracts.reference import _fam_gemm_comm as fam

    x, w = _vals(5, 8, dtype=FP32), _vals(2, 8, 4, dtype=FP32, seed=1)
    mm_x, mm_w = _vals(3, 8, dtype=FP32, seed=2), _vals(4, 8, dtype=FP32, seed=3)
    y, mm_y, _ = fam.npu_alltoallv_gmm(x, w, "ep", 1, [2, 3], [2, 3], mm_x=mm_x,
                                       mm_weight=mm_w, trans_mm_weight=True)
    torch.testing.assert_close(y, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
    torch.testing.assert_close(mm_y, mm_x @ mm_w.T)
    out, _ = fam.npu_gmm_alltoallv(x, w.transpose(1, 2), "ep", 1, [2, 3], [2, 3],
                                   trans_gmm_weight=True)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))


@pytest.mark.parametrize("op", ["npu_alltoallv_gmm", "npu_gmm_alltoallv"])
@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"ep_world_size": 4}, "ep_world_size", "allowed"),
    ({"send_counts": COUNTS[:2], "recv_counts": COUNTS[:2]}, "ep_world_size", "bound"),
    ({"recv_counts": COUNTS[:14]}, "recv_counts", "shape"),
    ({"gmm_weight": _vals(2, 8, 4, dtype=FP16)}, "gmm_weight", "same_dtype"),
    ({"gmm_x": _vals(9, 8, dtype=FP32), "gmm_weight": _vals(2, 8, 4, dtype=FP32)},
     "gmm_x", "dtype"),
    ({"gmm_weight": _vals(8, 4)}, "gmm_weight", "rank"),
    ({"mm_x": _vals(3, 8, dtype=FP32), "mm_weight": _vals(8, 4)}, "mm_x", "dtype"),
])
def test_alltoallv_gmm_each_rule_names_its_argument(npu: Any, op: str, change: dict[str, Any],
                                                    arg: str, rule: str) -> None:
    x, w = _a2a()
    call = {"gmm_x": x, "gmm_weight": w, "hcom": "ep", "ep_world_size": WORLD,
            "send_counts": COUNTS, "recv_counts": COUNTS, **change}
    exc = _violation(getattr(npu, op), **call)
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_alltoallv_gmm_negative_counts_need_value_checks(npu: Any) -> None:
    x, w = _a2a()
    bad = [-1, *COUNTS[1:]]
    with opcontracts.mode("strict"):
        npu.npu_alltoallv_gmm(x, w, "ep", WORLD, bad, COUNTS)
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_alltoallv_gmm, x, w, "ep", WORLD, bad, COUNTS)
    assert (exc.arg, exc.rule) == ("send_counts", "value")


def test_alltoallv_gmm_fix_casts_fp32_and_has_no_derivative(npu: Any) -> None:
    x, w = (t.requires_grad_() for t in _a2a(FP32))
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y, _, _ = npu.npu_alltoallv_gmm(x, w, "ep", WORLD, COUNTS, COUNTS)
    assert any(issubclass(m.category, ContractFixWarning) for m in seen)
    assert y.dtype == BF16  # the kernel ran on the repaired (bf16) tokens
    _no_derivative(y, x, w)


def test_alltoallv_gmm_compiles_through_the_fake(npu: Any) -> None:
    x, w = _a2a()
    mm_x, mm_w = _vals(3, 8), _vals(8, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        y, mm_y, p = torch.ops.npu.npu_alltoallv_gmm(x, w, "ep", WORLD, COUNTS, COUNTS,
                                                     mm_x=mm_x, mm_weight=mm_w,
                                                     permute_out_flag=True)
        back, _ = torch.ops.npu.npu_gmm_alltoallv(y, w.transpose(1, 2).contiguous(), "ep",
                                                  WORLD, COUNTS, COUNTS)
        return back.sum() + mm_y.sum() + p.sum()

    torch._dynamo.reset()
    with opcontracts.mode("strict"):
        out = torch.compile(f, backend="eager")(x)
    torch.testing.assert_close(out, f(x))
    torch._dynamo.reset()


# =========================================================================== all-gather matmul
def test_all_gather_base_mm_conforming_calls(npu: Any) -> None:
    x, x2 = _vals(2, 256) / 4, _vals(256, 4, seed=1) / 4
    with opcontracts.mode("strict"):
        out, gathered = npu.npu_all_gather_base_mm(x, x2, "tp", 2)
        q, _ = npu.npu_all_gather_base_mm(_ints(2, 256), _ints(256, 4, seed=1), "tp", 4,
                                          x2_scale=torch.full((1, 4), 0.5),
                                          x1_scale=torch.ones(2, 1), gather_output=False)
    torch.testing.assert_close(gathered, torch.cat([x, x]))  # every rank holds this shard
    torch.testing.assert_close(out.float(), (torch.cat([x, x]).float() @ x2.float()).to(
        BF16).float())
    assert q.dtype == BF16 and q.shape == (8, 4)  # dequantized, bf16 by default


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"self": _vals(2, 128), "x2": _vals(128, 4)}, "self", "shape"),  # k in [256, 65535)
    ({"x2": _vals(256, 4, dtype=FP16)}, "x2", "same_dtype"),
    ({"self": _ints(2, 256), "x2": _ints(256, 4)}, "self", "dtype"),  # int8 needs x2_scale
    ({"world_size": 3}, "world_size", "allowed"),
    ({"bias": torch.zeros(4, dtype=FP16)}, "bias", "same_dtype"),
    ({"bias": torch.zeros(5)}, "bias", "dtype"),
    ({"gather_index": 1}, "gather_index", "allowed"),
    ({"comm_turn": 1}, "comm_turn", "allowed"),
    ({"comm_mode": "nccl"}, "comm_mode", "allowed"),
    ({"x2_scale": torch.ones(1, 5)}, "x2_scale", "shape"),
])
def test_all_gather_base_mm_each_rule_names_its_argument(npu: Any, change: dict[str, Any],
                                                         arg: str, rule: str) -> None:
    call = {"self": _vals(2, 256), "x2": _vals(256, 4), "hcom": "tp", "world_size": 2, **change}
    a = [call.pop(k) for k in ("self", "x2", "hcom", "world_size")]
    exc = _violation(npu.npu_all_gather_base_mm, *a, **call)
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_all_gather_base_mm_world_size_per_release(npu: Any) -> None:
    """16 ranks are documented from 2.6.0.post3 on (Atlas A3); 2.5.1's doc says 2, 4, 8."""
    x, x2 = _vals(2, 256), _vals(256, 4)
    with opcontracts.mode("strict"):
        npu.npu_all_gather_base_mm(x, x2, "tp", 16)
    opcontracts.set_versions(torch_npu="2.5.1")
    try:
        exc = _violation(npu.npu_all_gather_base_mm, x, x2, "tp", 16)
        assert (exc.arg, exc.rule) == ("world_size", "allowed")
    finally:
        opcontracts.set_versions(torch_npu=None)


def test_all_gather_base_mm_fix_and_no_derivative(npu: Any) -> None:
    x = (_vals(2, 256, dtype=FP32) / 4).requires_grad_()
    x2 = (_vals(256, 4, dtype=BF16, seed=1) / 4).requires_grad_()
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ContractFixWarning)
        out, _ = npu.npu_all_gather_base_mm(x, x2, "tp", 2)
    assert out.dtype == BF16
    _no_derivative(out, x, x2)


def test_all_gather_base_mm_compiles_through_the_fake(npu: Any) -> None:
    x2 = _vals(256, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        out, gathered = torch.ops.npu.npu_all_gather_base_mm(x, x2, "tp", 2)
        return out.sum() + gathered.sum()

    torch._dynamo.reset()
    x = _vals(2, 256)
    with opcontracts.mode("strict"):
        got = torch.compile(f, backend="eager")(x)
    torch.testing.assert_close(got, f(x))
    torch._dynamo.reset()


# =========================================================================== grouped matmul add
def test_grouped_matmul_add_conforming_call_and_its_math(npu: Any) -> None:
    acc, x, w = _vals(3, 8, 5, dtype=FP32), _vals(6, 8), _vals(6, 5, seed=1)
    gl = torch.tensor([2, 2, 6])  # cumulative; the second group is empty
    with opcontracts.mode("strict"):
        out = npu.npu_grouped_matmul_add(acc, x, w, gl)
    want = acc + torch.stack([x[a:b].float().T @ w[a:b].float()
                              for a, b in [(0, 2), (2, 2), (2, 6)]])
    torch.testing.assert_close(out, want)
    assert out is not acc and bool((acc != out).any())  # the out-of-place variant


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"self": torch.zeros(3, 8, 5, dtype=BF16)}, "self", "dtype"),
    ({"weight": _vals(6, 5, dtype=FP16)}, "weight", "same_dtype"),
    ({"self": torch.zeros(2, 8, 5)}, "group_list", "shape"),  # g groups of group_list
    ({"transpose_x": False}, "transpose_x", "allowed"),
    ({"transpose_weight": True}, "transpose_weight", "allowed"),
    ({"group_type": 0}, "group_type", "allowed"),
    ({"group_list": torch.tensor([2, 2, 6], dtype=I32)}, "group_list", "dtype"),
])
def test_grouped_matmul_add_each_rule_names_its_argument(npu: Any, change: dict[str, Any],
                                                         arg: str, rule: str) -> None:
    call = {"self": torch.zeros(3, 8, 5), "x": _vals(6, 8), "weight": _vals(6, 5),
            "group_list": torch.tensor([2, 2, 6]), **change}
    a = [call.pop(k) for k in ("self", "x", "weight", "group_list")]
    exc = _violation(npu.npu_grouped_matmul_add, *a, **call)
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_grouped_matmul_add_has_no_contract_where_no_doc_speaks_for_it(npu: Any) -> None:
    """2.12.0 has the op in its schema but no doc for it: no contract applies there."""
    opcontracts.set_versions(torch_npu="2.12.0")
    try:
        with opcontracts.mode("strict"):
            npu.npu_grouped_matmul_add(torch.zeros(3, 8, 5, dtype=BF16), _vals(6, 8),
                                       _vals(6, 5), torch.tensor([2, 2, 6]))
    finally:
        opcontracts.set_versions(torch_npu=None)


# =========================================================================== MindSpeed accumulation
@pytest.fixture
def ms(npu: Any) -> Any:
    """MindSpeed's two accumulation modules (stand-ins), CANN 8.0.0 on Atlas A2 (the ATB
    kernel's fp16 restriction, CANN >= 8.1.RC1, left out unless a test asks)."""
    from mindspeed.ops import npu_groupmatmul_add, npu_matmul_add

    opcontracts.set_versions(cann="8.0.0", soc="Ascend910B3")
    try:
        yield npu_matmul_add, npu_groupmatmul_add
    finally:
        opcontracts.set_versions(cann=None, soc=None)


def test_matmul_add_fp32_accumulates_in_place_in_strict_mode(ms: Any) -> None:
    mod, _ = ms
    ti, go = _vals(6, 8), _vals(6, 5, seed=1)
    grad = _vals(5, 8, dtype=FP32, seed=2)
    want = grad + go.float().T @ ti.float()
    with opcontracts.mode("strict"):
        assert mod.npu_matmul_add_fp32(ti, go, grad) is None
        mod.npu_matmul_add_fp32(ti[:0], go[:0], grad)  # empty: nothing, as MindSpeed
        mod.npu_matmul_add_fp32(ti.half(), go.half(), grad)  # MindSpeed's doc: fp16 too
    torch.testing.assert_close(grad, want + go.float().T @ ti.float())
    assert not opcontracts.report()


def test_matmul_add_fp32_bf16_main_grad_is_garbage_unchecked_and_caught(ms: Any) -> None:
    """The kernel writes fp32 into whatever buffer it gets: a bf16 main_grad (Megatron's
    npu_matmul_add_fp16 case) silently turns into garbage; the contract stops it, and fix mode
    refuses to cast it (the accumulation would land in a copy)."""
    mod, _ = ms
    ti, go = _vals(6, 8), _vals(6, 5, seed=1)
    grad = torch.zeros(5, 8, dtype=BF16)
    with opcontracts.mode("off"):
        mod.npu_matmul_add_fp32(ti, go, grad)
    assert not torch.allclose(grad.float(), go.float().T @ ti.float(), atol=0.5)
    for mode in ("strict", "fix"):
        with opcontracts.mode(mode), pytest.raises(ContractViolation) as info:
            mod.npu_matmul_add_fp32(ti, go, torch.zeros(5, 8, dtype=BF16))
        assert (info.value.arg, info.value.rule) == ("grad", "dtype")


@pytest.mark.parametrize(("args", "arg", "rule"), [
    ((_vals(6, 8), _vals(6, 5), torch.zeros(5, 9)), "grad", "shape"),  # (N, K)
    ((_vals(6, 8), _vals(7, 5), torch.zeros(5, 8)), "grad_output", "shape"),  # T
    ((_vals(6, 8, dtype=FP32), _vals(6, 5), torch.zeros(5, 8)), "total_input", "dtype"),
    ((_vals(2, 3, 8), _vals(6, 5), torch.zeros(5, 8)), "total_input", "rank"),
])
def test_matmul_add_fp32_each_rule_names_its_argument(ms: Any, args: tuple[Any, ...], arg: str,
                                                      rule: str) -> None:
    exc = _violation(ms[0].npu_matmul_add_fp32, *args)
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_matmul_add_fp32_fix_casts_the_inputs_never_the_accumulator(ms: Any) -> None:
    ti, go = _vals(6, 8, dtype=FP32), _vals(6, 5, seed=1)
    grad = torch.zeros(5, 8)
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ContractFixWarning)
        ms[0].npu_matmul_add_fp32(ti, go, grad)
    torch.testing.assert_close(grad, go.float().T @ ti.to(BF16).float())


def test_matmul_add_fp32_atb_takes_bf16_only_from_cann_8_1(ms: Any) -> None:
    """The ATB kernel of Atlas A2/A3 does not support fp16 with transposeA (CANN 8.1.RC1 docs),
    which MindSpeed always sets; on Ascend 950 MindSpeed uses addmm_ instead."""
    ti, go, grad = _vals(6, 8, dtype=FP16), _vals(6, 5, dtype=FP16), torch.zeros(5, 8)
    opcontracts.set_versions(cann="8.1.RC1")
    exc = _violation(ms[0].npu_matmul_add_fp32, ti, go, grad)
    assert (exc.arg, exc.rule) == ("total_input", "dtype") and "CANN 8.1.RC1" in exc.source
    exc = _violation(ms[0].npu_matmul_add_fp32, _vals(6, 8), go, grad)
    assert exc.arg == "grad_output"
    opcontracts.set_versions(soc="Ascend950")
    with opcontracts.mode("strict"):
        ms[0].npu_matmul_add_fp32(ti, go, grad)


def test_groupmatmul_add_fp32_accumulates_per_group(ms: Any) -> None:
    _, mod = ms
    x, dy = _vals(6, 8), _vals(6, 5, seed=1)
    grad = _vals(3, 8, 5, dtype=FP32, seed=2)  # a 3-D expert weight's main_grad
    want = grad + torch.stack([x[a:b].float().T @ dy[a:b].float()
                               for a, b in [(0, 2), (2, 2), (2, 6)]])
    with opcontracts.mode("strict"):
        assert mod.npu_groupmatmul_add_fp32(x, dy, torch.tensor([2, 2, 6]), grad) is None
        flat = torch.zeros(3 * 8, 5)  # MindSpeed's 2-D [w1, w2] main_grad
        mod.npu_groupmatmul_add_fp32(x, dy, torch.tensor([2, 2, 6]), flat)
    torch.testing.assert_close(grad, want)
    torch.testing.assert_close(flat.view(3, 8, 5), want - _vals(3, 8, 5, dtype=FP32, seed=2))
    assert not opcontracts.report()


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"dy": _vals(6, 5, dtype=FP16)}, "dy", "same_dtype"),
    ({"grouplist": torch.tensor([2, 2, 6], dtype=I32)}, "grouplist", "dtype"),
    ({"grad": torch.zeros(3 * 8, 5, dtype=BF16)}, "grad", "dtype"),
    ({"dy": _vals(5, 5)}, "dy", "shape"),  # T rows
])
def test_groupmatmul_add_fp32_each_rule_names_its_argument(ms: Any, change: dict[str, Any],
                                                           arg: str, rule: str) -> None:
    call = {"x": _vals(6, 8), "dy": _vals(6, 5), "grouplist": torch.tensor([2, 2, 6]),
            "grad": torch.zeros(3 * 8, 5), **change}
    exc = _violation(ms[1].npu_groupmatmul_add_fp32, *call.values())
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_groupmatmul_add_fp32_values_and_the_atb_group_limit(ms: Any) -> None:
    x, dy = _vals(6, 8), _vals(6, 5)
    opcontracts.set_value_checks(True)  # counts where MindSpeed passes the cumulative ends
    exc = _violation(ms[1].npu_groupmatmul_add_fp32, x, dy, torch.tensor([2, 0, 4]),
                     torch.zeros(3 * 8, 5))
    assert (exc.arg, exc.rule) == ("grouplist", "value") and "decreases" in str(exc)
    opcontracts.set_value_checks(False)
    many = torch.full((129,), 6)
    opcontracts.set_versions(cann="8.1.RC1")  # ATB (A2/A3): at most 128 groups
    exc = _violation(ms[1].npu_groupmatmul_add_fp32, x, dy, many, torch.zeros(129 * 8, 5))
    assert (exc.arg, exc.rule) == ("grouplist", "shape") and "128" in exc.expected


def test_group_list_follows_group_list_type(npu: Any) -> None:
    """group_type 0: group_list is a cumsum ending at or before x's rows (type 0, the default)
    or group sizes summing to at most them (type 1: the rows past them are a buffer's unused
    tail, issue 23); with value checks on, the other reading is a violation."""
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    w = torch.randn(2, 4, 3, dtype=torch.bfloat16)
    gmm = npu.npu_grouped_matmul
    opcontracts.set_value_checks(True)
    try:
        with opcontracts.mode("strict"):
            gmm([x], [w], group_list=torch.tensor([2, 6]), split_item=2, group_type=0)
            gmm([x], [w], group_list=torch.tensor([2, 4]), split_item=2, group_type=0,
                group_list_type=1)
            gmm([x], [w], group_list=torch.tensor([2, 4]), split_item=2, group_type=0)
        for kw in ({"group_list": torch.tensor([4, 2])},
                   {"group_list": torch.tensor([2, 6]), "group_list_type": 1}):
            with opcontracts.mode("strict"), pytest.raises(ContractViolation) as info:
                gmm([x], [w], split_item=2, group_type=0, **kw)
            assert info.value.arg == "group_list" and "when group_type = 0" in info.value.expected
    finally:
        opcontracts.set_value_checks(False)
