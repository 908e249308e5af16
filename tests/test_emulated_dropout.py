"""Dropout on the emulated NPU as torch_npu's kernels and generator have it: the bit mask of
``_npu_dropout_gen_mask`` (op-plugin's length and bit layout, drawn at a seed and offset), the
NPU generator's Philox seed and offset (``manual_seed`` resets the offset, each fusion attention
with dropout takes ``philox_engine_inputs(10)``), and fusion attention with ``keep_prob`` < 1
dropping exactly the mask drawn at the seed and offset it returns, forward and backward: what
op-plugin's flash-attention tests build their golden from."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch


@pytest.fixture
def npu(npu_device: Any) -> Any:
    """conftest's ``npu_device``: the emulation with its device, no patch."""
    return npu_device


def _bits(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The kept flags as op-plugin's tests read them: little-endian bits of the uint8 mask."""
    return torch.from_numpy(np.unpackbits(mask.cpu().numpy(), count=count, bitorder="little"))


def _mask(npu: Any, numels: int, p: float, seed: int, offset: int = 0) -> torch.Tensor:
    anchor = torch.zeros(1, device="npu")
    return npu._npu_dropout_gen_mask(anchor, [numels], p=p, seed=seed, offset=offset,
                                     parallel=True, sync=False)


def _golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            keep: torch.Tensor, keep_prob: float) -> torch.Tensor:
    """BNSD attention in fp32 with the dropout of the mask ``keep`` (B, N, Sq, Skv)."""
    p = torch.softmax(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, -1)
    return torch.matmul(p * keep.float() / keep_prob, v.float())


def _qkv(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(3)]


# -- the mask ---------------------------------------------------------------------------------
def test_gen_mask_has_the_kernels_length_and_bit_layout(npu: Any) -> None:
    m = npu._npu_dropout_gen_mask(torch.zeros(1, device="npu"), [3, 100], p=0.25, seed=5,
                                  offset=0)
    assert (m.dtype, tuple(m.shape), m.device.type) == (torch.uint8, (48,), "npu")  # 384 bits
    bits = _bits(m, 384)
    assert bits[300:].sum() == 0  # past the elements: nothing kept
    assert 0.6 < bits[:300].float().mean() < 0.9  # each kept with probability 1 - p
    assert torch.equal(_bits(_mask(npu, 300, 0.0, 5), 300), torch.ones(300, dtype=torch.uint8))
    assert _bits(_mask(npu, 300, 1.0, 5), 300).sum() == 0
    # the operator's only overload is .Tensor, as op-plugin's schema
    assert npu._npu_dropout_gen_mask.overloads() == ["Tensor"]


def test_gen_mask_is_a_function_of_seed_and_offset(npu: Any) -> None:
    a = _mask(npu, 4096, 0.5, seed=3, offset=0)
    assert torch.equal(a.cpu(), _mask(npu, 4096, 0.5, seed=3, offset=0).cpu())
    assert not torch.equal(a.cpu(), _mask(npu, 4096, 0.5, seed=3, offset=12).cpu())
    assert not torch.equal(a.cpu(), _mask(npu, 4096, 0.5, seed=4, offset=0).cpu())


def test_gen_mask_refuses_a_probability_outside_0_1_as_the_glue(npu: Any) -> None:
    with pytest.raises(RuntimeError, match="dropout probability has to be between 0 and 1"):
        _mask(npu, 128, 1.5, seed=1)


# -- the generator ----------------------------------------------------------------------------
def test_manual_seed_resets_the_offset_and_each_dropout_call_advances_it(npu: Any) -> None:
    q, k, v = (t.to("npu") for t in _qkv((1, 2, 8, 4), 0))
    torch.npu.manual_seed(9)  # type: ignore[attr-defined]
    draws = [tuple(npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.8)[4:6])
             for _ in range(2)]
    assert draws == [(9, 0), (9, 12)]  # philox_engine_inputs(10): rounded up to 4
    torch.manual_seed(9)  # torch's seed reaches the npu generator (manual_seed_all)
    assert tuple(npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.8)[4:6]) == (9, 0)
    # without dropout the generator is not used
    out = npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=1.0)
    assert tuple(out[4:]) == (0, 0, 0)
    assert tuple(npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.8)[4:6]) == (9, 12)


def test_the_rng_state_saves_the_dropout_stream(npu: Any) -> None:
    """An activation checkpoint's recompute restores the device's rng state: the same mask."""
    q, k, v = (t.to("npu") for t in _qkv((1, 2, 16, 4), 1))
    torch.npu.manual_seed(4)  # type: ignore[attr-defined]
    npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.5)
    state = torch.npu.get_rng_state()  # type: ignore[attr-defined]
    first = npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.5)
    torch.npu.set_rng_state(state)  # type: ignore[attr-defined]
    again = npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.5)
    assert tuple(again[4:6]) == tuple(first[4:6]) == (4, 12)
    assert torch.equal(again[0].cpu(), first[0].cpu())
    # a real torch_npu state (seed, offset: 16 bytes) sets the NPU generator alone
    real = torch.tensor(list((4).to_bytes(8, "little") + (24).to_bytes(8, "little")),
                        dtype=torch.uint8)
    torch.npu.set_rng_state(real)  # type: ignore[attr-defined]
    assert tuple(npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.5)[4:6]) == (4, 24)


# -- fusion attention with dropout ------------------------------------------------------------
@pytest.mark.parametrize("op", ["npu_fusion_attention", "npu_fusion_attention_v2"])
def test_fusion_attention_drops_the_mask_at_its_seed_and_offset(npu: Any, op: str) -> None:
    b, n, s, d, keep_prob, scale = 2, 3, 16, 8, 0.7, 0.35
    q, k, v = _qkv((b, n, s, d), 2)
    torch.npu.manual_seed(2)  # type: ignore[attr-defined]
    keep = _bits(_mask(npu, b * n * s * s, 1 - keep_prob, seed=2), b * n * s * s)
    keep = keep.view(b, n, s, s)
    assert 0 < keep.float().mean() < 1
    leaves = [t.to("npu").requires_grad_() for t in (q, k, v)]
    out = getattr(npu, op)(*leaves, n, "BNSD", scale=scale, keep_prob=keep_prob)
    assert tuple(out[4:]) == (2, 0, b * n * s * s)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    golden = _golden(*ref_leaves, scale, keep, keep_prob)
    torch.testing.assert_close(out[0].cpu(), golden, rtol=1e-5, atol=1e-5)
    # without the mask the result differs: the dropout is applied
    assert not torch.allclose(out[0].cpu(), _golden(q, k, v, scale, torch.ones_like(keep), 1.0))
    dy = torch.randn(golden.shape, generator=torch.Generator().manual_seed(3))
    out[0].backward(dy.to("npu"))
    golden.backward(dy)
    for got, want in zip(leaves, ref_leaves):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-5)


def test_fusion_attention_takes_an_external_mask_and_keeps_the_generator(npu: Any) -> None:
    b, n, s, d, keep_prob = 1, 2, 8, 4, 0.6
    q, k, v = _qkv((b, n, s, d), 5)
    mask = _mask(npu, b * n * s * s, 1 - keep_prob, seed=77, offset=8)
    keep = _bits(mask, b * n * s * s).view(b, n, s, s)
    torch.npu.manual_seed(1)  # type: ignore[attr-defined]
    out = npu.npu_fusion_attention(q.to("npu"), k.to("npu"), v.to("npu"), n, "BNSD",
                                   keep_prob=keep_prob, dropout_mask=mask, seed=77, offset=8)
    assert tuple(out[4:6]) == (77, 8)
    torch.testing.assert_close(out[0].cpu(), _golden(q, k, v, 1.0, keep, keep_prob))
    # the generator was not drawn from: the next dropout call gets offset 0
    again = npu.npu_fusion_attention(q.to("npu"), k.to("npu"), v.to("npu"), n, "BNSD",
                                     keep_prob=keep_prob)
    assert tuple(again[4:6]) == (1, 0)


def test_varlen_dropout_lays_the_mask_out_one_sequence_after_the_other(npu: Any) -> None:
    """TND: the mask is N * sum(sq * skv) bits, each sequence an (N, sq, skv) block."""
    n, d, keep_prob = 2, 4, 0.75
    lens_q, lens_kv = [2, 3], [4, 5]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(sum(lens_q), n, d, generator=gen)
    k = torch.randn(sum(lens_kv), n, d, generator=gen)
    v = torch.randn(sum(lens_kv), n, d, generator=gen)
    numels = n * sum(a * b for a, b in zip(lens_q, lens_kv))
    torch.npu.manual_seed(11)  # type: ignore[attr-defined]
    keep = _bits(_mask(npu, numels, 1 - keep_prob, seed=11), numels)
    out = npu.npu_fusion_attention(q.to("npu"), k.to("npu"), v.to("npu"), n, "TND",
                                   keep_prob=keep_prob, actual_seq_qlen=[2, 5],
                                   actual_seq_kvlen=[4, 9])
    assert tuple(out[4:]) == (11, 0, numels)
    at, q0, k0 = 0, 0, 0
    for sq, skv in zip(lens_q, lens_kv):
        block = keep[at:at + n * sq * skv].view(1, n, sq, skv)
        qi, ki, vi = (t.permute(1, 0, 2).unsqueeze(0) for t in
                      (q[q0:q0 + sq], k[k0:k0 + skv], v[k0:k0 + skv]))
        want = _golden(qi, ki, vi, 1.0, block, keep_prob)[0].permute(1, 0, 2)
        torch.testing.assert_close(out[0][q0:q0 + sq].cpu(), want)
        at, q0, k0 = at + n * sq * skv, q0 + sq, k0 + skv


def test_fusion_attention_v3_returns_its_draw_as_tensors_and_trains(npu: Any) -> None:
    b, n, s, d, keep_prob = 1, 2, 8, 4, 0.5
    q, k, v = _qkv((b, n, s, d), 8)
    torch.npu.manual_seed(3)  # type: ignore[attr-defined]
    keep = _bits(_mask(npu, b * n * s * s, 1 - keep_prob, seed=3), b * n * s * s)
    leaves = [t.to("npu").requires_grad_() for t in (q, k, v)]
    out = npu.npu_fusion_attention_v3(*leaves, n, "BNSD", keep_prob=keep_prob)
    seed, offset = out[4], out[5]
    assert (seed.dtype, seed.tolist(), offset.tolist()) == (torch.int64, [3], [0])
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    golden = _golden(*ref_leaves, 1.0, keep.view(b, n, s, s), keep_prob)
    torch.testing.assert_close(out[0].cpu(), golden)
    out[0].sum().backward()
    golden.sum().backward()
    for got, want in zip(leaves, ref_leaves):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-5)
