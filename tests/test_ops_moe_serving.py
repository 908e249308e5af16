"""The MoE serving ops (vllm-ascend's path) through ``import opcontracts.patch`` on the CPU
emulation (issue 15).

Per op: the calls vllm-ascend makes pass in strict mode and compute what a plain formula
computes; each rule's violation is caught naming the argument; the rules that depend on the
docstring a release ships (init_routing_v2, gating_top_k) follow the pinned version; value
rules stay opt-in; fix mode casts what a cast repairs (none of these ops is trained through, so
there are no gradients to reach the caller); without a contract the emulated kernel misreads
what it does not support, silently; everything compiles through the fakes with no graph break.
dispatch/combine run at ep_world_size 1 (the emulation is one process).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _strict import violation as _violation

import opcontracts
from opcontracts import ContractFixWarning

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I8, I32, I64 = torch.int8, torch.int32, torch.int64
N, K, E, H = 4, 2, 4, 32  # tokens, top-k, experts, hidden (a multiple of 32 for dispatch)


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vals(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in every float dtype."""
    return (torch.randint(-16, 17, shape, generator=_g(seed)) / 8).to(dtype)


def _logits(n: int, e: int, seed: int = 0) -> torch.Tensor:
    """Distinct router logits (no ties for top-k to break), exact in bf16."""
    return ((torch.randperm(n * e, generator=_g(seed)) - n * e // 2) / 16).view(n, e).to(BF16)


def _experts(n: int = N, k: int = K, e: int = E, seed: int = 0) -> torch.Tensor:
    """(n, k) distinct int32 expert ids per row, in [0, e)."""
    g = _g(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(I32)


@pytest.fixture(autouse=True)
def _a2_stack() -> Any:
    """The stack vllm-ascend's Atlas A2 images pin (CANN 9.x): the CANN- and chip-keyed tables
    (the 310P's, CANN < 8.3.RC1's 256-expert router) are other readings, which the corpus in
    tests/realcode/ checks under their own stacks."""
    with opcontracts.versions(cann="9.0.0", soc="Ascend910B3"):
        yield


# =========================================================================== routers
def test_gating_top_k_softmax_v2_both_renorm_modes_pass_strict(npu: Any) -> None:
    x = _logits(N, 8)
    finished = torch.tensor([False, True, False, False])
    with opcontracts.mode("strict"):
        y, idx, soft = npu.npu_moe_gating_top_k_softmax_v2(x, k=3, finished=finished,
                                                            output_softmax=True)
        y1, idx1, soft1 = npu.npu_moe_gating_top_k_softmax_v2(x, k=3, renorm=1)
        y3, idx3, _ = npu.npu_moe_gating_top_k_softmax_v2(x.view(2, 2, 8), k=3)  # 3-D x
    p = torch.softmax(x.float(), -1)
    top = torch.topk(p, 3, dim=-1)
    torch.testing.assert_close(y.float(), top.values.to(BF16).float())
    assert idx.dtype == I32 and torch.equal(idx[1], torch.full((3,), 8, dtype=I32))  # finished
    assert torch.equal(idx[[0, 2, 3]], top.indices[[0, 2, 3]].to(I32))
    torch.testing.assert_close(soft, p)  # the fp32 softmax of renorm 0 + output_softmax
    raw = torch.topk(x.float(), 3, dim=-1)  # renorm 1: top-k first, then the softmax of those
    torch.testing.assert_close(y1.float(), torch.softmax(raw.values, -1).to(BF16).float())
    assert soft1.shape == (0,)
    assert y3.shape == (2, 2, 3) and torch.equal(idx3.view(N, 3), idx1)


def test_gating_top_k_grouped_sigmoid_matches_deepseek_routing(npu: Any) -> None:
    """vllm-ascend's call (norm_type 1, group_select_mode 1, its bias cast to the logits'
    dtype) against DeepSeek-V3's grouped routing written out."""
    x, bias = _logits(N, 16), _logits(1, 16, seed=1).view(16) / 64
    with opcontracts.mode("strict"):
        y, idx, norm = npu.npu_moe_gating_top_k(
            x, k=2, bias=bias, k_group=2, group_count=4, group_select_mode=1, renorm=0,
            norm_type=1, out_flag=False, routed_scaling_factor=2.5, eps=1e-20)
    s = torch.sigmoid(x.float())
    choose = s + bias.float()
    group_score = choose.view(N, 4, 4).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros(N, 4, dtype=torch.bool).scatter(1, group_score.topk(2, -1).indices, True)
    masked = choose.view(N, 4, 4).masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, 16)
    want_idx = masked.topk(2, -1).indices
    w = s.gather(1, want_idx)
    want_y = w / w.sum(-1, keepdim=True) * 2.5
    assert torch.equal(idx, want_idx.to(I32))
    torch.testing.assert_close(y.float(), want_y.to(BF16).float())
    torch.testing.assert_close(norm, s)
    with opcontracts.mode("strict"):  # softmax, no groups: plain top-k of the softmax
        y0, idx0, _ = npu.npu_moe_gating_top_k(x, 4)
    p = torch.softmax(x.float(), -1)
    assert torch.equal(idx0, p.topk(4, -1).indices.to(I32))


ROUTER_RULES = [
    ("npu_moe_gating_top_k_softmax_v2", {"x": _vals(N, E, dtype=torch.float64)}, "x", "dtype"),
    ("npu_moe_gating_top_k_softmax_v2", {"x": _vals(N, E, 2, 3)}, "x", "rank"),
    ("npu_moe_gating_top_k_softmax_v2", {"finished": torch.zeros(N, dtype=I8)}, "finished",
     "dtype"),
    ("npu_moe_gating_top_k_softmax_v2", {"finished": torch.zeros(N + 1, dtype=torch.bool)},
     "finished", "shape"),
    ("npu_moe_gating_top_k_softmax_v2", {"k": E + 1}, "k", "bound"),
    ("npu_moe_gating_top_k_softmax_v2", {"k": 0}, "k", "bound"),
    ("npu_moe_gating_top_k_softmax_v2", {"renorm": 2}, "renorm", "allowed"),
    ("npu_moe_gating_top_k", {"bias": _vals(E, dtype=FP32)}, "bias", "same_dtype"),
    ("npu_moe_gating_top_k", {"bias": _vals(E + 1)}, "bias", "shape"),
    ("npu_moe_gating_top_k", {"x": _vals(N, 2049)}, "x", "shape"),  # E <= 2048
    ("npu_moe_gating_top_k", {"k": E + 1}, "k", "bound"),
    ("npu_moe_gating_top_k", {"input_ids": torch.zeros(N, dtype=I8),
                              "tid2eid": torch.zeros(3, K, dtype=I32)}, "input_ids", "dtype"),
    ("npu_moe_gating_top_k", {"input_ids": torch.zeros(N, dtype=I32),
                              "tid2eid": torch.zeros(3, K, dtype=FP32)}, "tid2eid", "dtype"),
    ("npu_moe_gating_top_k", {"group_select_mode": 2}, "group_select_mode", "allowed"),
    ("npu_moe_gating_top_k", {"renorm": 1}, "renorm", "allowed"),
    ("npu_moe_gating_top_k", {"norm_type": 2}, "norm_type", "allowed"),
    ("npu_moe_gating_top_k", {"k_group": 0}, "k_group", "bound"),
]


def _router_call(op: str, change: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if op == "npu_moe_gating_top_k_softmax_v2":
        kw: dict[str, Any] = {"x": _vals(N, E), "k": K, "finished": torch.zeros(N, dtype=torch.bool)}
        kw.update(change)
        return (kw.pop("x"),), kw
    kw = {"x": _vals(N, E), "k": K, "bias": _vals(E)}
    kw.update(change)
    return (kw.pop("x"), kw.pop("k")), kw


@pytest.mark.parametrize(("op", "change", "arg", "rule"), ROUTER_RULES,
                         ids=[f"{r[0][8:]}:{r[2]}:{r[3]}" for r in ROUTER_RULES])
def test_router_rules_name_their_argument(npu: Any, op: str, change: dict[str, Any], arg: str,
                                          rule: str) -> None:
    args, kwargs = _router_call(op, {})
    with opcontracts.mode("strict"):
        getattr(npu, op)(*args, **kwargs)  # the unchanged call conforms
    args, kwargs = _router_call(op, change)
    exc = _violation(getattr(npu, op), *args, **kwargs)
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)
    assert "torch_npu 2.14.0 wheel" in (exc.source or "")


def test_gating_top_k_before_the_hash_mode_has_its_own_docstring(npu: Any) -> None:
    """2.12.0 ships the docstring without input_ids / tid2eid: its contract has no rule for
    them (and the release's schema no such arguments); the other rules are the same."""
    opcontracts.set_versions(torch_npu="2.12.0")
    x = _vals(N, E)
    with opcontracts.mode("strict"):
        npu.npu_moe_gating_top_k(x, K, input_ids=None, tid2eid=None)
    exc = _violation(npu.npu_moe_gating_top_k, x, K, bias=_vals(E, dtype=FP32))
    assert (exc.arg, exc.rule) == ("bias", "same_dtype")
    assert "torch_npu 2.12.0 wheel" in (exc.source or "")


def test_fix_casts_the_bias_to_the_logits_dtype(npu: Any) -> None:
    """What vllm-ascend does by hand before the call (its e_score_correction_bias is fp32)."""
    x, bias = _vals(N, E), _vals(E, dtype=FP32, seed=2) / 4
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="bias"):
        got = npu.npu_moe_gating_top_k(x, K, bias=bias, norm_type=1)
    want = npu.npu_moe_gating_top_k(x, K, bias=bias.to(BF16), norm_type=1)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert bias.dtype == FP32  # the caller's tensor is untouched


# =========================================================================== init routing v2
def _init_args(**change: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """vllm-ascend's all-gather dispatch: bf16 hidden states, active_num = tokens * top_k,
    counts per expert of this rank's range."""
    kw: dict[str, Any] = {"x": _vals(N, H), "expert_idx": _experts(), "active_num": N * K,
                          "expert_num": E, "expert_tokens_num_type": 1,
                          "expert_tokens_num_flag": True, "active_expert_range": [0, E],
                          "quant_mode": -1}
    kw.update(change)
    return (kw.pop("x"), kw.pop("expert_idx")), kw


def test_init_routing_v2_runs_int8_tokens_with_x_dtype(npu: Any) -> None:
    """vllm-ascend's W8A8 All2AllV dispatch (token_dispatcher.py:701, main): int8 tokens after
    the all-to-all, their (R,) fp32 dynamic scales, (R, 1) local expert ids, x_dtype int8; the
    emulation used to raise "x_dtype is not emulated" (issue 23)."""
    r, local = 6, 2
    x = torch.randint(-100, 100, (r, H), generator=_g(2)).to(I8)
    ids = torch.tensor([[1], [0], [1], [0], [0], [1]], dtype=I32)
    scale = torch.rand(r, generator=_g(3))
    with opcontracts.mode("strict"):
        ex, row_idx, counts, ex_scale = npu.npu_moe_init_routing_v2(
            x, ids, scale=scale, expert_num=E, expert_tokens_num_flag=True,
            active_expert_range=[0, local], x_dtype=I8)
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert ex.dtype == I8 and torch.equal(ex, x[order])
    assert counts.tolist() == [3, 6]  # expert_tokens_num_type left at 0: the running sum
    torch.testing.assert_close(ex_scale, scale[order])


def test_init_routing_v2_sorts_by_expert_and_round_trips(npu: Any) -> None:
    args, kw = _init_args()
    x, ids = args
    with opcontracts.mode("strict"):
        ex, row_idx, counts, scale = npu.npu_moe_init_routing_v2(*args, **kw)
        probs = torch.rand(N, K, generator=_g(3)).to(BF16)
        # vllm-ascend combines with the gather index as unpermute's sorted_indices
        back = npu.npu_moe_token_unpermute(ex, row_idx, probs)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    assert torch.equal(ex, x[order // K])
    assert row_idx.dtype == I32 and torch.equal(row_idx.long(), torch.argsort(order))
    assert counts.dtype == I64 and torch.equal(counts, torch.bincount(flat, minlength=E))
    assert scale.shape == (N * K,) and scale.dtype == FP32
    want = (x.float().unsqueeze(1) * probs.float().unsqueeze(-1)).sum(1)
    torch.testing.assert_close(back.float(), want, atol=0.05, rtol=0.02)


def test_init_routing_v2_expert_range_key_value_and_quantisation(npu: Any) -> None:
    ids = _experts()
    args, kw = _init_args(expert_idx=ids, active_expert_range=[1, 3], expert_tokens_num_type=2)
    with opcontracts.mode("strict"):
        ex, row_idx, kv, _ = npu.npu_moe_init_routing_v2(*args, **kw)
    inside = (ids >= 1) & (ids < 3)
    assert torch.equal(row_idx.view(N, K) == -1, ~inside)  # out of range: -1 (gather index)
    n_valid = int(inside.sum())
    assert not ex[n_valid:].any()  # rows past the valid ones: zero here (undefined on the NPU)
    counts = torch.bincount(ids[inside].long(), minlength=3)[1:]
    assert kv.shape == (E, 2)
    assert torch.equal(kv[: int((counts > 0).sum())],
                       torch.stack([torch.tensor([1, 2]), counts], 1)[counts > 0])
    # dynamic quantisation with a per-expert smooth scale (E, H)
    smooth = torch.rand(E, H, generator=_g(4)) + 0.5
    args, kw = _init_args(scale=smooth, quant_mode=1)
    with opcontracts.mode("strict"):
        q, _, _, dyn = npu.npu_moe_init_routing_v2(*args, **kw)
    order = torch.argsort(args[1].reshape(-1).long(), stable=True)
    rows = args[0].float()[order // K] * smooth[args[1].reshape(-1).long()[order]]
    assert q.dtype == I8 and dyn.dtype == FP32
    torch.testing.assert_close(q.float() * dyn.unsqueeze(1), rows, atol=dyn.max().item(), rtol=0)
    # an int8 x with its (N,) dynamic scales: what vllm-ascend routes after its all-to-all
    xi = torch.randint(-127, 128, (N, H), generator=_g(5)).to(I8)
    per_token = torch.rand(N, generator=_g(6))
    args, kw = _init_args(x=xi, scale=per_token)
    with opcontracts.mode("strict"):
        qi, _, _, si = npu.npu_moe_init_routing_v2(*args, **kw)
    order = torch.argsort(args[1].reshape(-1).long(), stable=True)
    assert torch.equal(qi, xi[order // K]) and torch.equal(si, per_token[order // K])


INIT_RULES = [
    ({"x": _vals(N, H, dtype=torch.float64)}, "x", "dtype"),
    ({"x": _vals(N, H, 1)}, "x", "rank"),
    ({"expert_idx": _experts().long()}, "expert_idx", "dtype"),
    ({"expert_idx": _experts(N + 1)}, "expert_idx", "shape"),  # its rows are x's
    ({"scale": torch.rand(N + 1)}, "scale", "shape"),
    ({"scale": torch.rand(E, H + 1)}, "scale", "shape"),
    ({"scale": torch.rand(N).to(FP16)}, "scale", "dtype"),
    ({"offset": torch.zeros(1, dtype=BF16)}, "offset", "dtype"),
    ({"active_num": -2}, "active_num", "bound"),
    ({"expert_num": 0}, "expert_num", "bound"),
    ({"expert_num": 10241}, "expert_num", "bound"),
    ({"drop_pad_mode": 1}, "drop_pad_mode", "allowed"),
    ({"expert_tokens_num_type": 3}, "expert_tokens_num_type", "allowed"),
    ({"quant_mode": 0}, "quant_mode", "allowed"),  # static quantisation: not supported
    ({"row_idx_type": 2}, "row_idx_type", "allowed"),
]


@pytest.mark.parametrize(("change", "arg", "rule"), INIT_RULES,
                         ids=[f"{r[1]}:{r[2]}" for r in INIT_RULES])
def test_init_routing_v2_rules_name_their_argument(npu: Any, change: dict[str, Any], arg: str,
                                                   rule: str) -> None:
    args, kw = _init_args(**change)
    exc = _violation(npu.npu_moe_init_routing_v2, *args, **kw)
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_init_routing_v2_follows_the_docstring_of_the_release(npu: Any) -> None:
    """The earlier docstring (2.7.1 and the releases sharing it): active_num must equal
    NUM_ROWS*K, expert_num may be 0; the later one (2.13.0): active_num >= -1, expert_num > 0."""
    args, kw = _init_args(active_num=-1)
    with opcontracts.mode("strict"):
        npu.npu_moe_init_routing_v2(*args, **kw)  # 2.13.0: -1 means every token
    opcontracts.set_versions(torch_npu="2.7.1")
    exc = _violation(npu.npu_moe_init_routing_v2, *args, **kw)
    assert (exc.arg, exc.rule) == ("active_num", "bound") and "N*K" in exc.expected
    assert "torch_npu 2.7.1 wheel" in (exc.source or "")
    args, kw = _init_args(expert_num=0, active_expert_range=[0, E])
    with opcontracts.mode("strict"):
        npu.npu_moe_init_routing_v2(*args, **kw)  # [0, 10240] in the earlier docstring
    opcontracts.set_versions(torch_npu="2.13.0")
    assert _violation(npu.npu_moe_init_routing_v2, *args, **kw).arg == "expert_num"


# =========================================================================== dispatch / combine
def _dispatch_kwargs(**change: Any) -> dict[str, Any]:
    """vllm-ascend's MC2 dispatch kwargs (token_dispatcher.get_dispatch_mc2_kwargs), one rank."""
    kw: dict[str, Any] = {
        "x": _vals(N, H), "expert_ids": _experts(), "expert_shard_type": 0,
        "shared_expert_rank_num": 0, "moe_expert_num": E, "global_bs": 0,
        "expert_token_nums_type": 1, "x_active_mask": torch.ones(N, dtype=torch.bool),
        "scales": None, "quant_mode": 0, "group_ep": "ep", "ep_world_size": 1, "ep_rank_id": 0,
        "expert_scales": torch.rand(N, K, generator=_g(1))}
    kw.update(change)
    return kw


def test_dispatch_then_combine_is_the_weighted_sum_at_world_size_one(npu: Any) -> None:
    kw = _dispatch_kwargs()
    with opcontracts.mode("strict"):
        expand_x, dyn, expand_idx, token_nums, ep_recv, tp_recv, expand_scales = \
            npu.npu_moe_distribute_dispatch(**kw)
        out = npu.npu_moe_distribute_combine(
            expand_x=expand_x, expert_ids=kw["expert_ids"], expert_scales=kw["expert_scales"],
            expert_shard_type=0, shared_expert_rank_num=0, moe_expert_num=E, global_bs=0,
            x_active_mask=kw["x_active_mask"], ep_send_counts=ep_recv, group_ep="ep",
            ep_world_size=1, ep_rank_id=0, expand_scales=expand_scales, comm_quant_mode=0,
            expand_idx=expand_idx)
    x, ids, w = kw["x"], kw["expert_ids"], kw["expert_scales"]
    order = torch.argsort(ids.reshape(-1).long(), stable=True)
    assert expand_x.shape == (N * K, H) and torch.equal(expand_x, x[order // K])
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    assert token_nums.dtype == I64 and torch.equal(token_nums, counts)
    assert ep_recv.dtype == I32 and torch.equal(ep_recv.long(), counts.cumsum(0))
    assert tp_recv.shape == (0,) and dyn.shape == (N * K,)
    assert torch.equal(expand_scales, w.reshape(-1)[order])
    want = (x.float().unsqueeze(1) * w.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out.float(), want.to(BF16).float())


def test_dispatch_dynamic_quantisation_dequantises_back(npu: Any) -> None:
    smooth = torch.rand(E, H, generator=_g(2)) + 0.5
    kw = _dispatch_kwargs(quant_mode=2, scales=smooth)
    with opcontracts.mode("strict"):
        q, dyn, *_ = npu.npu_moe_distribute_dispatch(**kw)
    ids = kw["expert_ids"].reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    rows = kw["x"].float()[order // K] * smooth[ids[order]]
    assert q.dtype == I8 and dyn.dtype == FP32
    torch.testing.assert_close(q.float() * dyn.unsqueeze(1), rows, atol=dyn.max().item(), rtol=0)


def test_dispatch_and_combine_at_ep_world_size_16_compute_the_simulated_world(npu: Any) -> None:
    """vllm-ascend's MC2 path at EP 16 (issue 23): a world of 16 ranks that each hold this
    shard.  Rank 3 owns experts [6, 8) of 32; it receives each of its pairs once per source
    rank, with the meta kernel's shapes; combine adds the local experts' weighted rows."""
    w, rank, experts = 16, 3, 32
    ids = torch.tensor([[6, 0], [7, 6], [1, 2], [6, 31]], dtype=I32)
    kw = _dispatch_kwargs(ep_world_size=w, ep_rank_id=rank, moe_expert_num=experts,
                          expert_ids=ids)
    with opcontracts.mode("strict"):
        expand_x, dyn, expand_idx, token_nums, ep_recv, tp_recv, expand_scales = \
            npu.npu_moe_distribute_dispatch(**kw)
    rows = N * w * min(experts // w, K)  # global_bs 0: BS * ep_world_size
    assert expand_x.shape == (rows, H) and expand_scales.shape == (rows,)
    assert token_nums.tolist() == [3 * w, 1 * w]  # experts 6 and 7, from every rank
    assert ep_recv.numel() == experts + N * w * 2 * K * (w // 8)
    x = kw["x"]
    block6 = torch.stack([x[0], x[1], x[3]])  # the pairs of expert 6, in order
    torch.testing.assert_close(expand_x[:3], block6)  # source rank 0's block
    torch.testing.assert_close(expand_x[3 * (w - 1):3 * w], block6)  # source rank 15's
    torch.testing.assert_close(expand_x[3 * w], x[1])  # expert 7, source rank 0
    assert not expand_x[4 * w:].any()  # past the valid rows
    with opcontracts.mode("strict"):
        out = npu.npu_moe_distribute_combine(
            expand_x=expand_x, expert_ids=ids, expand_idx=expand_idx, ep_send_counts=ep_recv,
            expert_scales=kw["expert_scales"], group_ep="ep", ep_world_size=w,
            ep_rank_id=rank, moe_expert_num=experts, expand_scales=expand_scales)
    local = ((ids >= 6) & (ids < 8)).to(FP32) * kw["expert_scales"]
    expected = (local.unsqueeze(-1) * x.float().unsqueeze(1)).sum(1)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_the_simulated_world_refuses_what_it_does_not_compute(npu: Any) -> None:
    with pytest.raises(NotImplementedError, match="split evenly"):
        npu.npu_moe_distribute_dispatch(**_dispatch_kwargs(ep_world_size=3, ep_rank_id=1))
    with pytest.raises(NotImplementedError, match="shared-expert"):
        npu.npu_moe_distribute_dispatch(**_dispatch_kwargs(shared_expert_rank_num=1))


DISPATCH_RULES = [
    ({"x": _vals(N, H, dtype=FP32)}, "x", "dtype"),
    ({"x": _vals(N, 40)}, "x", "shape"),  # H a multiple of 32
    ({"x": _vals(N, 7200)}, "x", "shape"),  # H <= 7168
    ({"x": _vals(513, H), "expert_ids": _experts(513), "expert_scales": torch.rand(513, K)},
     "x", "shape"),  # BS <= 512
    ({"expert_ids": _experts().long()}, "expert_ids", "dtype"),
    ({"expert_ids": _experts(N + 1)}, "expert_ids", "shape"),
    ({"expert_ids": _experts(k=17, e=32), "moe_expert_num": 32,
      "expert_scales": torch.rand(N, 17)}, "expert_ids", "shape"),  # K <= 16
    ({"expert_scales": torch.rand(N, K).to(BF16)}, "expert_scales", "dtype"),
    ({"expert_scales": torch.rand(N, K + 1)}, "expert_scales", "shape"),
    ({"quant_mode": 2, "scales": torch.rand(E, H).to(BF16)}, "scales", "dtype"),
    ({"quant_mode": 2, "scales": torch.rand(E, H + 32)}, "scales", "shape"),
    ({"quant_mode": 1}, "quant_mode", "allowed"),
    ({"moe_expert_num": 0}, "moe_expert_num", "bound"),
    ({"moe_expert_num": 513}, "moe_expert_num", "bound"),
    ({"tp_world_size": 2}, "tp_world_size", "allowed"),
    ({"expert_shard_type": 1}, "expert_shard_type", "allowed"),
    ({"shared_expert_num": 2}, "shared_expert_num", "allowed"),
    ({"expert_token_nums_type": 2}, "expert_token_nums_type", "allowed"),
    ({"global_bs": -1}, "global_bs", "bound"),
    ({"ep_rank_id": -1}, "ep_rank_id", "bound"),
]


@pytest.mark.parametrize(("change", "arg", "rule"), DISPATCH_RULES,
                         ids=[f"{r[1]}:{r[2]}:{i}" for i, r in enumerate(DISPATCH_RULES)])
def test_dispatch_rules_name_their_argument(npu: Any, change: dict[str, Any], arg: str,
                                            rule: str) -> None:
    exc = _violation(npu.npu_moe_distribute_dispatch, **_dispatch_kwargs(**change))
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)
    assert "op-plugin" in (exc.source or "")


def _combine_kwargs(**change: Any) -> dict[str, Any]:
    kw = _dispatch_kwargs()
    expand_x, _, expand_idx, _, ep_recv, _, expand_scales = \
        emulation_kernel("npu_moe_distribute_dispatch")(**kw)
    out: dict[str, Any] = {
        "expand_x": expand_x, "expert_ids": kw["expert_ids"], "expand_idx": expand_idx,
        "ep_send_counts": ep_recv, "expert_scales": kw["expert_scales"], "group_ep": "ep",
        "ep_world_size": 1, "ep_rank_id": 0, "moe_expert_num": E,
        "expand_scales": expand_scales, "comm_quant_mode": 0}
    out.update(change)
    return out


def emulation_kernel(op: str) -> Any:
    """The op's reference (the emulated kernel's math), to build inputs without a guard."""
    ref = opcontracts.reference.get(op)
    assert ref is not None
    return ref.forward


COMBINE_RULES = [
    ({"expand_x": _vals(N * K, H, dtype=FP32)}, "expand_x", "dtype"),
    ({"expand_x": _vals(N * K, 48)}, "expand_x", "shape"),
    ({"expert_ids": _experts().long()}, "expert_ids", "dtype"),
    ({"expand_idx": torch.zeros(N * K + 1, dtype=I32)}, "expand_idx", "shape"),  # BS*K
    ({"expand_idx": torch.zeros(N * K, dtype=I64)}, "expand_idx", "dtype"),
    ({"ep_send_counts": torch.zeros(E, dtype=I64)}, "ep_send_counts", "dtype"),
    ({"ep_send_counts": torch.zeros(1, E, dtype=I32)}, "ep_send_counts", "rank"),
    ({"expert_scales": torch.rand(N, K).to(BF16)}, "expert_scales", "dtype"),
    ({"expand_scales": torch.rand(N * K + 1)}, "expand_scales", "shape"),  # A rows
    ({"comm_quant_mode": 1}, "comm_quant_mode", "allowed"),
    ({"tp_world_size": 4}, "tp_world_size", "allowed"),
]


@pytest.mark.parametrize(("change", "arg", "rule"), COMBINE_RULES,
                         ids=[f"{r[1]}:{r[2]}" for r in COMBINE_RULES])
def test_combine_rules_name_their_argument(npu: Any, change: dict[str, Any], arg: str,
                                           rule: str) -> None:
    with opcontracts.mode("strict"):
        npu.npu_moe_distribute_combine(**_combine_kwargs())
    exc = _violation(npu.npu_moe_distribute_combine, **_combine_kwargs(**change))
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_fix_casts_the_expert_scales_to_fp32(npu: Any) -> None:
    """bf16 router weights: vllm-ascend casts them (``topk_weights.to(torch.float32)``)
    before both calls; fix mode does the same, and the result is the one of the fp32 call."""
    w = torch.rand(N, K, generator=_g(7))
    w16 = w.to(BF16)
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="expert_scales"):
        got = npu.npu_moe_distribute_combine(**_combine_kwargs(expert_scales=w16))
    want = npu.npu_moe_distribute_combine(**_combine_kwargs(expert_scales=w16.float()))
    assert torch.equal(got, want) and w16.dtype == BF16


def test_without_a_contract_bf16_scales_are_misread_silently(npu: Any) -> None:
    """The raw kernel reads the bf16 buffer as fp32: no error, wrong numbers."""
    w16 = torch.rand(N, K, generator=_g(7)).to(BF16)
    with opcontracts.mode("off"):
        bad = npu.npu_moe_distribute_combine(**_combine_kwargs(expert_scales=w16))
    good = npu.npu_moe_distribute_combine(**_combine_kwargs(expert_scales=w16.float()))
    assert not torch.allclose(bad.float(), good.float(), atol=0.1)


def test_expert_ids_non_negative_is_a_value_check(npu: Any) -> None:
    ids = _experts()
    ids[0, 0] = -1
    kw = _combine_kwargs(expert_ids=ids)
    with opcontracts.mode("strict"):
        npu.npu_moe_distribute_combine(**kw)  # values are not read by default
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_moe_distribute_combine, **kw)
    assert (exc.arg, exc.rule) == ("expert_ids", "value")


# =========================================================================== re-routing
def _re_routing_call(counts: torch.Tensor | None = None, **change: Any) -> dict[str, Any]:
    """The torchair W8A8 path vllm-ascend had: int8 tokens gathered from the ranks, their
    (world_size, experts) counts, fp32 per-token scales."""
    if counts is None:
        counts = torch.tensor([[1, 0, 2, 1], [0, 2, 1, 1]], dtype=I32)
    a = int(counts.sum())
    kw: dict[str, Any] = {
        "tokens": torch.randint(-127, 128, (a, H), generator=_g(8)).to(I8),
        "expert_token_num_per_rank": counts, "per_token_scales": torch.rand(a, generator=_g(9))}
    kw.update(change)
    return kw


def test_re_routing_regroups_rank_major_tokens_expert_major(npu: Any) -> None:
    kw = _re_routing_call()
    with opcontracts.mode("strict"):
        toks, scales, idx, per_expert = npu.npu_moe_re_routing(**kw)
    counts = kw["expert_token_num_per_rank"]
    # the loop the docs' offsets describe: source rank-major, destination expert-major
    src, start = {}, 0
    for i in range(counts.size(0)):
        for j in range(counts.size(1)):
            src[(i, j)] = list(range(start, start + int(counts[i, j])))
            start += int(counts[i, j])
    want = [r for j in range(counts.size(1)) for i in range(counts.size(0)) for r in src[(i, j)]]
    assert idx.dtype == I32 and idx.tolist() == want
    assert torch.equal(toks, kw["tokens"][want])
    assert torch.equal(scales, kw["per_token_scales"][want])
    assert per_expert.dtype == counts.dtype and torch.equal(per_expert, counts.sum(0))


RE_ROUTING_RULES = [
    ({"tokens": torch.zeros(6, H, dtype=FP32)}, "tokens", "dtype"),
    ({"tokens": torch.zeros(6, 16384, dtype=I8)}, "tokens", "shape"),  # H < 16384
    ({"expert_token_num_per_rank": torch.ones(2, 3, dtype=I8)}, "expert_token_num_per_rank",
     "dtype"),
    ({"expert_token_num_per_rank": torch.ones(6, dtype=I32)}, "expert_token_num_per_rank",
     "rank"),
    ({"per_token_scales": torch.rand(6).to(BF16)}, "per_token_scales", "dtype"),
    ({"per_token_scales": torch.rand(7)}, "per_token_scales", "shape"),  # A tokens
    ({"expert_token_num_type": 0}, "expert_token_num_type", "allowed"),
    ({"idx_type": 1}, "idx_type", "allowed"),
]


@pytest.mark.parametrize(("change", "arg", "rule"), RE_ROUTING_RULES,
                         ids=[f"{r[1]}:{r[2]}" for r in RE_ROUTING_RULES])
def test_re_routing_rules_name_their_argument(npu: Any, change: dict[str, Any], arg: str,
                                              rule: str) -> None:
    with opcontracts.mode("strict"):
        npu.npu_moe_re_routing(**_re_routing_call())
    exc = _violation(npu.npu_moe_re_routing, **_re_routing_call(**change))
    assert (exc.arg, exc.rule) == (arg, rule), str(exc)


def test_re_routing_counts_must_sum_to_the_tokens_with_value_checks(npu: Any) -> None:
    """Counts that do not add up to A: the kernel walks the tokens by them (rows read twice or
    never written); a value check, opt-in."""
    kw = _re_routing_call()
    kw["expert_token_num_per_rank"] = kw["expert_token_num_per_rank"] + 1
    with opcontracts.mode("strict"):
        npu.npu_moe_re_routing(**kw)
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_moe_re_routing, **kw)
    assert (exc.arg, exc.rule) == ("expert_token_num_per_rank", "value")
    assert "sum == A" in exc.expected
    with opcontracts.mode("strict"):
        npu.npu_moe_re_routing(**_re_routing_call())


def test_fix_casts_bf16_per_token_scales(npu: Any) -> None:
    kw = _re_routing_call()
    s16 = kw["per_token_scales"].to(BF16)
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="per_token_scales"):
        got = npu.npu_moe_re_routing(**{**kw, "per_token_scales": s16})
    assert got[1].dtype == FP32 and torch.equal(got[1], s16.float()[got[2].long()])


# =========================================================================== torch.compile
def test_the_serving_path_compiles_through_the_fakes_without_graph_breaks(npu: Any) -> None:
    """Router, init routing, dispatch, combine and re-routing in one compiled function
    (guarded, strict), equal to eager."""
    logits, x = _logits(N, 8), _vals(N, H, seed=1)

    def step(logits: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w, ids, _ = torch.ops.npu.npu_moe_gating_top_k_softmax_v2(logits, k=K)
        wg, ids_g, _ = torch.ops.npu.npu_moe_gating_top_k(logits, K, norm_type=1)
        ex, row_idx, counts, _ = torch.ops.npu.npu_moe_init_routing_v2(
            x, ids, active_num=N * K, expert_num=8, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[0, 8])
        ws = w.float()
        ex2, _, idx, _, ep_recv, _, _ = torch.ops.npu.npu_moe_distribute_dispatch(
            x, ids_g, "ep", 1, 0, 8, expert_scales=ws)
        y = torch.ops.npu.npu_moe_distribute_combine(ex2, ids_g, idx, ep_recv, ws, "ep", 1, 0, 8)
        per_rank = counts.view(1, 8).to(I32)
        toks, _, perm, _ = torch.ops.npu.npu_moe_re_routing(ex, per_rank)
        return y, toks, perm, row_idx, wg

    with opcontracts.mode("strict"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        eager = step(logits, x)
        compiled = torch.compile(step, backend="eager", fullgraph=True)(logits, x)
    for a, b in zip(compiled, eager, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b)
