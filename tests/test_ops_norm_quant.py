"""The norm / activation / rotary / loss / quantisation family through ``import
opcontracts.patch`` on the CPU emulation (issue 15).

Per op: the calls the callers make (vllm-ascend's serving path, MindSpeed's training path)
pass in strict mode and compute what a plain formula computes; each rule's violation is
caught naming the argument; value rules stay opt-in; the tables scoped to chips follow the
pinned SoC; fix mode casts what a cast repairs and the gradients of the ops trained through
(cross entropy, swiglu through their backward kernels) reach the caller's tensors; the ops
torch_npu has no derivative for raise on backward; without a contract the emulated kernel
misreads what it does not support, silently; everything compiles through the fakes with no
graph break.
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
from opcontracts.compare import ShadowCompare

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
I8, I32, I64 = torch.int8, torch.int32, torch.int64


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vals(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in every float dtype."""
    return (torch.randint(-16, 17, shape, generator=_g(seed)) / 8).to(dtype)


def _pos(*shape: int, dtype: torch.dtype = FP32, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/16 in (0, 1]."""
    return (torch.randint(1, 17, shape, generator=_g(seed)) / 16).to(dtype)


def _rule(exc: ContractViolation) -> tuple[str | None, str | None]:
    return exc.arg, exc.rule


# =========================================================================== add_rms_norm
def test_add_rms_norm_is_add_then_rms_norm(npu: Any) -> None:
    """vllm-ascend's residual add + norm: (y, rstd, x) with x = x1 + x2 the new residual."""
    x1, x2, gamma = _vals(4, 2, 16), _vals(4, 2, 16, seed=1), _vals(16, seed=2)
    with opcontracts.mode("strict"):
        y, rstd, x = npu.npu_add_rms_norm(x1, x2, gamma, 1e-6)
    s = x1.float() + x2.float()
    want_rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(x, s.to(BF16)) and rstd.dtype == FP32 and rstd.shape == (4, 2, 1)
    torch.testing.assert_close(rstd, want_rstd)
    torch.testing.assert_close(y.float(), (s * want_rstd * gamma.float()).to(BF16).float())


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"x1": _vals(4, 16, dtype=FP64)}, "x1", "dtype"),
    ({"x2": _vals(4, 8)}, "x2", "same_shape"),
    ({"gamma": _vals(8)}, "gamma", "shape"),
    ({"gamma": torch.ones(16, dtype=I32)}, "gamma", "dtype"),
], ids=["x1-dtype", "x2-shape", "gamma-size", "gamma-dtype"])
def test_add_rms_norm_rules(npu: Any, change: dict[str, Any], arg: str, rule: str) -> None:
    kw = {"x1": _vals(4, 16), "x2": _vals(4, 16, seed=1), "gamma": _vals(16, seed=2), **change}
    exc = _violation(npu.npu_add_rms_norm, **kw)
    assert _rule(exc) == (arg, rule), str(exc)
    assert "CANN 8.2.RC1 aclnnAddRmsNorm" in (exc.source or "")


def test_add_rms_norm_fix_casts_and_has_no_backward(npu: Any) -> None:
    x1, x2 = _vals(4, 16), _vals(4, 16, seed=1)
    gamma = _vals(16, dtype=FP64, seed=2)
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="gamma"):
        got = npu.npu_add_rms_norm(x1, x2, gamma)
    want = npu.npu_add_rms_norm(x1, x2, gamma.to(BF16))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert gamma.dtype == FP64  # the caller's tensor is untouched
    leaf = x1.clone().requires_grad_()
    y, _, _ = npu.npu_add_rms_norm(leaf, x2, gamma.to(BF16))
    with pytest.raises(RuntimeError, match="derivative for 'npu::npu_add_rms_norm' is not"):
        y.float().sum().backward()  # torch_npu has no backward for it: neither does the emulation


# =========================================================================== swiglu backward
def test_swiglu_trains_through_its_backward_kernel(npu: Any) -> None:
    """npu_swiglu's backward is npu_swiglu_backward (op-plugin derivatives.yaml): the guarded
    kernel is called in backward, and the gradient is SwiGLU's."""
    x = _vals(4, 32).requires_grad_()
    g = _vals(4, 16, seed=1)
    with opcontracts.mode("strict"), ShadowCompare() as sc:
        npu.npu_swiglu(x).backward(g)
    res = sc.result()
    assert res.first is None and res.checked_ops.get("npu_swiglu_backward") == 1
    ref = x.detach().float().requires_grad_()
    a, b = ref.chunk(2, -1)
    (F.silu(a) * b).backward(g.float())
    assert ref.grad is not None and x.grad is not None and x.grad.dtype == BF16
    torch.testing.assert_close(x.grad.float(), ref.grad.to(BF16).float())


@pytest.mark.parametrize(("grad", "x", "arg", "rule"), [
    (_vals(4, 8), _vals(4, 32), "self", "shape"),             # grad_output binds D first
    (_vals(4, 16), _vals(4, 31), "self", "shape"),            # odd: nothing to halve
    (_vals(4, 16, dtype=FP64), _vals(4, 32), "grad_output", "dtype"),
    (_vals(4, 16), _vals(4, 32, dtype=I32), "self", "dtype"),
], ids=["grad-size", "self-odd", "grad-dtype", "self-dtype"])
def test_swiglu_backward_rules(npu: Any, grad: torch.Tensor, x: torch.Tensor, arg: str,
                               rule: str) -> None:
    exc = _violation(npu.npu_swiglu_backward, grad, x)
    assert _rule(exc) == (arg, rule), str(exc)


def test_swiglu_fix_mode_gradient_reaches_the_fp64_input(npu: Any) -> None:
    x = _vals(4, 32, dtype=FP64).requires_grad_()
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="self"):
        y = npu.npu_swiglu(x)
    assert y.dtype == BF16  # the kernel ran on the bf16 copy
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == FP64 and bool(x.grad.abs().sum() > 0)


# =========================================================================== MindSpeed swiglu
def test_mindspeed_fused_swiglu_path_is_guarded(npu: Any) -> None:
    """MindSpeed's BiasSwiGLUFunction.apply calls fused_swiglu by name: its guard (the MindSpeed
    contract, dim=-1 exact) sees the call; gradients flow through npu_swiglu's backward."""
    from mindspeed.core.fusions.fused_bias_swiglu import (  # type: ignore[import-not-found]
        BiasSwiGLUFunction,
        SwiGLUFunction,
    )

    x, bias = _vals(4, 32).requires_grad_(), _vals(32, seed=1)
    with opcontracts.mode("strict"):
        y = BiasSwiGLUFunction.apply(x, bias)
        assert torch.equal(y, npu.npu_swiglu(x.detach() + bias))
        y.float().sum().backward()
        SwiGLUFunction.apply(x.detach())
    assert x.grad is not None and x.grad.shape == x.shape
    exc = _violation(SwiGLUFunction.apply, _vals(4, 31))
    assert exc.op == "mindspeed.fused_swiglu" and _rule(exc) == ("x", "shape")
    assert "MindSpeed master" in (exc.source or "")


# =========================================================================== clipped swiglu
def test_clipped_swiglu_is_the_doc_formula(npu: Any) -> None:
    x = (torch.randint(-80, 81, (6, 16), generator=_g()) / 8).to(BF16)
    gi = torch.tensor([2, 3])
    with opcontracts.mode("strict"):
        y = npu.npu_clipped_swiglu(x, group_index=gi, alpha=1.702, limit=7.0, bias=1.0)
        y_halves = npu.npu_clipped_swiglu(x, interleaved=False)
    xf = x.float()

    def formula(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.clamp(max=7.0), b.clamp(-7.0, 7.0)
        return a * torch.sigmoid(1.702 * a) * (b + 1.0)

    want = formula(xf[:, 0::2], xf[:, 1::2])
    torch.testing.assert_close(y[:5].float(), want[:5].to(BF16).float())
    assert torch.equal(y[5:], torch.zeros(1, 8, dtype=BF16))  # past sum(group_index)
    torch.testing.assert_close(y_halves.float(), formula(*xf.chunk(2, -1)).to(BF16).float())


def test_clipped_swiglu_rules(npu: Any) -> None:
    x = _vals(6, 16)
    assert _rule(_violation(npu.npu_clipped_swiglu, x.t())) == ("x", "contiguous")
    assert _rule(_violation(npu.npu_clipped_swiglu, _vals(16))) == ("x", "rank")
    assert _rule(_violation(npu.npu_clipped_swiglu, x.double())) == ("x", "dtype")
    exc = _violation(npu.npu_clipped_swiglu, x, group_index=torch.tensor([2, 3], dtype=I32))
    assert _rule(exc) == ("group_index", "dtype")
    negative = torch.tensor([4, -1])
    with opcontracts.mode("strict"):
        npu.npu_clipped_swiglu(x, group_index=negative)  # values are not read by default
    opcontracts.set_value_checks(True)
    assert _rule(_violation(npu.npu_clipped_swiglu, x, group_index=negative)) == (
        "group_index", "value")


# =========================================================================== rotary
def _rope_ref(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t1, t2 = t.float().chunk(2, -1)
    return (t.float() * cos.float() + torch.cat([-t2, t1], -1) * sin.float()).to(t.dtype)


def _rope_args(d: int = 64, **change: Any) -> dict[str, Any]:
    b, s = 2, 4
    kw = {"query": _vals(b, s, 4, d), "key": _vals(b, s, 2, d, seed=1),
          "cos": _vals(b, s, 1, d, seed=2), "sin": _vals(b, s, 1, d, seed=3)}
    kw.update(change)
    return kw


def test_apply_rotary_pos_emb_bsnd_and_tnd(npu: Any) -> None:
    kw = _rope_args()
    with opcontracts.mode("strict"):
        q, k = npu.npu_apply_rotary_pos_emb(**kw)
        tnd = {n: v.flatten(0, 1) for n, v in kw.items()}
        q3, k3 = npu.npu_apply_rotary_pos_emb(**tnd, layout="TND")
    assert torch.equal(q, _rope_ref(kw["query"], kw["cos"], kw["sin"]))
    assert torch.equal(k, _rope_ref(kw["key"], kw["cos"], kw["sin"]))
    assert torch.equal(q3, q.flatten(0, 1)) and torch.equal(k3, k.flatten(0, 1))
    leaf = kw["query"].clone().requires_grad_()
    out, _ = npu.npu_apply_rotary_pos_emb(leaf, kw["key"], kw["cos"], kw["sin"])
    with pytest.raises(RuntimeError, match="is not implemented"):
        out.float().sum().backward()  # no backward in torch_npu (its test asserts it raises)


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"key": _vals(2, 4, 2, 64, dtype=FP16)}, "key", "same_dtype"),
    ({"cos": _vals(2, 4, 2, 64)}, "cos", "shape"),                 # head axis must be 1
    ({"key": _vals(2, 5, 2, 64)}, "key", "shape"),                 # S shared
    ({"layout": "SBND"}, "layout", "allowed"),                     # Atlas 350 only
    ({"rotary_mode": "interleave"}, "rotary_mode", "allowed"),     # Atlas 350 only
], ids=["key-dtype", "cos-heads", "key-seq", "layout", "mode"])
def test_apply_rotary_pos_emb_rules(npu: Any, change: dict[str, Any], arg: str,
                                    rule: str) -> None:
    exc = _violation(npu.npu_apply_rotary_pos_emb, **_rope_args(**change))
    assert _rule(exc) == (arg, rule), str(exc)


def test_apply_rotary_pos_emb_head_size_follows_the_chip(npu: Any) -> None:
    """A2/A3 take D 64 or 128; on Atlas 350 (Ascend 950) no table applies (D <= 1024 there)."""
    small = _rope_args(d=32)
    exc = _violation(npu.npu_apply_rotary_pos_emb, **small)
    assert _rule(exc) == ("query", "shape") and "D >= 64" in str(exc)
    opcontracts.set_versions(soc="Ascend950PR")
    with opcontracts.mode("strict"):
        npu.npu_apply_rotary_pos_emb(**small, layout="SBND")
    opcontracts.set_versions(soc="Ascend910B3")
    assert _rule(_violation(npu.npu_apply_rotary_pos_emb, **small)) == ("query", "shape")


def _mrope_ref(positions: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, hs: int,
               section: list[int] | None) -> torch.Tensor:
    """vLLM's MRotaryEmbedding.forward_native, neox style, rotary_dim = head_size."""
    cs = cache.float()[positions]
    cos, sin = cs.chunk(2, -1)
    if section is not None:
        cos = torch.cat([m[i] for i, m in enumerate(cos.split(section, -1))], -1)
        sin = torch.cat([m[i] for i, m in enumerate(sin.split(section, -1))], -1)
    x = q.float().view(q.size(0), -1, hs)
    x1, x2 = x.chunk(2, -1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(q.shape).to(q.dtype)


def test_mrope_rope_and_mrope_modes(npu: Any) -> None:
    t, hs, max_seq = 4, 32, 8
    q, k, cache = _vals(t, 2 * hs), _vals(t, hs, seed=1), _vals(max_seq, hs, seed=2)
    pos1 = torch.tensor([0, 3, 5, 7])
    pos3 = torch.stack([pos1, pos1.flip(0), torch.tensor([1, 1, 2, 2])])
    with opcontracts.mode("strict"):
        q1, k1 = npu.npu_mrope(pos1, q, k, cache, hs)
        q3, k3 = npu.npu_mrope(pos3, q, k, cache, hs, mrope_section=[4, 6, 6])
    assert torch.equal(q1, _mrope_ref(pos1, q, cache, hs, None))
    assert torch.equal(k1, _mrope_ref(pos1, k, cache, hs, None))
    assert torch.equal(q3, _mrope_ref(pos3, q, cache, hs, [4, 6, 6]))
    assert torch.equal(k3, _mrope_ref(pos3, k, cache, hs, [4, 6, 6]))


def _mrope_cos_sin_by_loop(positions: torch.Tensor, cache: torch.Tensor, section: list[int],
                           interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, rotaryDim/2) cos and sin of mrope, one frequency at a time: the three sections in
    order, or interleaved as Qwen3-VL's multimodal rope (t, h, w, t, h, w, ..., then t)."""
    half = cache.size(-1) // 2
    cos, sin = torch.empty(positions.size(1), half), torch.empty(positions.size(1), half)
    bounds = [section[0], section[0] + section[1]]
    for j in range(half):
        if interleave:
            row = 1 if j % 3 == 1 and j < 3 * section[1] else \
                2 if j % 3 == 2 and j < 3 * section[2] else 0
        else:
            row = 0 if j < bounds[0] else 1 if j < bounds[1] else 2
        cos[:, j] = cache.float()[positions[row], j]
        sin[:, j] = cache.float()[positions[row], half + j]
    return cos, sin


def test_mrope_interleaved_cache_mode_takes_frequencies_in_turn(npu: Any) -> None:
    """``cache_mode`` (the doc: how cos and sin are put together): 'default' three sections,
    'interleave' the rows in turn; a CANN with the V2 kernel (9.0.0 here) runs it."""
    from opcontracts.reference._fam_norm_quant import _mrope_rows

    assert _mrope_rows([2, 1, 1], 4, interleave=False).tolist() == [0, 0, 1, 2]
    assert _mrope_rows([2, 1, 1], 4, interleave=True).tolist() == [0, 1, 2, 0]
    assert _mrope_rows([24, 20, 20], 64, interleave=True).bincount().tolist() == [24, 20, 20]
    t, hs, max_seq, section = 4, 32, 8, [6, 5, 5]
    q, k, cache = _vals(t, 2 * hs, dtype=FP32), _vals(t, hs, seed=1, dtype=FP32), \
        _vals(max_seq, hs, seed=2, dtype=FP32)
    pos = torch.stack([torch.tensor([0, 3, 5, 7]), torch.tensor([7, 5, 3, 0]),
                       torch.tensor([1, 1, 2, 2])])
    with opcontracts.versions(cann="9.0.0"), opcontracts.mode("strict"):
        outs = {m: npu.npu_mrope(pos, q, k, cache, hs, mrope_section=section, cache_mode=m)
                for m in ("default", "interleave")}
    for mode, (qo, _) in outs.items():
        cos, sin = _mrope_cos_sin_by_loop(pos, cache, section, mode == "interleave")
        x1, x2 = q.view(t, -1, hs).chunk(2, -1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(q.shape)
        torch.testing.assert_close(qo, want, msg=mode)
    assert not torch.equal(outs["default"][0], outs["interleave"][0])
    # rope mode (positions (T,)): one row, nothing to put together, the same either way
    with opcontracts.versions(cann="9.0.0"):
        rope = [npu.npu_mrope(pos[0], q, k, cache, hs, cache_mode=m)[0]
                for m in ("default", "interleave")]
    assert torch.equal(rope[0], rope[1])


def test_mrope_glue_refuses_what_op_plugin_refuses(npu: Any) -> None:
    """op-plugin's glue: an unknown cache_mode, and 'interleave' where CANN has no
    aclnnRopeWithSinCosCacheV2; a rotary_mode other than 'half' runs gpt-j style there (the
    contract refuses it in strict mode)."""
    t, hs = 4, 32
    q, k, cache = _vals(t, 2 * hs), _vals(t, hs, seed=1), _vals(8, hs, seed=2)
    pos = torch.tensor([0, 3, 5, 7])
    with opcontracts.mode("off"):
        with opcontracts.versions(cann="9.0.0"), \
                pytest.raises(RuntimeError, match="cache_mode only support default or interleave"):
            npu.npu_mrope(pos, q, k, cache, hs, cache_mode="invalid_mode")
        with opcontracts.versions(cann="8.5.0"), \
                pytest.raises(RuntimeError, match="requires aclnnRopeWithSinCosCacheV2"):
            npu.npu_mrope(pos, q, k, cache, hs, cache_mode="interleave")
        odd = npu.npu_mrope(pos, q, k, cache, hs, rotary_mode="quarter")
        gptj = npu.npu_mrope(pos, q, k, cache, hs, rotary_mode="interleave")
    assert torch.equal(odd[0], gptj[0]) and torch.equal(odd[1], gptj[1])
    assert _rule(_violation(npu.npu_mrope, pos, q, k, cache, hs, cache_mode="invalid_mode")) == (
        "cache_mode", "allowed")


def test_mrope_rules_and_positions_in_range(npu: Any) -> None:
    t, hs = 4, 32
    q, k, cache = _vals(t, 2 * hs), _vals(t, hs, seed=1), _vals(8, hs, seed=2)
    pos = torch.tensor([0, 3, 5, 7])
    assert _rule(_violation(npu.npu_mrope, pos.float(), q, k, cache, hs)) == ("positions",
                                                                              "dtype")
    assert _rule(_violation(npu.npu_mrope, pos, q[:3], k, cache, hs)) == ("query", "shape")
    assert _rule(_violation(npu.npu_mrope, pos, q, k, _vals(8, 24), hs)) == (
        "cos_sin_cache", "shape")  # rotaryDim a multiple of 16
    exc = _violation(npu.npu_mrope, pos, q, k, cache, hs, rotary_mode="quarter")
    assert _rule(exc) == ("rotary_mode", "allowed")
    past = torch.tensor([0, 3, 5, 8])  # 8 >= maxSeqLen: an out-of-bounds read
    with opcontracts.mode("strict"):
        npu.npu_mrope(past, q, k, cache, hs)  # values are not read by default
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_mrope, past, q, k, cache, hs)
    assert _rule(exc) == ("positions", "value") and "maxSeqLen" in str(exc)


# =========================================================================== rotary_mul backward
def test_rotary_mul_trains_through_its_backward_kernel(npu: Any) -> None:
    # NpuRotaryMulBackward0 calls npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode): a
    # dispatcher-level observer sees that kernel in backward, as on the NPU
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func.namespace == "npu":
                seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = _vals(1, 4, 2, 8).requires_grad_()
    r1, r2 = _vals(1, 4, 1, 8, seed=1), _vals(1, 4, 1, 8, seed=2)
    with opcontracts.mode("strict"):
        y = npu.npu_rotary_mul(x, r1, r2)
        with Log():
            y.float().sum().backward()
    assert seen == ["npu_rotary_mul_backward.default"]
    x2 = x.detach().float().requires_grad_()
    x1a, x1b = x2.chunk(2, -1)
    (x2 * r1.float() + torch.cat((-x1b, x1a), -1) * r2.float()).sum().backward()
    torch.testing.assert_close(x.grad.float(), x2.grad, atol=1e-2, rtol=1e-2)


def test_rotary_mul_backward_kernel_is_checked_as_its_node_calls_it(npu: Any) -> None:
    from opcontracts.emulation import _captured

    x, r1, r2 = _vals(1, 4, 2, 8), _vals(1, 4, 1, 8, seed=1), _vals(1, 4, 1, 8, seed=2)
    with opcontracts.mode("strict"):
        _captured.call("npu_rotary_mul_backward", _vals(1, 4, 2, 8), x, r1, r2, "half")
        with pytest.raises(ContractViolation, match="expected the dtype of self") as info:
            _captured.call("npu_rotary_mul_backward", _vals(1, 4, 2, 8, dtype=FP32), x, r1, r2,
                           "half")
    assert info.value.arg == "grad"


# =========================================================================== cross entropy
def test_cross_entropy_loss_forward_and_backward_kernel(npu: Any) -> None:
    """Training's default call (mean, no other argument): the loss and log_prob are
    F.cross_entropy's / log_softmax's; backward runs the guarded npu_cross_entropy_loss_backward
    and gives F.cross_entropy's gradient."""
    x = _vals(6, 10).requires_grad_()
    target = torch.randint(0, 10, (6,), generator=_g(1))
    with opcontracts.mode("strict"), ShadowCompare() as sc:
        loss, log_prob, zloss, lse = npu.npu_cross_entropy_loss(x, target)
        loss.backward()
    assert sc.result().first is None
    assert sc.result().checked_ops.get("npu_cross_entropy_loss_backward") == 1
    ref = x.detach().float().requires_grad_()
    want = F.cross_entropy(ref, target)
    want.backward()
    assert loss.shape == (1,) and loss.dtype == BF16 and zloss.shape == (1,) and lse.shape == (6,)
    torch.testing.assert_close(loss.float(), want.reshape(1).to(BF16).float())
    torch.testing.assert_close(log_prob.float(), F.log_softmax(ref.detach(), -1).to(BF16).float())
    assert x.grad is not None and ref.grad is not None and x.grad.dtype == BF16
    # the kernel's gradient comes from the bf16 log_prob it saved: bf16 tolerance
    torch.testing.assert_close(x.grad.float(), ref.grad, atol=1e-3, rtol=2e-2)


def test_cross_entropy_loss_weights_and_smoothing(npu: Any) -> None:
    x = _vals(6, 10, dtype=FP32)
    target = torch.randint(0, 10, (6,), generator=_g(1))
    w = _pos(10)
    with opcontracts.mode("strict"):
        none, *_ = npu.npu_cross_entropy_loss(x, target, w, "none", ignore_index=3)
        total, *_ = npu.npu_cross_entropy_loss(x, target, None, "sum", label_smoothing=0.1)
    torch.testing.assert_close(none, F.cross_entropy(x, target, w, reduction="none",
                                                     ignore_index=3))
    torch.testing.assert_close(total, F.cross_entropy(x, target, reduction="sum",
                                                      label_smoothing=0.1).reshape(1))


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"target": torch.zeros(6, dtype=I32)}, "target", "dtype"),
    ({"target": torch.zeros(5, dtype=I64)}, "target", "shape"),
    ({"weight": _pos(10, dtype=BF16)}, "weight", "dtype"),
    ({"weight": _pos(9)}, "weight", "shape"),
    ({"input": _vals(6, 10, dtype=FP64)}, "input", "dtype"),
    ({"reduction": "avg"}, "reduction", "allowed"),
    ({"ignore_index": 10}, "ignore_index", "bound"),       # must be below C
    ({"label_smoothing": 1.0}, "label_smoothing", "bound"),
    ({"return_zloss": True}, "return_zloss", "allowed"),   # not supported yet
], ids=["target-dtype", "target-shape", "weight-dtype", "weight-shape", "input-dtype",
        "reduction", "ignore_index", "label_smoothing", "return_zloss"])
def test_cross_entropy_loss_rules(npu: Any, change: dict[str, Any], arg: str, rule: str) -> None:
    kw: dict[str, Any] = {"input": _vals(6, 10), "target": torch.zeros(6, dtype=I64), **change}
    exc = _violation(npu.npu_cross_entropy_loss, **kw)
    assert _rule(exc) == (arg, rule), str(exc)


def test_cross_entropy_minus_100_padding_is_not_ignored(npu: Any) -> None:
    """PyTorch ignores target -100 by default; this kernel's ignore_index < 0 ignores nothing,
    so a -100 label is an out-of-range class (value checks catch it)."""
    x, target = _vals(4, 8), torch.tensor([1, -100, 2, 3])
    with opcontracts.mode("strict"):
        npu.npu_cross_entropy_loss(x, target)
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_cross_entropy_loss, x, target)
    assert _rule(exc) == ("target", "value")


def test_cross_entropy_fix_mode_gradient_reaches_the_fp64_input(npu: Any) -> None:
    x = _vals(6, 10, dtype=FP64).requires_grad_()
    target = torch.randint(0, 10, (6,), generator=_g(1))
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="input"):
        loss, *_ = npu.npu_cross_entropy_loss(x, target)
    loss.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == FP64
    ref = x.detach().to(BF16).float().requires_grad_()
    F.cross_entropy(ref, target).backward()
    assert ref.grad is not None
    torch.testing.assert_close(x.grad.float(), ref.grad, atol=1e-2, rtol=1e-2)


def test_cross_entropy_backward_kernel_rules(npu: Any) -> None:
    x, target = _vals(6, 10), torch.randint(0, 10, (6,), generator=_g(1))
    _, log_prob, _, lse = npu.npu_cross_entropy_loss(x, target)
    grad = torch.ones(1, dtype=BF16)
    with opcontracts.mode("strict"):
        npu.npu_cross_entropy_loss_backward(grad, log_prob, target, None, None, lse)
    exc = _violation(npu.npu_cross_entropy_loss_backward, grad, log_prob, target.to(I32))
    assert _rule(exc) == ("target", "dtype")
    exc = _violation(npu.npu_cross_entropy_loss_backward, grad, log_prob[:, :9], target,
                     _pos(10))
    assert _rule(exc) == ("weight", "shape")


# =========================================================================== dynamic quant
def _dynamic_quant_ref(x: torch.Tensor, smooth: torch.Tensor, ends: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.float().clone()
    start = 0
    for g, end in enumerate(ends):
        rows[start:end] *= smooth[g].float()
        start = end
    scale = rows.abs().amax(-1) / 127
    return torch.round(rows / scale.unsqueeze(-1)).clamp(-128, 127).to(I8), scale


def test_dynamic_quant_moe_smooth_scales(npu: Any) -> None:
    x, smooth = _vals(6, 16), _pos(3, 16, dtype=BF16)
    gi = torch.tensor([1, 3, 6], dtype=I32)
    with opcontracts.mode("strict"):
        y, scale = npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=gi)
        y1, scale1 = npu.npu_dynamic_quant(x)
    want_y, want_scale = _dynamic_quant_ref(x, smooth, [1, 3, 6])
    assert torch.equal(y, want_y) and torch.equal(scale, want_scale)
    assert y1.dtype == I8 and scale1.shape == (6,)
    y4, _ = npu.npu_dynamic_quant(x, dst_type=torch.quint4x2)  # eight int4 in an int32
    assert y4.dtype == I32 and y4.shape == (6, 2)


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"input": _vals(6, 16, dtype=FP32)}, "input", "dtype"),          # fp16 / bf16 only
    ({"input": _vals(16)}, "input", "rank"),                          # more than one axis
    ({"smooth_scales": _pos(3, 16, dtype=FP16)}, "smooth_scales", "same_dtype"),
    ({"smooth_scales": _pos(3, 15, dtype=BF16)}, "smooth_scales", "shape"),
    ({"group_index": torch.tensor([1, 3, 6])}, "group_index", "dtype"),
    ({"group_index": torch.tensor([1, 6], dtype=I32)}, "group_index", "shape"),  # one per row
], ids=["input-dtype", "input-rank", "smooth-dtype", "smooth-shape", "gi-dtype", "gi-len"])
@pytest.mark.parametrize("op", ["npu_dynamic_quant", "npu_dynamic_quant_asymmetric"])
def test_dynamic_quant_rules(npu: Any, op: str, change: dict[str, Any], arg: str, rule: str
                             ) -> None:
    """The symmetric and the asymmetric quantisation take the same inputs (their docs)."""
    kw: dict[str, Any] = {"input": _vals(6, 16), "smooth_scales": _pos(3, 16, dtype=BF16),
                          "group_index": torch.tensor([1, 3, 6], dtype=I32), **change}
    exc = _violation(getattr(npu, op), kw.pop("input"), **kw)
    assert _rule(exc) == (arg, rule), str(exc)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Eight signed int4 per int32, the first in the lowest four bits (op-plugin's test reads
    the bytes low nibble first)."""
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).flatten(-2)


@pytest.mark.parametrize(("dst_type", "hi", "lo"), [(None, 127, -128), (torch.quint4x2, 7, -8)])
def test_dynamic_quant_asymmetric_maps_each_row_onto_the_full_range(
        npu: Any, dst_type: torch.dtype | None, hi: int, lo: int) -> None:
    """The doc's formula: scale = (max - min) / (DST_MAX - DST_MIN), offset = DST_MAX - max /
    scale, y = round(x / scale + offset): each row's max lands on DST_MAX and its min on DST_MIN
    (sglang's NPU KV-cache compression calls it per page, int8 and int4)."""
    x, smooth = _vals(6, 16, dtype=FP16), _pos(3, 16, dtype=FP16)
    gi = torch.tensor([1, 3, 6], dtype=I32)
    with opcontracts.mode("strict"):
        y, scale, offset = npu.npu_dynamic_quant_asymmetric(
            x, smooth_scales=smooth, group_index=gi, dst_type=dst_type)
    rows = x.float() * smooth.float().repeat_interleave(torch.tensor([1, 2, 3]), 0)
    mx, mn = rows.amax(-1), rows.amin(-1)
    want_scale = (mx - mn) / (hi - lo)
    torch.testing.assert_close(scale, want_scale)
    torch.testing.assert_close(offset, hi - mx / want_scale)
    q = _unpack_int4(y) if dst_type is not None else y.long()
    assert y.dtype == (I32 if dst_type is not None else I8) and q.shape == (6, 16)
    assert (q.amax(-1) == hi).all() and (q.amin(-1) == lo).all()
    # dequantised, every value within half a step of the input
    back = (q.float() - offset.unsqueeze(-1)) * want_scale.unsqueeze(-1)
    assert ((back - rows).abs() <= want_scale.unsqueeze(-1) / 2 + 1e-6).all()


@pytest.mark.parametrize(("dst_type", "y_dtype", "y_last"), [
    (None, I8, 16), (torch.quint4x2, I32, 2), (torch.float8_e5m2, torch.float8_e5m2, 16),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, 16)])
def test_dynamic_quant_asymmetric_traces_as_its_meta_kernel(
        npu: Any, dst_type: torch.dtype | None, y_dtype: torch.dtype, y_last: int) -> None:
    """Traced (fake tensors), the shapes and dtypes torch_npu 2.14.0's meta kernel gives: those
    of npu_dynamic_quant (fp8 outputs fp8, although the kernel computes no fp8 here) and an
    offset shaped as the scale, per token, per tensor and per channel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), opcontracts.mode("off"):
        x = torch.empty(2, 6, 16, dtype=FP16)
        for mode, stat in (("pertoken", (2, 6)), ("pertensor", (1,)), ("perchannel", (2, 16))):
            y, scale, offset = npu.npu_dynamic_quant_asymmetric(x, dst_type=dst_type,
                                                                quant_mode=mode)
            assert (y.dtype, y.shape[-1]) == (y_dtype, y_last)
            assert scale.shape == offset.shape == stat and offset.dtype == FP32


def test_dynamic_quant_group_index_order_is_a_value_check(npu: Any) -> None:
    x, smooth = _vals(6, 16), _pos(3, 16, dtype=BF16)
    counts = torch.tensor([1, 2, 3], dtype=I32)  # counts where cumulative ends are expected
    with opcontracts.mode("strict"):
        npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=counts)  # (nondecreasing)
    down = torch.tensor([3, 1, 6], dtype=I32)
    with opcontracts.mode("strict"):
        npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=down)  # values not read
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_dynamic_quant, x, smooth_scales=smooth, group_index=down)
    assert _rule(exc) == ("group_index", "value")


def test_dynamic_quant_fp32_input_is_misread_silently_or_cast(npu: Any) -> None:
    x = _vals(6, 16, dtype=FP32)
    with opcontracts.mode("off"):
        bad, _ = npu.npu_dynamic_quant(x)  # the kernel reads the fp32 bytes as bf16
    good, _ = npu.npu_dynamic_quant(x.to(BF16))
    assert not torch.equal(bad, good)
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="input"):
        fixed, _ = npu.npu_dynamic_quant(x)
    assert torch.equal(fixed, good)


# =========================================================================== quant matmul
def test_quant_matmul_w8a8_dynamic_and_static(npu: Any) -> None:
    """vllm-ascend's w8a8 dynamic path (per-channel fp32 scale, per-token scale, bf16 out)
    and the static int8-out path (scale, offset, int32 bias)."""
    m, k, n = 4, 16, 8
    x1 = torch.randint(-5, 6, (m, k), generator=_g(), dtype=I8)
    x2 = torch.randint(-5, 6, (k, n), generator=_g(1), dtype=I8)
    scale, tok = _pos(n) / 8, _pos(m, seed=2)
    bias, offset = torch.randint(-9, 10, (n,), generator=_g(3), dtype=I32), _pos(n, seed=4)
    with opcontracts.mode("strict"):
        y = npu.npu_quant_matmul(x1, x2, scale, pertoken_scale=tok, output_dtype=BF16)
        y8 = npu.npu_quant_matmul(x1, x2, scale, offset=offset, bias=bias)
    acc = x1.double() @ x2.double()
    torch.testing.assert_close(y.float(), ((acc.float() * scale) * tok[:, None]).to(BF16).float())
    want8 = torch.round((acc + bias.double()).float() * scale + offset).clamp(-128, 127)
    assert y8.dtype == I8 and torch.equal(y8, want8.to(I8))


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"x1": torch.zeros(4, 16, dtype=FP16)}, "x1", "dtype"),
    ({"x2": torch.zeros(16, 8, dtype=I32)}, "x2", "same_dtype"),      # int4-in-int32 both or none
    ({"x1": torch.zeros(16, dtype=I8)}, "x1", "rank"),
    ({"scale": torch.ones(1, 8)}, "scale", "rank"),
    ({"scale": torch.ones(8, dtype=FP16)}, "scale", "dtype"),
    ({"pertoken_scale": torch.ones(5)}, "pertoken_scale", "shape"),   # one per row of x1
    ({"bias": torch.zeros(8, dtype=I64)}, "bias", "dtype"),
], ids=["x1-dtype", "x2-dtype", "x1-rank", "scale-rank", "scale-dtype", "pertoken", "bias"])
def test_quant_matmul_rules(npu: Any, change: dict[str, Any], arg: str, rule: str) -> None:
    kw: dict[str, Any] = {"x1": torch.zeros(4, 16, dtype=I8), "x2": torch.zeros(16, 8, dtype=I8),
                          "scale": torch.ones(8), **change}
    exc = _violation(npu.npu_quant_matmul, kw.pop("x1"), kw.pop("x2"), kw.pop("scale"), **kw)
    assert _rule(exc) == (arg, rule), str(exc)


def test_quant_matmul_tables_follow_the_chip(npu: Any) -> None:
    """The doc's dtypes are A2/A3's and the inference products'; an Ascend 950's fp8 call
    (MindSpeed's fp8 recipes) has no table there: set the SoC and it is not flagged."""
    x1 = torch.zeros(4, 16, dtype=torch.float8_e4m3fn)
    x2 = torch.zeros(16, 8, dtype=torch.float8_e4m3fn)
    args = (x1, x2, torch.ones(8))
    assert _rule(_violation(npu.npu_quant_matmul, *args)) == ("x1", "dtype")  # SoC unknown
    opcontracts.set_versions(soc="Ascend950PR")
    with opcontracts.mode("strict"):
        npu.npu_quant_matmul(*args, pertoken_scale=torch.ones(4), output_dtype=BF16)


# =========================================================================== MX quant
def test_dynamic_mx_quant_fp8_and_fp4(npu: Any) -> None:
    x = _vals(4, 64)
    with opcontracts.mode("strict"):
        y8, s8 = npu.npu_dynamic_mx_quant(x, dst_type=292)  # torch_npu.float8_e4m3fn
        y4, s4 = npu.npu_dynamic_mx_quant(x)                # float4_e2m1fn_x2, packed in uint8
        yc, sc = npu.npu_dynamic_mx_quant(_vals(64, 4), axis=0, dst_type=292)
    assert y8.dtype == torch.float8_e4m3fn and y8.shape == (4, 64)
    assert s8.dtype == torch.uint8 and s8.shape == (4, 1, 2)   # two blocks: one pair
    assert y4.dtype == torch.uint8 and y4.shape == (4, 32) and s4.shape == (4, 1, 2)
    assert yc.shape == (64, 4) and sc.shape == (1, 4, 2)
    block_scale = torch.exp2(s8.float() - 127).reshape(4, 2, 1)  # E8M0: 2^(byte - 127)
    back = (y8.float().view(4, 2, 32) * block_scale).view(4, 64)
    torch.testing.assert_close(back, x.float(), atol=0.125, rtol=0.07)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"input": torch.zeros(4, 64, dtype=I8)}, "input", "dtype"),
    ({"input": torch.zeros(*[1] * 8, 64)}, "input", "rank"),
    ({"block_size": 16}, "block_size", "bound"),
    ({"scale_alg": 3}, "scale_alg", "allowed"),
    ({"round_mode": "ceil"}, "round_mode", "allowed"),
], ids=["dtype", "rank", "block", "scale_alg", "round"])
def test_dynamic_mx_quant_rules(npu: Any, change: dict[str, Any], arg: str, rule: str) -> None:
    kw: dict[str, Any] = {"input": _vals(4, 64), **change}
    exc = _violation(npu.npu_dynamic_mx_quant, kw.pop("input"), **kw)
    assert _rule(exc) == (arg, rule), str(exc)


def test_dynamic_mx_quant_table_is_the_950s(npu: Any) -> None:
    opcontracts.set_versions(soc="Ascend910B3")  # the doc names Ascend 950PR/950DT only
    with opcontracts.mode("strict"):
        npu.npu_dynamic_mx_quant(_vals(4, 64), block_size=16)  # no table applies: unchecked
    opcontracts.set_versions(soc="Ascend950DT")
    assert _rule(_violation(npu.npu_dynamic_mx_quant, _vals(4, 64), block_size=16)) == (
        "block_size", "bound")


# =========================================================================== dequant swiglu quant
def _dsq_kwargs(**change: Any) -> dict[str, Any]:
    """vllm-ascend's MoE call: int32 grouped-matmul output, per-group weight scales, per-token
    activation scales, smooth quant scales, token counts per group, dynamic quant."""
    t, h2 = 4, 16
    kw: dict[str, Any] = {
        "x": torch.randint(-50, 51, (t, h2), generator=_g(), dtype=I32),
        "weight_scale": _pos(2, h2) / 8, "activation_scale": _pos(t, seed=1),
        "quant_scale": _pos(2, h2 // 2, seed=2), "group_index": torch.tensor([1, 3]),
        "activate_left": True, "quant_mode": 1}
    kw.update(change)
    return kw


def test_dequant_swiglu_quant_is_dequant_swiglu_dynamic_quant(npu: Any) -> None:
    kw = _dsq_kwargs()
    with opcontracts.mode("strict"):
        y, scale = npu.npu_dequant_swiglu_quant(**kw)
    group = torch.tensor([0, 1, 1, 1])
    v = kw["x"].float() * kw["weight_scale"][group] * kw["activation_scale"][:, None]
    a, b = v.chunk(2, -1)
    act = F.silu(a) * b * kw["quant_scale"][group]
    want_scale = act.abs().amax(-1) / 127
    assert torch.equal(scale, want_scale)
    assert torch.equal(y, torch.round(act / want_scale[:, None]).clamp(-128, 127).to(I8))


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"x": torch.zeros(4, 16, dtype=FP16)}, "x", "dtype"),            # int32 or bf16
    ({"x": torch.zeros(4, 15, dtype=I32)}, "x", "shape"),             # 2H: even
    ({"weight_scale": _pos(2, 16, dtype=BF16)}, "weight_scale", "dtype"),
    ({"weight_scale": _pos(2, 8)}, "weight_scale", "shape"),          # 2H, not H
    ({"quant_scale": _pos(3, 8)}, "quant_scale", "shape"),            # groupNum rows
    ({"group_index": torch.tensor([1, 3], dtype=I32)}, "group_index", "dtype"),
    ({"quant_mode": 2}, "quant_mode", "allowed"),
], ids=["x-dtype", "x-odd", "ws-dtype", "ws-shape", "qs-groups", "gi-dtype", "quant_mode"])
def test_dequant_swiglu_quant_rules(npu: Any, change: dict[str, Any], arg: str,
                                    rule: str) -> None:
    exc = _violation(npu.npu_dequant_swiglu_quant, **_dsq_kwargs(**change))
    assert _rule(exc) == (arg, rule), str(exc)


def test_dequant_swiglu_quant_counts_and_fix(npu: Any) -> None:
    negative = _dsq_kwargs(group_index=torch.tensor([5, -1]))
    with opcontracts.mode("strict"):
        npu.npu_dequant_swiglu_quant(**negative)  # values are not read by default
    opcontracts.set_value_checks(True)
    assert _rule(_violation(npu.npu_dequant_swiglu_quant, **negative)) == ("group_index",
                                                                            "value")
    opcontracts.set_value_checks(False)
    kw = _dsq_kwargs()
    ws16 = kw["weight_scale"].to(BF16)
    with opcontracts.mode("off"):
        bad = npu.npu_dequant_swiglu_quant(**{**kw, "weight_scale": ws16})  # misread as fp32
    good = npu.npu_dequant_swiglu_quant(**{**kw, "weight_scale": ws16.float()})
    assert not torch.equal(bad[0], good[0])
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="weight_scale"):
        fixed = npu.npu_dequant_swiglu_quant(**{**kw, "weight_scale": ws16})
    assert all(torch.equal(a, b) for a, b in zip(fixed, good, strict=True))


# =========================================================================== torch.compile
def test_the_family_compiles_through_the_fakes_without_graph_breaks(npu: Any) -> None:
    """Every op of the family once, guarded (strict), in one compiled function: the fakes'
    shapes and dtypes are the kernels' (fullgraph: no graph break), and the result is eager's."""
    x, g16 = _vals(4, 32), _vals(16, seed=1)
    q, cos = _vals(1, 4, 2, 64, seed=2), _vals(1, 4, 1, 64, seed=3)
    target = torch.tensor([1, 0, 3, 2])
    x1 = torch.randint(-5, 6, (4, 32), generator=_g(), dtype=I8)
    w8 = torch.randint(-5, 6, (32, 8), generator=_g(1), dtype=I8)
    ops = torch.ops.npu

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = ops.npu_swiglu(x)                                      # (4, 16)
        gx = ops.npu_swiglu_backward(h, x)
        y, rstd, res = ops.npu_add_rms_norm(h, h, g16)
        c = ops.npu_clipped_swiglu(x, group_index=torch.tensor([4]))
        qo, ko = ops.npu_apply_rotary_pos_emb(q, q, cos, cos)
        mq, mk = ops.npu_mrope(torch.tensor([0, 1, 2, 3]), x, h, torch.ones(4, 16, dtype=BF16),
                               16)
        loss, log_prob, _, lse = ops.npu_cross_entropy_loss(y, target)
        gin = ops.npu_cross_entropy_loss_backward(torch.ones(1, dtype=BF16), log_prob, target,
                                                  None, None, lse)
        qy, qs = ops.npu_dynamic_quant(y)
        mm = ops.npu_quant_matmul(x1, w8, torch.ones(8), pertoken_scale=torch.ones(4),
                                  output_dtype=BF16)
        my, ms = ops.npu_dynamic_mx_quant(x, dst_type=292)
        dy, ds = ops.npu_dequant_swiglu_quant(x1.to(I32), weight_scale=torch.ones(1, 32),
                                              activation_scale=torch.ones(4), quant_mode=1)
        return (gx, rstd, res, c, qo, ko, mq, mk, loss, gin, qy, qs, mm, my.float(), ms, dy, ds)

    with opcontracts.mode("strict"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        eager = step(x)
        compiled = torch.compile(step, backend="eager", fullgraph=True)(x)
    for a, b in zip(compiled, eager, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b)
