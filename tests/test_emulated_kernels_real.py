"""The emulated kernels as the real ones compute and refuse: what torch_npu's own op tests
(op-plugin ``test/test_custom_ops``) expect of the ops the emulation runs, written here from what
those tests and op-plugin's glue show.

* ``npu_moe_init_routing`` keeps tied expert ids in their position order (row-major over
  ``expert_idx``), not in the order of their ``row_idx`` values;
* ``npu_moe_finalize_routing``'s drop-pad modes read an (E, C, H) input and skip -1 rows;
* ``npu_grouped_matmul`` and ``npu_rotary_mul`` raise what op-plugin's glue raises, with its
  message's key phrase.
"""

from __future__ import annotations

import types

import pytest
import torch

import opcontracts
from opcontracts.errors import ContractViolation

# ``npu`` (conftest): the emulation installed, the patch applied, the stand-in torch_npu module


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- init routing
def test_init_routing_keeps_tied_experts_in_position_order(npu: types.ModuleType) -> None:
    n, k, hidden = 3, 2, 4
    x = torch.arange(n * hidden, dtype=torch.float32).view(n, hidden)
    # row_idx as gating top-k writes it: row_idx[i, j] = j * n + i
    row_idx = (torch.arange(k).unsqueeze(0) * n + torch.arange(n).unsqueeze(1)).to(torch.int32)
    # expert 1 is chosen by (row 0, slot 1) and (row 1, slot 0): positions 1 and 2 in row-major
    # order, row_idx values 3 and 1.  The kernel keeps position order: row 0 first.
    expert_idx = torch.tensor([[0, 1], [1, 2], [2, 3]], dtype=torch.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = npu.npu_moe_init_routing(
        x, row_idx, expert_idx, n)
    assert expanded_expert_idx.tolist() == [0, 1, 1, 2, 2, 3]
    # source rows in the sorted order: positions 0,1,2,3,4,5 -> rows 0,0,1,1,2,2
    assert torch.equal(expanded_x, x[[0, 0, 1, 1, 2, 2]])
    # each row_idx value r is found at the row of expanded_x that holds it
    sorted_values = row_idx.reshape(-1)[torch.argsort(expert_idx.reshape(-1), stable=True)]
    for dst, r in enumerate(sorted_values.tolist()):
        assert int(expanded_row_idx[r]) == dst


def test_init_routing_ties_follow_positions_even_against_row_idx(npu: types.ModuleType) -> None:
    """Every expert the same: the output is x's rows in position order, whatever row_idx holds."""
    n, k, hidden = 4, 3, 2
    x = torch.randn(n, hidden, generator=_g(1))
    row_idx = (torch.arange(k).unsqueeze(0) * n + torch.arange(n).unsqueeze(1)).to(torch.int32)
    expert_idx = torch.zeros(n, k, dtype=torch.int32)
    expanded_x, _, _ = npu.npu_moe_init_routing(x, row_idx, expert_idx, n)
    assert torch.equal(expanded_x, x.repeat_interleave(k, 0))


def test_init_routing_v2_lists_out_of_range_pairs_as_the_kernel_sorts_them(
        npu: types.ModuleType) -> None:
    """row_idx_type 1 lists every pair: those of the range by expert, then the ones at or past
    its end by expert id, then the ones below its start (op-plugin's golden)."""
    x = torch.arange(8, dtype=torch.float32).view(4, 2)
    expert_idx = torch.tensor([[5, 1], [2, 0], [1, 4], [3, 6]], dtype=torch.int32)
    _, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, expert_idx, active_expert_range=[1, 4], row_idx_type=1, expert_num=8,
        expert_tokens_num_type=1, expert_tokens_num_flag=True)
    # in range: 1 (pairs 1, 4), 2 (pair 2), 3 (pair 6); past it: 4 (5), 5 (0), 6 (7); below: 0 (3)
    assert row_idx.tolist() == [1, 4, 2, 6, 5, 0, 7, 3]
    assert counts.tolist() == [2, 1, 1]


def test_init_routing_v2_dynamic_quant_of_no_tokens_is_empty(npu: types.ModuleType) -> None:
    x = torch.zeros(0, 16, dtype=torch.bfloat16)
    expert_idx = torch.zeros(0, 3, dtype=torch.int32)
    expanded_x, row_idx, counts, scale = npu.npu_moe_init_routing_v2(
        x, expert_idx, scale=torch.zeros(0), active_expert_range=[0, 8], quant_mode=1,
        row_idx_type=1, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    assert expanded_x.numel() == row_idx.numel() == scale.numel() == 0
    assert expanded_x.dtype == torch.int8 and not counts.any()


# --------------------------------------------------------------------------- finalize routing
def _finalize_expected(rows: torch.Tensor, skip1: torch.Tensor, bias: torch.Tensor,
                       scales: torch.Tensor | None, dst: torch.Tensor, experts: torch.Tensor,
                       by_row: bool = False) -> torch.Tensor:
    n, k = experts.shape
    flat = rows.reshape(-1, rows.size(-1))
    out = skip1.clone()
    for i in range(n):
        for j in range(k):
            d = int(dst[i * k + j] if by_row else dst[j * n + i])
            row = flat[d] if d >= 0 else torch.zeros_like(flat[0])
            s = float(scales[i, j]) if scales is not None else 1.0
            out[i] += s * (row + bias[experts[i, j]])
    return out


def test_finalize_routing_drop_pad_reads_expert_capacity_rows(npu: types.ModuleType) -> None:
    e, c, hidden, n = 4, 3, 5, 6
    rows = torch.randn(e, c, hidden, generator=_g(2))
    skip1 = torch.randn(n, hidden, generator=_g(3))
    bias = torch.randn(e, hidden, generator=_g(4))
    dst = torch.randperm(e * c, generator=_g(5))[:n].to(torch.int32)
    dst[2] = -1  # a dropped token: no row, its bias still counts
    experts = torch.randint(0, e, (n, 1), generator=_g(6), dtype=torch.int32)
    out = npu.npu_moe_finalize_routing(rows, skip1, None, bias, None, dst, experts, 1)
    assert out.shape == (n, hidden)
    torch.testing.assert_close(out, _finalize_expected(rows, skip1, bias, None, dst, experts))
    assert torch.ops.npu.npu_moe_finalize_routing(  # the fake agrees on the shape
        rows.to("meta"), skip1.to("meta"), None, bias.to("meta"), None, dst.to("meta"),
        experts.to("meta"), 1).shape == (n, hidden)


def test_finalize_routing_drop_pad_shape_passes_strict_only_in_its_mode(
        npu: types.ModuleType) -> None:
    e, c, hidden, n = 4, 3, 5, 6
    rows = torch.randn(e, c, hidden, generator=_g(2))
    skip1 = torch.randn(n, hidden, generator=_g(3))
    bias = torch.randn(e, hidden, generator=_g(4))
    dst = torch.arange(n, dtype=torch.int32)
    experts = torch.zeros(n, 1, dtype=torch.int32)
    with opcontracts.mode("strict"):
        npu.npu_moe_finalize_routing(rows, skip1, None, bias, None, dst, experts, 1)
        with pytest.raises(ContractViolation) as info:  # (E, C, H) is not drop-less's shape
            npu.npu_moe_finalize_routing(rows, skip1, None, bias, None, dst, experts, 0)
    assert info.value.arg == "expanded_permuted_rows"


def test_finalize_routing_row_arranged_indices(npu: types.ModuleType) -> None:
    n, k, hidden, e = 3, 2, 4, 5
    rows = torch.randn(n * k, hidden, generator=_g(7))
    skip1 = torch.randn(n, hidden, generator=_g(8))
    bias = torch.randn(e, hidden, generator=_g(9))
    scales = torch.rand(n, k, generator=_g(10))
    dst = torch.randperm(n * k, generator=_g(11)).to(torch.int32)
    experts = torch.randint(0, e, (n, k), generator=_g(12), dtype=torch.int32)
    out = npu.npu_moe_finalize_routing(rows, skip1, None, bias, scales, dst, experts, 2)
    torch.testing.assert_close(
        out, _finalize_expected(rows, skip1, bias, scales, dst, experts, by_row=True))


# --------------------------------------------------------------------------- grouped matmul
def _gmm_inputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.randn(6, 8, generator=_g(13))],
            [torch.randn(8, 5, generator=_g(14)), torch.randn(8, 5, generator=_g(15))])


def test_grouped_matmul_without_group_type_raises_as_the_glue(npu: types.ModuleType) -> None:
    x, w = _gmm_inputs()
    with pytest.raises(RuntimeError, match="Requires manual passing group_type"):
        npu.npu_grouped_matmul(x, w, group_list=None, split_item=0)
    # the int[] group_list overload checks no group_type (its glue has no such check)
    npu.npu_grouped_matmul(x, w, group_list=[2, 6], split_item=0)


@pytest.mark.parametrize("group_type", [1, 3, 100])
def test_grouped_matmul_invalid_group_type_raises_as_the_glue(npu: types.ModuleType,
                                                              group_type: int) -> None:
    x = [torch.randn(16, 4, generator=_g(16))]
    w = [torch.randn(4, 16, 3, generator=_g(17))]
    with pytest.raises(RuntimeError, match=rf"The group type must be -1, 0 or 2, but now is "
                                           rf"\[{group_type}\]"):
        npu.npu_grouped_matmul(x, w, group_list=torch.tensor([2, 4, 8, 16]), split_item=3,
                               group_type=group_type)


def test_grouped_matmul_empty_lists_raise_as_the_glue(npu: types.ModuleType) -> None:
    bias = [torch.randn(4, generator=_g(18))]
    with pytest.raises(RuntimeError, match="neither x nor weight could be empty"):
        npu.npu_grouped_matmul([], [], bias=bias, split_item=0, group_type=-1)
    with pytest.raises(RuntimeError, match="neither x nor weight could be empty"):
        torch.ops.npu.npu_grouped_matmul.List([], [], bias=bias, split_item=0)


def test_grouped_matmul_split_item_and_lengths_checked(npu: types.ModuleType) -> None:
    x, w = _gmm_inputs()
    with pytest.raises(RuntimeError, match=r"Invalid value of split_item \[5\]"):
        npu.npu_grouped_matmul(x, w, split_item=5, group_type=-1)
    with pytest.raises(RuntimeError, match="the num of x tensors must equal the num of weight"):
        npu.npu_grouped_matmul(x, w, split_item=0, group_type=-1)
    with pytest.raises(RuntimeError, match=r"length of weight equals that of group_list"):
        npu.npu_grouped_matmul(x, w, group_list=torch.tensor([1, 3, 6]), split_item=0,
                               group_type=0)


def test_grouped_matmul_checks_run_under_the_fake_too(npu: types.ModuleType) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = _gmm_inputs()
    with FakeTensorMode() as mode:
        fx, fw = [mode.from_tensor(t) for t in x], [mode.from_tensor(t) for t in w]
        with pytest.raises(RuntimeError, match="Requires manual passing group_type"):
            torch.ops.npu.npu_grouped_matmul(fx, fw, split_item=0)


# --------------------------------------------------------------------------- rotary mul
def test_rotary_mul_quarter_mode_raises_as_the_glue(npu: types.ModuleType) -> None:
    x, r = torch.rand(2, 2, 5, 128), torch.rand(1, 2, 1, 128)
    with pytest.raises(RuntimeError, match="The rotary_mode of npu_rotary_mul should be half or "
                                           "interleave, but got quarter"):
        npu.npu_rotary_mul(x, r, r, "quarter")
    with pytest.raises(RuntimeError, match="The rotary_mode of npu_rotary_mul_backward should be "
                                           "half or interleave, but got quarter"):
        npu.npu_rotary_mul_backward(x, x, r, r, "quarter")
    assert npu.npu_rotary_mul(x, r, r, "interleave").shape == x.shape


# --------------------------------------------------------------------------- ops torch_npu's tests call
def test_trans_quant_param_packs_fp19_scale_and_offset(npu: types.ModuleType) -> None:
    scale = torch.tensor([2.7, 1.3])
    out = npu.npu_trans_quant_param(scale)
    bits = scale.view(torch.int32).to(torch.int64) & 0xFFFFE000
    assert out.dtype == torch.int64 and torch.equal(out, bits | (1 << 46))
    # offset: rounded, clamped to [-256, 255], its 9 bits at 37..45; a 1-D scale broadcasts
    packed = npu.npu_trans_quant_param(torch.tensor([2.7]), torch.tensor([3.4, -300.0, 7.0]))
    assert packed.shape == (3,)
    assert [int((v >> 37) & 0x1FF) for v in packed] == [3, (-256) & 0x1FF, 7]
    with pytest.raises(RuntimeError, match="round_mode must be 0 or 1"):
        npu.npu_trans_quant_param(scale, round_mode=2)


def test_quantize_per_channel_and_ascend_quant(npu: types.ModuleType) -> None:
    x = torch.randn(3, 5, generator=_g(20))
    scales = torch.rand(5, generator=_g(21)) + 0.1
    zero = torch.randint(-2, 3, (5,), generator=_g(22), dtype=torch.int32)
    for qtype, out in [(torch.qint8, torch.int8), (torch.quint8, torch.uint8),
                       (torch.qint32, torch.int32)]:
        got = npu.npu_quantize(x, scales, zero, qtype, 1)
        want = torch.round(x / scales) + zero
        info = torch.iinfo(out)
        assert got.dtype == out
        assert torch.equal(got, want.clamp(info.min, info.max).to(out))
    # div_mode False: round(x * scale + offset), int8, the scale on the last axis
    half = x.to(torch.float16)
    s16, o16 = scales.to(torch.float16), torch.ones(5, dtype=torch.float16)
    got = npu.npu_quantize(half, s16, o16, torch.qint8, -1, div_mode=False)
    want = torch.round(half.float() * s16.float() + 1).clamp(-128, 127).to(torch.int8)
    assert torch.equal(got, want)


def test_convert_weight_to_int4pack_low_nibble_first(npu: types.ModuleType) -> None:
    w = torch.randint(-8, 8, (3, 16), generator=_g(23), dtype=torch.int32)
    packed = npu.npu_convert_weight_to_int4pack(w)
    assert packed.shape == (3, 2) and packed.dtype == torch.int32
    raw = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(raw >> (4 * i)) & 0xF for i in range(8)], -1).reshape(3, 16)
    assert torch.equal(torch.where(nibbles >= 8, nibbles - 16, nibbles), w.to(torch.int64))


def test_quant_matmul_a4w4_reads_eight_int4_per_int32(npu: types.ModuleType) -> None:
    """A4W4 (the doc): x1 (m, k // 8), x2 (k, n // 8) contiguous, or (k // 8, n) transposed from
    a contiguous (n, k // 8); the first int4 in the lowest bits."""
    m, k, n = 3, 16, 8
    a = torch.randint(-8, 8, (m, k), generator=_g(30), dtype=torch.int32)
    b = torch.randint(-8, 8, (k, n), generator=_g(31), dtype=torch.int32)
    scale = torch.tensor([0.5])
    want = (a.double() @ b.double() * 0.5).to(torch.float16)
    x1 = npu.npu_convert_weight_to_int4pack(a)
    got = npu.npu_quant_matmul(x1, npu.npu_convert_weight_to_int4pack(b), scale,
                               output_dtype=torch.float16)
    assert got.shape == (m, n) and torch.equal(got, want)
    x2_t = npu.npu_convert_weight_to_int4pack(b.t().contiguous()).t()  # (k // 8, n)
    assert torch.equal(npu.npu_quant_matmul(x1, x2_t, scale, output_dtype=torch.float16), want)


def test_prompt_flash_attention_fp16_rounds_the_scores_to_fp16_before_the_scale(
        npu: types.ModuleType) -> None:
    """fp16 without pse_shift is the kernel's high-performance mode: q k^T in fp16 (as op-plugin's
    golden: an fp16 matmul, the scale, softmax in fp32).  With a large scale the fp16 rounding of
    the scores decides which keys win; with pse_shift (high precision) the scores stay fp32."""
    gen = _g(40)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=gen).to(torch.float16) for _ in range(3))

    def golden(round_scores: bool) -> torch.Tensor:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2))
        if round_scores:
            s = s.half().float()
        return (torch.softmax(s * 128, -1) @ v.float()).half()

    got = npu.npu_prompt_flash_attention(q, k, v, num_heads=2, input_layout="BNSD",
                                         scale_value=128.0, pre_tokens=65535, next_tokens=65535)
    assert torch.equal(got, golden(True))
    assert not torch.equal(golden(True), golden(False))  # the case tells the two apart
    zero = torch.zeros(1, 2, 64, 64, dtype=torch.float16)
    precise = npu.npu_prompt_flash_attention(q, k, v, pse_shift=zero, num_heads=2,
                                             input_layout="BNSD", scale_value=128.0,
                                             pre_tokens=65535, next_tokens=65535)
    assert torch.equal(precise, golden(False))


def test_format_cast_keeps_values_and_gradient(npu: types.ModuleType) -> None:
    x = torch.randn(4, 16, generator=_g(24), requires_grad=True)
    y = npu.npu_format_cast(x, 29)
    assert torch.equal(y, x) and y.requires_grad
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_fusion_attention_v3_is_v1_with_tensor_lengths(npu: types.ModuleType) -> None:
    g = _g(25)
    q, k, v = (torch.randn(7, 2, 8, generator=g).to(torch.float16) for _ in range(3))
    lengths = {"actual_seq_qlen": [3, 7], "actual_seq_kvlen": [3, 7]}
    v1 = npu.npu_fusion_attention(q, k, v, 2, "TND", scale=0.3, **lengths)
    v3 = npu.npu_fusion_attention_v3(
        q, k, v, 2, "TND", scale=0.3,
        **{n: torch.tensor(s, dtype=torch.int64) for n, s in lengths.items()})
    assert len(v3) == 6 and v3[4].dtype == v3[5].dtype == torch.int64
    for a, b in zip(v1[:3], v3[:3], strict=True):
        torch.testing.assert_close(a, b)
    dy = torch.randn(7, 2, 8, generator=g).to(torch.float16)
    common = {"softmax_max": v3[1], "softmax_sum": v3[2], "attention_in": v3[0],
              "scale_value": 0.3}
    g1 = npu.npu_fusion_attention_grad(q, k, v, dy, 2, "TND", **common, **lengths)
    g3 = npu.npu_fusion_attention_grad_v3(
        q, k, v, dy, 2, "TND", **common, seed=v3[4], offset=v3[5],
        **{n: torch.tensor(s, dtype=torch.int64) for n, s in lengths.items()})
    for a, b in zip(g1[:3], g3[:3], strict=True):
        torch.testing.assert_close(a, b)


def test_fusion_attention_v3_trains_through_its_grad_kernel(npu: types.ModuleType) -> None:
    q = torch.randn(1, 2, 4, 8, generator=_g(26), requires_grad=True)
    out = npu.npu_fusion_attention_v3(q, q, q, 2, "BNSD", scale=0.3)[0]
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_ring_attention_update_merges_by_softmax_statistics(npu: types.ModuleType) -> None:
    t, n, d = 5, 2, 4
    g = _g(27)
    prev, cur = torch.randn(t, n, d, generator=g), torch.randn(t, n, d, generator=g)
    stats = [(torch.rand(t, n, 1, generator=g) + 0.3).expand(t, n, 8).contiguous()
             for _ in range(4)]
    out, new_max, new_sum = npu.npu_ring_attention_update(
        prev, stats[0], stats[1], cur, stats[2], stats[3],
        actual_seq_qlen=torch.tensor([2, t]), input_layout="TND", input_softmax_layout="TND")
    m = torch.maximum(stats[0], stats[2])
    a, b = stats[1] * torch.exp(stats[0] - m), stats[3] * torch.exp(stats[2] - m)
    torch.testing.assert_close(new_max, m)
    torch.testing.assert_close(new_sum, a + b)
    torch.testing.assert_close(out, prev * (a / (a + b))[..., :1] + cur * (b / (a + b))[..., :1])
