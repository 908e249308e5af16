"""MindSpeed's MC2 wrappers through ``import opcontracts.patch`` on the CPU emulation.

The wrappers (contracts/mindspeed/mc2.toml) call torch_npu's communication fusions, which stay
guarded underneath: a conforming call passes strict at both levels; a wrong call is caught at
the wrapper, naming the wrapper's argument, and in warn mode it is one record with the inner
ops' violations attached; what only the inner op can see (ep_world_size, read from the process
group) is still caught there.  The process group is the reference's ``LoopbackGroup`` (one
process; the collectives are the emulated ops' loopback).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _strict import violation as _violation

import opcontracts
from opcontracts import ContractFixWarning
from opcontracts.reference import _fam_gemm_comm as ref

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, I64 = torch.int32, torch.int64
WORLD, E, H, N = 8, 2, 8, 4
COUNTS = torch.tensor(ref.MC2_COUNTS)  # counts[r * e + j]: rank 0's exchange, both ways
ROWS = int(COUNTS.sum())


def _vals(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in every float dtype."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(dtype)


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in ts]


def _grads_through_reference(fn: Any, inputs: torch.Tensor, weights: torch.Tensor,
                             *rest: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d(inputs), d(weights) by autograd through the reference, in fp32."""
    x, w = _leaves(inputs.float(), weights.float())
    out = fn(x, w, *rest)
    out.backward(grad.float())
    assert x.grad is not None and w.grad is not None
    return x.grad, w.grad


@pytest.fixture
def mc2(npu: Any) -> Any:
    """mindspeed.ops.grouped_matmul_mc2 (the stand-in), imported under the patch."""
    from mindspeed.ops import grouped_matmul_mc2

    return grouped_matmul_mc2


# =========================================================================== grouped_matmul_mc2
def test_all2all_round_trip_passes_strict_and_trains(mc2: Any) -> None:
    """MindSpeed's FSDP dispatcher: all2all_grouped_matmul, the activation, then
    grouped_matmul_all2all with the counts swapped; identity experts bring the tokens home.
    Gradients equal autograd through the references."""
    group = ref.LoopbackGroup(WORLD)
    x = _vals(ROWS, H)
    eye = torch.eye(H, dtype=BF16).expand(E, H, H).contiguous()
    with opcontracts.mode("strict"):
        there = mc2.all2all_grouped_matmul(x, eye, group, COUNTS, COUNTS.clone())
        back = mc2.grouped_matmul_all2all(there, eye, group, COUNTS.clone(), COUNTS)
    torch.testing.assert_close(back, x)
    blocks = x.split(COUNTS.tolist())  # expert-major in between: expert 0 from every rank first
    torch.testing.assert_close(there, torch.cat([blocks[r * E + j] for j in range(E)
                                                 for r in range(WORLD)]))

    w1, w2 = _vals(E, H, N, seed=1), _vals(E, N, H, seed=2)
    gy1, gy2 = _vals(ROWS, N, seed=3), _vals(ROWS, H, seed=4)
    for fn, w, gy in ((mc2.all2all_grouped_matmul, w1, gy1),
                      (mc2.grouped_matmul_all2all, w2, gy2)):
        xs, ws = _leaves(x if fn is mc2.all2all_grouped_matmul else _vals(ROWS, N, seed=5), w)
        with opcontracts.mode("strict"):
            y = fn(xs, ws, group, COUNTS, COUNTS.clone())
            y.backward(gy)
        want_x, want_w = _grads_through_reference(getattr(ref, fn.__name__), xs, ws, group,
                                                  COUNTS, COUNTS.clone(), grad=gy)
        assert xs.grad is not None and ws.grad is not None
        torch.testing.assert_close(xs.grad.float(), want_x.to(BF16).float())
        torch.testing.assert_close(ws.grad.float(), want_w.to(BF16).float())
    assert not opcontracts.report()


def test_all2all_shared_expert_pair_passes_strict(mc2: Any) -> None:
    group = ref.LoopbackGroup(WORLD)
    mm_x, mm_w = _vals(3, H, seed=1), _vals(H, 5, seed=2)
    with opcontracts.mode("strict"):
        y, shared = mc2.all2all_grouped_matmul(_vals(ROWS, H), _vals(E, H, N), group, COUNTS,
                                               COUNTS, mm_x, mm_w)
    assert y.shape == (ROWS, N)
    torch.testing.assert_close(shared.float(), (mm_x.float() @ mm_w.float()).to(BF16).float())
    assert not opcontracts.report()


@pytest.mark.parametrize("fn", ["all2all_grouped_matmul", "grouped_matmul_all2all"])
@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"inputs": _vals(ROWS, H, dtype=FP32), "weights": _vals(E, H, N, dtype=FP32)},
     "inputs", "dtype"),
    ({"weights": _vals(E, H, N, dtype=FP16)}, "weights", "same_dtype"),
    ({"weights": _vals(E, N, H)}, "weights", "shape"),  # transposed: MindSpeed passes no flag
    ({"send_counts": COUNTS.to(I32)}, "send_counts", "dtype"),  # backward's group_list
    ({"send_counts": COUNTS.tolist()}, "send_counts", "type"),  # .reshape / .tolist()
    ({"recv_counts": COUNTS[:14]}, "recv_counts", "shape"),
    ({"recv_counts": COUNTS.float()}, "recv_counts", "dtype"),
    ({"shared_inputs": _vals(3, H, dtype=FP32), "shared_weight": _vals(H, 5)},
     "shared_inputs", "dtype"),
    ({"shared_inputs": _vals(3, H), "shared_weight": _vals(5, H)}, "shared_weight", "shape"),
])
def test_all2all_each_rule_names_its_argument(mc2: Any, fn: str, change: dict[str, Any],
                                              arg: str, rule: str) -> None:
    call = {"inputs": _vals(ROWS, H), "weights": _vals(E, H, N),
            "group": ref.LoopbackGroup(WORLD), "send_counts": COUNTS, "recv_counts": COUNTS,
            **change}
    exc = _violation(getattr(mc2, fn), **call)
    assert (exc.op, exc.arg, exc.rule) == (f"mindspeed.{fn}", arg, rule), str(exc)
    assert "grouped_matmul_mc2.py" in (exc.source or "")


def test_all2all_inner_op_still_guards_what_the_group_decides(mc2: Any) -> None:
    """ep_world_size comes from the process group, which no rule of the wrapper reads: the
    wrapper conforms and torch_npu's op rejects 4 ranks (the doc: 8/16/32/64)."""
    counts = torch.tensor([1, 2, 0, 1, 1, 0, 2, 1])
    exc = _violation(mc2.all2all_grouped_matmul, _vals(8, H), _vals(E, H, N),
                     ref.LoopbackGroup(4), counts, counts)
    assert (exc.op, exc.arg, exc.rule) == ("npu_alltoallv_gmm", "ep_world_size", "allowed")


def test_all2all_wrong_call_is_one_record_with_the_inner_ops_attached(mc2: Any) -> None:
    """fp32 tokens and weights: one record for the wrapper; torch_npu's forward op and the
    fusion its backward runs (npu_gmm_alltoallv) are nested in it (the K-split
    npu_grouped_matmul of the weight gradient takes fp32)."""
    x, w = _leaves(_vals(ROWS, H, dtype=FP32), _vals(E, H, N, dtype=FP32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = mc2.all2all_grouped_matmul(x, w, ref.LoopbackGroup(WORLD), COUNTS, COUNTS)
        y.sum().backward()
    rep = opcontracts.report()
    assert len(rep.records) == 1, rep.table()
    top = rep.records[0]
    assert (top.op, top.arg) == ("mindspeed.all2all_grouped_matmul", "inputs")
    assert {n["op"] for n in top.nested} == {"npu_alltoallv_gmm", "npu_gmm_alltoallv"}


def test_all2all_unchecked_fp32_is_garbage_and_fix_repairs_it(mc2: Any) -> None:
    """The bf16/fp16 kernel reads fp32 bytes silently; fix casts at the wrapper and the
    gradients reach the caller's fp32 tensors."""
    group = ref.LoopbackGroup(WORLD)
    x, w = _leaves(_vals(ROWS, H, dtype=FP32), _vals(E, H, N, dtype=FP32, seed=1))
    want = ref.all2all_grouped_matmul(x.detach(), w.detach(), group, COUNTS, COUNTS)
    with opcontracts.mode("off"):
        unchecked = mc2.all2all_grouped_matmul(x, w, group, COUNTS, COUNTS)
    assert not torch.allclose(unchecked.float(), want, atol=0.1)
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fixed = mc2.all2all_grouped_matmul(x, w, group, COUNTS, COUNTS)
    assert any(issubclass(m.category, ContractFixWarning) for m in seen)
    assert fixed.dtype == BF16
    torch.testing.assert_close(fixed.float(), want.to(BF16).float())
    fixed.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == FP32 and bool(x.grad.abs().sum() > 0)
    assert w.grad is not None and w.grad.dtype == FP32


def test_all2all_counts_values_are_opt_in(mc2: Any) -> None:
    group = ref.LoopbackGroup(WORLD)
    x, w = _vals(ROWS + 1, N), _vals(E, N, H)  # one row more than send_counts accounts for
    with opcontracts.mode("strict"):
        mc2.grouped_matmul_all2all(x, w, group, COUNTS, COUNTS)
    opcontracts.set_value_checks(True)
    exc = _violation(mc2.grouped_matmul_all2all, x, w, group, COUNTS, COUNTS)
    assert (exc.arg, exc.rule) == ("send_counts", "value") and "sums to" in str(exc)
    bad = COUNTS.clone()
    bad[0] = -1
    exc = _violation(mc2.all2all_grouped_matmul, _vals(ROWS, H), _vals(E, H, N), group, bad,
                     COUNTS)
    assert (exc.arg, exc.rule) == ("send_counts", "value")


def test_all2all_compiles(mc2: Any) -> None:
    group = ref.LoopbackGroup(WORLD)
    w1, w2 = _vals(E, H, N, seed=1), _vals(E, N, H, seed=2)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = mc2.all2all_grouped_matmul(x, w1, group, COUNTS, COUNTS)
        return mc2.grouped_matmul_all2all(y, w2, group, COUNTS, COUNTS)

    x = _vals(ROWS, H)
    torch._dynamo.reset()
    try:
        with opcontracts.mode("strict"):
            out = torch.compile(f, backend="eager")(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, f(x))
    assert not opcontracts.report()


# =========================================================================== mc2_fuse_a2a
TOKENS_PER_EXPERT = torch.tensor([4, 4])  # rows per local expert over every rank (COUNTS)
SEND, RECV = ref.MC2_COUNTS, ref.MC2_COUNTS  # the dispatcher's lists (tolist())


@pytest.fixture
def a2a(npu: Any) -> Any:
    """mindspeed.core.transformer.moe.moe_feature.mc2moe.mc2_fuse_a2a (the stand-in)."""
    from mindspeed.core.transformer.moe.moe_feature.mc2moe import mc2_fuse_a2a

    return mc2_fuse_a2a


def _experts_call(a2a: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  group: Any) -> torch.Tensor:
    """GmmExpertsMC2Impl.forward (experts.py): both GEMMs with (None, None, None) for the
    shared expert, an activation in between."""
    mm1_out, _ = a2a.AlltoallvPermuteGmm.apply(x, w1, group, TOKENS_PER_EXPERT, None, None,
                                               None, SEND, RECV)
    inter = torch.nn.functional.silu(mm1_out)
    up_out, _ = a2a.GmmUnpermuteAlltoallv.apply(inter, w2, group, TOKENS_PER_EXPERT, None,
                                                None, None, SEND, RECV)
    return up_out


def test_fuse_a2a_experts_pass_strict_and_train_as_the_references(a2a: Any) -> None:
    group = ref.LoopbackGroup(WORLD)
    x, w1, w2 = _leaves(_vals(ROWS, H), _vals(E, H, N, seed=1), _vals(E, N, H, seed=2))
    grad = _vals(ROWS, H, seed=3)
    with opcontracts.mode("strict"):
        y = _experts_call(a2a, x, w1, w2, group)
        y.backward(grad)
    assert not opcontracts.report()
    # the same through the references, in fp32
    rx, rw1, rw2 = _leaves(x.float(), w1.float(), w2.float())
    mid, _ = ref.alltoallv_permute_gmm(rx, rw1, group, TOKENS_PER_EXPERT, None, None, None,
                                       SEND, RECV)
    want, _ = ref.gmm_unpermute_alltoallv(torch.nn.functional.silu(mid), rw2, group,
                                          TOKENS_PER_EXPERT, None, None, None, SEND, RECV)
    want.backward(grad.float())
    torch.testing.assert_close(y.float(), want.detach(), atol=0.05, rtol=0.02)
    for got, exp in ((x, rx), (w1, rw1), (w2, rw2)):
        assert got.grad is not None and exp.grad is not None
        torch.testing.assert_close(got.grad.float(), exp.grad, atol=0.05, rtol=0.02)


def test_fuse_a2a_identity_experts_bring_the_tokens_home(a2a: Any) -> None:
    group = ref.LoopbackGroup(WORLD)
    x = _vals(ROWS, H)
    eye = torch.eye(H, dtype=BF16).expand(E, H, H).contiguous()
    with opcontracts.mode("strict"):
        mid, none = a2a.AlltoallvPermuteGmm.apply(x, eye, group, TOKENS_PER_EXPERT, None, None,
                                                  None, SEND, RECV)
        back, _ = a2a.GmmUnpermuteAlltoallv.apply(mid, eye, group, TOKENS_PER_EXPERT, None,
                                                  None, None, SEND, RECV)
    assert none is None
    torch.testing.assert_close(back, x)


def _a2a_call(op: str, **change: Any) -> dict[str, Any]:
    first = op == "AlltoallvPermuteGmm"
    x, w = ("gmm1_inputs", "weight1") if first else ("gmm2_inputs", "weight2")
    call = {x: _vals(ROWS, H if first else N), w: _vals(E, H, N) if first else _vals(E, N, H),
            "ep_group": ref.LoopbackGroup(WORLD), "group_list": TOKENS_PER_EXPERT,
            "share_cached_fc1_input" if first else "share_cached_fc2_input": None,
            "share_expert_weight1" if first else "share_expert_weight2": None,
            "use_shared_experts": None, "send_counts": SEND, "recv_counts": RECV}
    for k, v in change.items():
        call[k.replace("X", x).replace("W", w).replace("#", "1" if first else "2")] = v
    return call


@pytest.mark.parametrize("op", ["AlltoallvPermuteGmm", "GmmUnpermuteAlltoallv"])
@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"X": _vals(ROWS, 8, dtype=FP32), "W": _vals(E, 8, 8, dtype=FP32)}, "X", "dtype"),
    ({"W": _vals(E, 8, 8, dtype=FP16)}, "W", "same_dtype"),
    ({"W": _vals(E, 5, 8)}, "W", "shape"),  # the tokens' axis: no transpose flag is passed
    ({"group_list": TOKENS_PER_EXPERT.to(I32)}, "group_list", "dtype"),
    ({"group_list": torch.tensor([4, 4, 0])}, "group_list", "shape"),  # one per local expert
    ({"send_counts": None}, "send_counts", "missing"),  # MindSpeed's AssertionError
    ({"recv_counts": list(RECV[:14])}, "recv_counts", "shape"),
    ({"use_shared_experts": True}, "share_cached_fc#_input", "missing"),  # the case
    ({"use_shared_experts": True, "share_cached_fc#_input": _vals(3, 8, dtype=FP32),
      "share_expert_weight#": _vals(8, 5)}, "share_cached_fc#_input", "dtype"),
])
def test_fuse_a2a_each_rule_names_its_argument(a2a: Any, op: str, change: dict[str, Any],
                                               arg: str, rule: str) -> None:
    call = _a2a_call(op, **change)
    first = op == "AlltoallvPermuteGmm"
    want = arg.replace("#", "1" if first else "2")
    if want in ("X", "W"):
        want = {"X": "gmm1_inputs" if first else "gmm2_inputs",
                "W": "weight1" if first else "weight2"}[want]
    exc = _violation(getattr(a2a, op).apply, **call)
    assert (exc.op, exc.arg, exc.rule) == (f"mindspeed.{op}", want, rule), str(exc)


def test_fuse_a2a_shared_expert_pair_only_matters_with_use_shared_experts(a2a: Any) -> None:
    junk = torch.zeros(2, dtype=torch.int8)  # ignored by MindSpeed without the flag
    with opcontracts.mode("strict"):
        a2a.AlltoallvPermuteGmm.apply(_vals(ROWS, H), _vals(E, H, N), ref.LoopbackGroup(WORLD),
                                      TOKENS_PER_EXPERT, junk, junk, False, SEND, RECV)
        _, shared = a2a.AlltoallvPermuteGmm.apply(
            _vals(ROWS, H), _vals(E, H, N), ref.LoopbackGroup(WORLD), TOKENS_PER_EXPERT,
            _vals(3, H, seed=1), _vals(H, 5, seed=2), True, SEND, RECV)
    assert shared is not None and shared.shape == (3, 5)
    assert not opcontracts.report()


def test_fuse_a2a_group_list_values_are_opt_in(a2a: Any) -> None:
    call = _a2a_call("GmmUnpermuteAlltoallv", group_list=torch.tensor([4, 5]))  # 9 rows, 8 given
    with opcontracts.mode("strict"):
        a2a.GmmUnpermuteAlltoallv.apply(*call.values())
    opcontracts.set_value_checks(True)
    exc = _violation(a2a.GmmUnpermuteAlltoallv.apply, *call.values())
    assert (exc.arg, exc.rule) == ("group_list", "value") and "sums to 9" in str(exc)
    call = _a2a_call("AlltoallvPermuteGmm", send_counts=[-1, *SEND[1:]])
    exc = _violation(a2a.AlltoallvPermuteGmm.apply, *call.values())
    assert (exc.arg, exc.rule) == ("send_counts", "value")


def test_fuse_a2a_inner_op_guards_the_group_size(a2a: Any) -> None:
    call = _a2a_call("AlltoallvPermuteGmm", ep_group=ref.LoopbackGroup(16))  # S // E is 8
    exc = _violation(a2a.AlltoallvPermuteGmm.apply, *call.values())
    assert (exc.op, exc.arg, exc.rule) == ("npu_alltoallv_gmm", "ep_world_size", "bound")


def test_fuse_a2a_wrong_call_is_one_record_and_fix_repairs_it(a2a: Any) -> None:
    group = ref.LoopbackGroup(WORLD)
    x, w1, w2 = _leaves(_vals(ROWS, H, dtype=FP32), _vals(E, H, N, dtype=FP32, seed=1),
                        _vals(E, N, H, dtype=FP32, seed=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mid, _ = a2a.AlltoallvPermuteGmm.apply(x, w1, group, TOKENS_PER_EXPERT, None, None,
                                               None, SEND, RECV)
        mid.sum().backward()
    rep = opcontracts.report()
    assert len(rep.records) == 1, rep.table()
    top = rep.records[0]
    assert (top.op, top.arg) == ("mindspeed.AlltoallvPermuteGmm", "gmm1_inputs")
    assert {n["op"] for n in top.nested} == {"npu_alltoallv_gmm", "npu_gmm_alltoallv"}

    x.grad = w1.grad = None
    opcontracts.reset_report()
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = _experts_call(a2a, x, w1, w2, group)
    assert y.dtype == BF16
    y.float().sum().backward()
    for t in (x, w1, w2):
        assert t.grad is not None and t.grad.dtype == FP32 and bool(t.grad.abs().sum() > 0)
    assert {r.op for r in opcontracts.report().records} == {
        "mindspeed.AlltoallvPermuteGmm", "mindspeed.GmmUnpermuteAlltoallv"}


# =========================================================================== MC2 linear
K_IN, N_OUT, TP = 256, 4, 2


@pytest.fixture
def lf(npu: Any) -> Any:
    """mindspeed.core.tensor_parallel.mc2_feature.linear_function (the stand-in)."""
    from mindspeed.core.tensor_parallel.mc2_feature import linear_function

    return linear_function


def _linear_args(dtype: torch.dtype = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (_vals(2, 1, K_IN, dtype=dtype) / 4, _vals(N_OUT, K_IN, dtype=dtype, seed=1) / 4,
            _vals(N_OUT, dtype=dtype, seed=2))


def test_column_linear_passes_strict_and_trains_as_the_reference(lf: Any) -> None:
    """MC2ColumnParallelLinear's call: (input, weight, bias, group, True, fusion).  The output
    is the all-gathered sequence times weight.t() plus the bias; gradients equal autograd
    through the reference (the reduce-scatter is the loopback gather's adjoint)."""
    group = ref.LoopbackGroup(TP, name="tp")
    x, w, b = _leaves(*_linear_args())
    grad = _vals(2 * TP, 1, N_OUT, seed=3)
    with opcontracts.mode("strict"):
        y = lf.ColumnSeqParallelLinearFunction.apply(x, w, b, group, True, False)
        y.backward(grad)
    assert not opcontracts.report()
    gathered = torch.cat([x.detach().float()] * TP).reshape(-1, K_IN)
    want = (gathered @ w.detach().float().T + b.detach().float()).view(2 * TP, 1, N_OUT)
    torch.testing.assert_close(y.float(), want, atol=0.02, rtol=0.01)
    rx, rw, rb = _leaves(x.float(), w.float(), b.float())
    ref.column_seq_parallel_linear(rx, rw, rb, group, True, False).backward(grad.float())
    for got, exp in ((x, rx), (w, rw), (b, rb)):
        assert got.grad is not None and exp.grad is not None
        torch.testing.assert_close(got.grad.float(), exp.grad, atol=0.05, rtol=0.02)


def test_column_linear_gradient_accumulation_fusion_runs_the_guarded_matmul_add(lf: Any) -> None:
    """With gradient_accumulation_fusion and an fp32 main_grad the backward accumulates through
    mindspeed.ops.npu_matmul_add.npu_matmul_add_fp32 (guarded by its own contract)."""
    group = ref.LoopbackGroup(TP, name="tp")
    x, w, _ = _leaves(*_linear_args())
    w.main_grad = torch.zeros(N_OUT, K_IN)  # type: ignore[attr-defined]
    grad = _vals(2 * TP, 1, N_OUT, seed=3)
    with opcontracts.mode("strict"):
        y = lf.ColumnSeqParallelLinearFunction.apply(x, w, None, group, True, True)
        y.backward(grad)
    assert w.grad is None  # the gradient went into main_grad
    gathered = torch.cat([x.detach().float()] * TP).reshape(-1, K_IN)
    want = grad.float().reshape(-1, N_OUT).T @ gathered
    torch.testing.assert_close(w.main_grad, want)  # type: ignore[attr-defined]
    assert not opcontracts.report()


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"input_": _vals(2, 1, K_IN, dtype=FP32), "weight": _vals(N_OUT, K_IN, dtype=FP32)},
     "input_", "dtype"),
    ({"weight": _vals(N_OUT, K_IN, dtype=FP16)}, "weight", "same_dtype"),
    ({"input_": _vals(2, K_IN)}, "input_", "rank"),  # (s, b, h): MindSpeed reads 3 axes
    ({"input_": _vals(2, 1, 128), "weight": _vals(N_OUT, 128)}, "input_", "shape"),  # k >= 256
    ({"weight": _vals(K_IN, N_OUT)}, "weight", "shape"),  # (n, k): it passes weight.t()
    ({"bias": _vals(N_OUT + 1)}, "bias", "shape"),
])
def test_column_linear_each_rule_names_its_argument(lf: Any, change: dict[str, Any], arg: str,
                                                    rule: str) -> None:
    x, w, b = _linear_args()
    call = {"input_": x, "weight": w, "bias": b, "group": ref.LoopbackGroup(TP, name="tp"),
            "all_gather_recomputation": True, "gradient_accumulation_fusion": False, **change}
    exc = _violation(lf.ColumnSeqParallelLinearFunction.apply, *call.values())
    assert (exc.op, exc.arg, exc.rule) == ("mindspeed.ColumnSeqParallelLinearFunction", arg,
                                           rule), str(exc)


def test_column_linear_inner_op_guards_the_world_size(lf: Any) -> None:
    x, w, b = _linear_args()
    exc = _violation(lf.ColumnSeqParallelLinearFunction.apply, x, w, b,
                     ref.LoopbackGroup(3, name="tp"), True, False)
    assert (exc.op, exc.arg, exc.rule) == ("npu_all_gather_base_mm", "world_size", "allowed")


def test_column_linear_wrong_call_is_one_record_and_fix_repairs_it(lf: Any) -> None:
    group = ref.LoopbackGroup(TP, name="tp")
    x, w, b = _leaves(*_linear_args(FP32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lf.ColumnSeqParallelLinearFunction.apply(x, w, b, group, True, False).sum().backward()
    rep = opcontracts.report()
    assert len(rep.records) == 1, rep.table()
    top = rep.records[0]
    assert (top.op, top.arg) == ("mindspeed.ColumnSeqParallelLinearFunction", "input_")
    assert {n["op"] for n in top.nested} == {"npu_all_gather_base_mm"}

    x.grad = w.grad = None
    b = b.detach().to(BF16)  # the bias has no rule (added after the kernel): the model's dtype
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = lf.ColumnSeqParallelLinearFunction.apply(x, w, b, group, True, False)
    assert any(issubclass(m.category, ContractFixWarning) for m in seen)
    assert y.dtype == BF16
    y.float().sum().backward()
    for t in (x, w):
        assert t.grad is not None and t.grad.dtype == FP32 and bool(t.grad.abs().sum() > 0)
