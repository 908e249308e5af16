"""The attention family through ``import opcontracts.patch`` on the CPU emulation (issue 15).

Per op: conforming calls pass in strict mode; each rule's violation is caught naming the
argument; fix mode repairs what it can and the gradients still reach the caller; one
``torch.compile`` call through the fake.  Also the varlen (TND) reference against plain
per-sequence attention, the backward going through the grad kernel, and what an unguarded
call does with what the kernel does not support (silently wrong numbers).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _strict import violation as _violation

import opcontracts
from opcontracts import ContractFixWarning, ContractViolation
from opcontracts.reference import _attention as R

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vals(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/32 in [-0.5, 0.5]: exact in every float dtype."""
    return (torch.randint(-16, 17, shape, generator=_g(seed)) / 32).to(dtype)


def _causal(sq: int, skv: int | None = None) -> torch.Tensor:
    return torch.ones(sq, skv or sq, dtype=torch.bool).triu(1)


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None, pse: torch.Tensor | None = None,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention as the docs write it, (B, N, S, D) in fp64: softmax(scale*(q k^T + pse)) v;
    the sink an extra unscaled logit per head that carries no value (the doc's example)."""
    s = q.double() @ k.double().transpose(-1, -2)
    if pse is not None:
        s = s + pse.double()
    s = s * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    if sink is not None:
        col = sink.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return p @ v.double()


# TND: three sequences of 3, 0 and 4 tokens (the zero-length one is documented: [2, 2, 0, ...])
LENS = [3, 0, 4]
CUM = [3, 3, 7]
T, N, D = 7, 2, 8


def _tnd(dtype: torch.dtype = BF16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return tuple(_vals(T, N, D, dtype=dtype, seed=seed + i) for i in range(3))


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, lens: list[int] = LENS) -> torch.Tensor:
    out, at = [], 0
    for n in lens:
        if n:
            qs, ks, vs = (t[at:at + n].permute(1, 0, 2)[None] for t in (q, k, v))
            mask = _causal(n) if causal else None
            out.append(_plain(qs, ks, vs, scale, mask)[0].permute(1, 0, 2))
        at += n
    return torch.cat(out + [torch.zeros(q.size(0) - at, *q.shape[1:], dtype=FP64)])


# =========================================================================== npu_fusion_attention
@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_fusion_attention_dense_layouts_pass_strict_and_match_the_formula(
        npu: Any, layout: str) -> None:
    b, s, d = 2, 5, 4
    q, k, v = (_vals(b, N, s, d, seed=i) for i in range(3))

    def to(t: torch.Tensor) -> torch.Tensor:
        if layout == "BNSD":
            return t
        if layout == "BSND":
            return t.transpose(1, 2).contiguous()
        if layout == "BSH":
            return t.transpose(1, 2).reshape(b, s, N * d)
        return t.permute(2, 0, 1, 3).reshape(s, b, N * d)

    pse = _vals(1, N, s, s, seed=5)
    with opcontracts.mode("strict"):
        out, smax, ssum, sin, seed, offset, numels = npu.npu_fusion_attention(
            to(q), to(k), to(v), N, layout, pse=pse, atten_mask=_causal(s), scale=0.5)
    assert (seed, offset, numels) == (0, 0, 0) and sin.numel() == 0
    assert smax.shape == ssum.shape == (b, N, s, 8) and smax.dtype == FP32
    want = _plain(q, k, v, 0.5, _causal(s), pse)
    torch.testing.assert_close(out.double(), to(want), atol=1e-2, rtol=1e-2)
    assert not opcontracts.report()


def test_fusion_attention_tnd_is_attention_per_sequence(npu: Any) -> None:
    q, k, v = _tnd()
    tile = _causal(4)  # the SS tile: (maxSq, maxSkv) of the longest sequences
    with opcontracts.mode("strict"):
        out, smax, ssum, *_ = npu.npu_fusion_attention(
            q, k, v, N, "TND", atten_mask=tile, actual_seq_qlen=CUM, actual_seq_kvlen=CUM,
            scale=0.5)
        causal3 = npu.npu_fusion_attention(  # the compressed 2048x2048 tile of sparse_mode 3
            q, k, v, N, "TND", atten_mask=_causal(2048), sparse_mode=3, actual_seq_qlen=CUM,
            actual_seq_kvlen=CUM, scale=0.5)[0]
        full = npu.npu_fusion_attention(q, k, v, N, "TND", actual_seq_qlen=CUM,
                                        actual_seq_kvlen=CUM, scale=0.5)[0]
    assert smax.shape == (T, N, 8)  # the meta kernel's varlen statistics
    want = _per_sequence(q, k, v, 0.5, causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(causal3, out)
    torch.testing.assert_close(full.double(), _per_sequence(q, k, v, 0.5, causal=False),
                               atol=1e-2, rtol=1e-2)
    # trailing zeros: the last sequences take no part (the doc: [2, 5, 9, 0, 0])
    tail = npu.npu_fusion_attention(q, k, v, N, "TND", actual_seq_qlen=[3, 0, 0],
                                    actual_seq_kvlen=[3, 0, 0], scale=0.5)[0]
    torch.testing.assert_close(tail[:3], full[:3])
    assert not tail[3:].any()
    assert not opcontracts.report()


def test_fusion_attention_sink_and_gqa(npu: Any) -> None:
    q = _vals(1, 4, 5, 8)
    k, v = _vals(1, 2, 5, 8, seed=1), _vals(1, 2, 5, 8, seed=2)
    sink = torch.tensor([0.5, -0.25, 0.0, 1.0])
    with opcontracts.mode("strict"):
        out = npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3, sink=sink)[0]
    want = _plain(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0.3, sink=sink)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("change", "arg", "rule"), [
    ({"query": FP64}, "query", "dtype"),
    ({"key": FP16}, "key", "same_dtype"),
    ({"pse": FP32}, "pse", "same_dtype"),
    ({"atten_mask": FP32}, "atten_mask", "dtype"),
    ({"atten_mask": "3d"}, "atten_mask", "rank"),
    ({"query": "5d"}, "query", "rank"),
    ({"head_num": 0}, "head_num", "bound"),
    ({"head_num": 257}, "head_num", "bound"),
    ({"input_layout": "NTD"}, "input_layout", "allowed"),
    ({"sparse_mode": 9}, "sparse_mode", "allowed"),
    ({"keep_prob": 1.5}, "keep_prob", "bound"),
    ({"inner_precise": 3}, "inner_precise", "allowed"),
    ({"actual_seq_kvlen": [3, 7]}, "actual_seq_kvlen", "shape"),
    ({"actual_seq_qlen": []}, "actual_seq_qlen", "shape"),
    ({"actual_seq_qlen": torch.tensor(CUM, dtype=torch.int32)}, "actual_seq_qlen", "dtype"),
    ({"sink": BF16}, "sink", "dtype"),
    ({"sink": "2d"}, "sink", "rank"),
    ({"softmax_layout": "NTD"}, "softmax_layout", "allowed"),
])
def test_fusion_attention_violations_name_the_argument(npu: Any, change: dict[str, Any],
                                                       arg: str, rule: str) -> None:
    q, k, v = _tnd()
    call: dict[str, Any] = dict(query=q, key=k, value=v, head_num=N, input_layout="TND",
                                pse=_vals(1, N, 4, 4, seed=4), atten_mask=_causal(4),
                                actual_seq_qlen=CUM, actual_seq_kvlen=CUM, scale=0.5,
                                sink=torch.zeros(N))
    for name, what in change.items():
        if isinstance(what, torch.dtype):
            call[name] = call[name].to(what)
        elif what == "3d":
            call[name] = call[name][None]
        elif what == "5d":
            call[name] = call[name][None, None]
        elif what == "2d":
            call[name] = call[name][None]
        else:
            call[name] = what
    exc = _violation(npu.npu_fusion_attention, **call)
    assert (exc.arg, exc.rule) == (arg, rule)
    assert f"'{arg}'" in str(exc) and "npu_fusion_attention" in str(exc)


def test_fusion_attention_value_rules_are_opt_in(npu: Any) -> None:
    q, k, v = _tnd()
    bad = [3, -1, 7]
    with opcontracts.mode("strict"):  # values are not read by default
        npu.npu_fusion_attention(q, k, v, N, "TND", actual_seq_qlen=bad, actual_seq_kvlen=CUM)
    opcontracts.set_value_checks(True)
    exc = _violation(npu.npu_fusion_attention, q, k, v, N, "TND", actual_seq_qlen=bad,
                     actual_seq_kvlen=CUM)
    assert (exc.arg, exc.rule) == ("actual_seq_qlen", "value") and "negative" in str(exc)
    with opcontracts.mode("strict"):  # the documented shapes of the list all pass
        for cum in ([3, 3, 7], [3, 7, 0], [0, 3, 7]):
            npu.npu_fusion_attention(q, k, v, N, "TND", actual_seq_qlen=cum,
                                     actual_seq_kvlen=cum)


def test_sink_rules_follow_the_release(npu: Any) -> None:
    """sink is documented (float32) from 2.7.1.post8 / 2.9.0.post6 / 2.10.0.post4 on: on a
    release whose doc says nothing of it, a bf16 sink is not a violation."""
    q, k, v = _tnd()
    bf_sink = torch.zeros(N, dtype=BF16)
    kw = dict(actual_seq_qlen=CUM, actual_seq_kvlen=CUM, sink=bf_sink)
    opcontracts.set_versions(torch_npu="2.12.0")
    assert _violation(npu.npu_fusion_attention, q, k, v, N, "TND", **kw).arg == "sink"
    opcontracts.set_versions(torch_npu="2.9.0")
    with opcontracts.mode("strict"):
        npu.npu_fusion_attention(q, k, v, N, "TND", **kw)


def test_fusion_attention_fix_repairs_and_gradients_reach_the_caller(npu: Any) -> None:
    q = _vals(T, N, D).requires_grad_()
    k = _vals(T, N, D, dtype=FP32, seed=1).requires_grad_()   # fp32 key with bf16 query
    v = _vals(T, N, D, seed=2).requires_grad_()
    sink = torch.zeros(N, dtype=BF16, requires_grad=True)     # the kernel reads float32
    mask = _causal(4)
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = npu.npu_fusion_attention(q, k, v, N, "TND", atten_mask=mask, sink=sink,
                                       actual_seq_qlen=CUM, actual_seq_kvlen=CUM, scale=0.5)[0]
    assert any(issubclass(w.category, ContractFixWarning) for w in seen)
    ref = npu.npu_fusion_attention(q.detach(), k.detach().to(BF16), v.detach(), N, "TND",
                                   atten_mask=_causal(4), sink=sink.detach().float(),
                                   actual_seq_qlen=CUM, actual_seq_kvlen=CUM, scale=0.5)[0]
    torch.testing.assert_close(out, ref)
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert sink.grad is not None and sink.grad.dtype == BF16
    assert k.grad.dtype == FP32 and torch.isfinite(k.grad).all() and k.grad.abs().sum() > 0
    with opcontracts.mode("fix"), pytest.raises(ContractViolation):  # shapes are not repaired
        npu.npu_fusion_attention(q, k, v, N, "TND", actual_seq_qlen=CUM,
                                 actual_seq_kvlen=[3, 7])
    # nor a float mask: 0/1 or additive (0 / -inf), no cast can tell which
    with opcontracts.mode("fix"), pytest.raises(ContractViolation, match="atten_mask"):
        npu.npu_fusion_attention(q, k, v, N, "TND", atten_mask=mask.float(),
                                 actual_seq_qlen=CUM, actual_seq_kvlen=CUM)


def test_backward_runs_the_grad_kernel_as_the_cpp_node_does(npu: Any) -> None:
    """torch_npu's autograd (op-plugin derivatives.yaml) calls npu_fusion_attention_grad from C++
    with the forward's output and statistics: a wrapper on the torch.ops.npu attribute (as
    msprobe-style tools wrap ops) never sees it; the dispatcher does, and its own rules hold
    there (strict: the patch's dispatcher guard; there is no violation)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[dict[str, Any]] = []
    seen: list[Any] = []
    name = "npu_fusion_attention_grad"
    original = getattr(torch.ops.npu, name)  # the packet: the patch guards it at the dispatcher

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(*args, **kwargs)

    # torch finds an op's Python OpOverload through this attribute when the op reaches a
    # Python mode: a wrapper must keep the overloads reachable (as the patch's guards do)
    wrapper.default = original.default  # type: ignore[attr-defined]

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func._schema.name == f"npu::{name}":
                names = [a.name for a in func._schema.arguments]
                seen.append({**dict(zip(names, args, strict=False)), **(kwargs or {})})
            return func(*args, **(kwargs or {}))

    q, k, v = (t.requires_grad_() for t in _tnd())
    out = npu.npu_fusion_attention(q, k, v, N, "TND", atten_mask=_causal(4),
                                   actual_seq_qlen=CUM, actual_seq_kvlen=CUM, scale=0.5)
    setattr(torch.ops.npu, name, wrapper)
    try:
        with opcontracts.mode("strict"), Seen():
            out[0].float().sum().backward()
    finally:
        setattr(torch.ops.npu, name, original)
    assert calls == [] and len(seen) == 1
    kw = seen[0]
    assert kw["attention_in"] is not None and kw["softmax_max"].shape == (T, N, 8)
    assert list(kw["actual_seq_qlen"]) == CUM and kw["scale_value"] == 0.5
    # the gradient is the plain formula's
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _per_sequence_grad(qd, kd, vd)
    for got, exp in zip((q.grad, k.grad, v.grad), want):
        assert got is not None
        torch.testing.assert_close(got.double(), exp, atol=2e-2, rtol=2e-2)


def _per_sequence_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, ...]:
    out = _per_sequence(q, k, v, 0.5, causal=True)
    return torch.autograd.grad(out.sum(), (q, k, v))


def test_grad_kernel_called_directly_as_mindspeed_context_parallelism_does(npu: Any) -> None:
    q, k, v = (_vals(1, N, 5, D, seed=i) for i in range(3))
    out, smax, ssum, *_ = npu.npu_fusion_attention(q, k, v, N, "BNSD", atten_mask=_causal(5),
                                                   scale=0.5)
    dy = _vals(1, N, 5, D, seed=9)
    kw = dict(atten_mask=_causal(5), softmax_max=smax, softmax_sum=ssum, attention_in=out,
              scale_value=0.5)
    with opcontracts.mode("strict"):
        dq, dk, dv, dpse, dsink = npu.npu_fusion_attention_grad(q, k, v, dy, N, "BNSD", **kw)
    assert dpse.numel() == 0 and dsink.numel() == 0
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(_plain(qd, kd, vd, 0.5, _causal(5)), (qd, kd, vd), dy.double())
    for got, exp in zip((dq, dk, dv), want):
        torch.testing.assert_close(got.double(), exp, atol=2e-2, rtol=2e-2)
    exc = _violation(npu.npu_fusion_attention_grad, q, k, v, dy, N, "BNSD",
                     **{**kw, "softmax_max": smax.to(BF16)})
    assert (exc.arg, exc.rule) == ("softmax_max", "dtype")
    exc = _violation(npu.npu_fusion_attention_grad, q, k, v, dy, N, "BNSD",
                     **{**kw, "softmax_sum": ssum[..., :4]})
    assert (exc.arg, exc.rule) == ("softmax_sum", "same_shape")
    exc = _violation(npu.npu_fusion_attention_grad, q, k, v, dy.to(FP16), N, "BNSD", **kw)
    assert (exc.arg, exc.rule) == ("dy", "same_dtype")
    exc = _violation(npu.npu_fusion_attention_grad, q, k, v, dy, N, "BNSD",
                     **{**kw, "attention_in": out[:, :, :4]})
    assert (exc.arg, exc.rule) == ("attention_in", "same_shape")


def test_unchecked_calls_compute_garbage_silently(npu: Any) -> None:
    """Why: what the kernel does not support is not an error, it is wrong numbers.  A bf16
    sink (read as float32 bytes), and in varlen a full (T, T) mask where the SS tile
    (maxSq, maxSkv) belongs: the kernel reads the tile's rows out of the wrong place, and a row
    it masks entirely (unsupported in varlen) becomes NaN."""
    q, k, v = _tnd()
    kw: dict[str, Any] = dict(actual_seq_qlen=CUM, actual_seq_kvlen=CUM, scale=0.5)
    with opcontracts.mode("off"):
        good = npu.npu_fusion_attention(q, k, v, N, "TND", sink=torch.full((N,), 0.5), **kw)[0]
        bad = npu.npu_fusion_attention(q, k, v, N, "TND", sink=torch.full((N,), 0.5, dtype=BF16),
                                       **kw)[0]
        assert bad.shape == good.shape and not torch.allclose(bad.float(), good.float(),
                                                              atol=1e-2)
        tile = npu.npu_fusion_attention(q, k, v, N, "TND", atten_mask=_causal(4), **kw)[0]
        packed = torch.ones(T, T, dtype=torch.bool).triu(1)  # the (T, T) causal mask
        wrong = npu.npu_fusion_attention(q, k, v, N, "TND", atten_mask=packed, **kw)[0]
    assert torch.isfinite(tile).all()
    assert not torch.isfinite(wrong).all() or not torch.allclose(wrong, tile)


def test_fusion_attention_compiles_through_the_fake(npu: Any) -> None:
    """Dynamo traces the guard and the op's fake (backend "eager": the fake gives every
    output's shape and dtype), with no graph break; the compiled call computes what eager
    does and its gradient runs the grad kernel."""
    q, k, v = (t.requires_grad_() for t in _tnd(FP32))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.ops.npu.npu_fusion_attention(q, k, v, N, "TND", atten_mask=_causal(4),
                                                 actual_seq_qlen=CUM, actual_seq_kvlen=CUM,
                                                 scale=0.5)
        return out[0].sum() + out[1].sum()

    torch._dynamo.reset()
    try:
        with opcontracts.mode("strict"):
            explain = torch._dynamo.explain(f)(q, k, v)
            assert explain.graph_break_count == 0
            got = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
        torch.testing.assert_close(got, f(q, k, v))
        g = torch.autograd.grad(got, (q, k, v))
        want = torch.autograd.grad(f(q, k, v), (q, k, v))
        for a, b in zip(g, want):
            torch.testing.assert_close(a, b)
    finally:
        torch._dynamo.reset()


# =========================================================================== v2
def test_fusion_attention_v2_conforming_and_violations(npu: Any) -> None:
    q, k, v = _tnd()
    qr, kr = _vals(T, N, D, seed=7), _vals(T, N, D, seed=8)
    kw: dict[str, Any] = dict(atten_mask=_causal(4), actual_seq_qlen=CUM, actual_seq_kvlen=CUM,
                              scale=0.5)
    with opcontracts.mode("strict"):
        out = npu.npu_fusion_attention_v2(q, k, v, N, "tnd", query_rope=qr, key_rope=kr, **kw)[0]
        plain = npu.npu_fusion_attention_v2(q, k, v, N, "TND", **kw)[0]
    # rope adds query_rope key_rope^T to the scores: attention over [q, q_rope] x [k, k_rope]
    cat = npu.npu_fusion_attention_v2(torch.cat([q, qr], -1), torch.cat([k, kr], -1), v, N,
                                      "TND", **kw)[0]
    torch.testing.assert_close(out, cat)
    assert not torch.equal(out, plain)
    assert _violation(npu.npu_fusion_attention_v2, q, k, v, N, "TND", query_rope=qr.half(),
                      key_rope=kr, **kw).arg == "query_rope"
    assert _violation(npu.npu_fusion_attention_v2, q, k, v, N, "TND", pse_type=4,
                      **kw).arg == "pse_type"
    # pse_type 2/3 take float32 ALiBi slopes whatever query is
    slopes = torch.tensor([0.5, 0.25])
    with opcontracts.mode("strict"):
        alibi = npu.npu_fusion_attention_v2(q, k, v, N, "TND", pse=slopes, pse_type=2, **kw)[0]
    assert torch.isfinite(alibi).all() and not torch.equal(alibi, plain)


def test_fusion_attention_v2_backward_runs_its_grad_kernel(npu: Any) -> None:
    q, k, v = (t.requires_grad_() for t in _tnd())
    qr, kr = (_vals(T, N, D, seed=s).requires_grad_() for s in (7, 8))
    with opcontracts.mode("strict"):
        out = npu.npu_fusion_attention_v2(q, k, v, N, "TND", query_rope=qr, key_rope=kr,
                                          atten_mask=_causal(4), actual_seq_qlen=CUM,
                                          actual_seq_kvlen=CUM, scale=0.5)[0]
        out.float().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v, qr, kr))
    # against autograd through the reference, in fp64
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, qr, kr)]
    ref = R.npu_fusion_attention_v2(leaves[0], leaves[1], leaves[2], N, "TND",
                                    query_rope=leaves[3],
                                    key_rope=leaves[4], atten_mask=_causal(4),
                                    actual_seq_qlen=CUM, actual_seq_kvlen=CUM, scale=0.5)[0]
    want = torch.autograd.grad(ref.sum(), leaves)
    for t, w in zip((q, k, v, qr, kr), want):
        assert t.grad is not None
        torch.testing.assert_close(t.grad.double(), w, atol=3e-2, rtol=3e-2)
    assert not opcontracts.report()


def test_fusion_attention_v2_documented_only_where_the_doc_ships(npu: Any) -> None:
    """The v2 doc ships in 2.7.1.post11, 2.9.0.post9, ... 2.13.0, 2.14.0; elsewhere the
    contract is schema-only (a float64 query is not a violation there, a missing one is)."""
    q, k, v = _tnd(FP64)
    opcontracts.set_versions(torch_npu="2.9.1")
    with opcontracts.mode("strict"):
        npu.npu_fusion_attention_v2(q, k, v, N, "TND", actual_seq_qlen=CUM,
                                    actual_seq_kvlen=CUM)
    assert _violation(npu.npu_fusion_attention_v2, q, None, v, N, "TND").arg == "key"
    opcontracts.set_versions(torch_npu="2.9.0.post9")
    assert _violation(npu.npu_fusion_attention_v2, q, k, v, N, "TND", actual_seq_qlen=CUM,
                      actual_seq_kvlen=CUM).arg == "query"


# =========================================================================== MindSpeed
def test_mindspeed_fusion_attention_v2_is_guarded(npu: Any) -> None:
    from mindspeed.ops.fusion_attention_v2 import npu_fusion_attention, npu_fusion_attention_grad

    q, k, v = (t.requires_grad_() for t in _tnd())
    kw: dict[str, Any] = dict(atten_mask=_causal(4), actual_seq_qlen=CUM, actual_seq_kvlen=CUM,
                              scale=0.5, sparse_mode=0)
    with opcontracts.mode("strict"):
        out, smax, ssum, *_ = npu_fusion_attention(q, k, v, N, "TND", **kw)
        out.float().sum().backward()
    torch.testing.assert_close(out.double(), _per_sequence(q, k, v, 0.5, causal=True),
                               atol=1e-2, rtol=1e-2)
    assert q.grad is not None
    # fp32 is torch_npu's, not MindSpeed's
    q32, k32, v32 = _tnd(FP32)
    exc = _violation(npu_fusion_attention, q32, k32, v32, N, "TND", **kw)
    assert (exc.arg, exc.op) == ("query", "mindspeed.npu_fusion_attention")
    assert "MindSpeed" in (exc.source or "")
    exc = _violation(npu_fusion_attention, q, k, v, N, "TND", q_start_idx=[0, 1], **kw)
    assert (exc.arg, exc.rule) == ("q_start_idx", "shape")
    # the backward MindSpeed's ring attention calls with merged statistics
    dy = _vals(T, N, D, seed=9)
    with opcontracts.mode("strict"):
        dq, dk, dv, dpse = npu_fusion_attention_grad(
            q.detach(), k.detach(), v.detach(), dy, N, "TND", softmax_max=smax,
            softmax_sum=ssum, attention_in=out.detach(), **kw)
    assert dpse is None and dq.shape == q.shape
    exc = _violation(npu_fusion_attention_grad, q.detach(), k.detach(), v.detach(), dy.float(),
                     N, "TND", softmax_max=smax, softmax_sum=ssum, attention_in=out.detach(),
                     **kw)
    assert exc.arg == "grad_outputs"


# =========================================================================== serving
def _decode_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A decode step, BNSD query (2, 2, 1, 8), on a paged cache of 6 blocks of 4 tokens
    (blocknum, blocksize, H = 16): sequences of 6 and 3 tokens in blocks [3, 1] and [0, 5]."""
    q = _vals(2, 2, 1, 8, seed=seed)
    k, v = _vals(6, 4, 16, seed=seed + 1), _vals(6, 4, 16, seed=seed + 2)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    return q, k, v, table


def _contiguous(cache: torch.Tensor, table: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    """Each sequence's (N, len, D) key or value, gathered by hand."""
    out = []
    for b, n in enumerate(lens):
        rows = torch.cat([cache[i] for i in table[b].tolist()])[:n]
        out.append(rows.view(n, 2, 8).transpose(0, 1))
    return out


def test_decode_on_a_paged_cache_is_attention_over_each_sequence(npu: Any) -> None:
    q, k, v, table = _decode_inputs()
    lens = [6, 3]
    with opcontracts.mode("strict"):
        ifa = npu.npu_incre_flash_attention(q, k, v, actual_seq_lengths=lens, block_table=table,
                                            num_heads=2, input_layout="BNSD", block_size=4,
                                            scale_value=0.25)
        fia, lse = npu.npu_fused_infer_attention_score(
            q, k, v, actual_seq_lengths_kv=lens, block_table=table, num_heads=2,
            input_layout="BNSD", block_size=4, scale=0.25, softmax_lse_flag=True)
    ks, vs = _contiguous(k, table, lens), _contiguous(v, table, lens)
    for b in range(2):
        want = _plain(q[b:b + 1], ks[b][None], vs[b][None], 0.25)
        torch.testing.assert_close(ifa[b:b + 1].double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fia, ifa)
    assert lse.shape == (2, 2, 1, 1) and lse.dtype == FP32
    assert not opcontracts.report()


def test_prefill_matches_the_formula_and_the_fused_op(npu: Any) -> None:
    q, k, v = (_vals(2, 2, 4, 8, seed=i) for i in range(3))
    pse = _vals(1, 2, 4, 4, seed=3)
    kw: dict[str, Any] = dict(atten_mask=_causal(4), pse_shift=pse, num_heads=2,
                              input_layout="BNSD")
    with opcontracts.mode("strict"):
        pfa = npu.npu_prompt_flash_attention(q, k, v, scale_value=0.25, **kw)
        fia, lse = npu.npu_fused_infer_attention_score(q, k, v, scale=0.25, **kw)
        bsnd = npu.npu_prompt_flash_attention(q, k, v, scale_value=0.25,
                                              **{**kw, "input_layout": "BNSD_BSND"})
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.25 + pse.double()
    want = torch.softmax(s.masked_fill(_causal(4), float("-inf")), -1) @ v.double()
    torch.testing.assert_close(pfa.double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fia, pfa)
    torch.testing.assert_close(bsnd, pfa.transpose(1, 2))
    assert lse.numel() == 0  # softmax_lse_flag off: the meta kernel's empty tensor
    assert not opcontracts.report()


def test_serving_violations_name_the_argument(npu: Any) -> None:
    q, k, v, table = _decode_inputs()
    kw: dict[str, Any] = dict(actual_seq_lengths=[6, 3], block_table=table, num_heads=2,
                              input_layout="BNSD", block_size=4)
    ifa = npu.npu_incre_flash_attention
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"key": k.half()}, "key", "same_dtype"),
        ({"key": k.to(torch.int8), "value": v.to(torch.int8)}, "key", "dtype"),  # no scales
        ({"value": v[:5]}, "value", "same_shape"),
        ({"block_table": table.long()}, "block_table", "dtype"),
        ({"pse_shift": _vals(2, 2, 1, 8).half()}, "pse_shift", "same_dtype"),
        ({"atten_mask": torch.zeros(2, 1, 1, 8)}, "atten_mask", "dtype"),
        ({"input_layout": "TND"}, "input_layout", "allowed"),
        ({"num_heads": 0}, "num_heads", "bound"),
        ({"inner_precise": 2}, "inner_precise", "allowed"),
    ]
    for change, arg, rule in cases:
        call = {"query": q, "key": k, "value": v, **kw, **change}
        exc = _violation(ifa, **call)
        assert (exc.arg, exc.rule) == (arg, rule), (change, exc)
    # int8 KV (antiquant) with its scales is a documented call
    scale = torch.ones(2, 16, dtype=BF16)
    with opcontracts.mode("strict"):
        out = ifa(q, k.to(torch.int8), v.to(torch.int8), antiquant_scale=scale, **kw)
    assert out.dtype == BF16
    # block ids past the cache (the doc: not validated): caught with value checks on
    bad = table.clone()
    bad[1, 1] = 6
    with opcontracts.mode("strict"):
        ifa(q, k, v, **{**kw, "block_table": bad})
    opcontracts.set_value_checks(True)
    exc = _violation(ifa, q, k, v, **{**kw, "block_table": bad})
    assert (exc.arg, exc.rule) == ("block_table", "value") and "NB" in exc.expected


def test_fused_infer_rules(npu: Any) -> None:
    q, k, v, table = _decode_inputs()
    kw: dict[str, Any] = dict(actual_seq_lengths_kv=[6, 3], block_table=table, num_heads=2,
                              input_layout="BNSD", block_size=4)
    fia = npu.npu_fused_infer_attention_score
    assert _violation(fia, q, k, v, sparse_mode=5, **kw).arg == "sparse_mode"
    assert _violation(fia, q, k, v, **{**kw, "input_layout": "BHSD"}).arg == "input_layout"
    assert _violation(fia, q, k, v, antiquant_mode=2, **kw).arg == "antiquant_mode"
    exc = _violation(fia, q.half(), k.half(), v.half(), quant_scale2=torch.ones(1, dtype=BF16),
                     **kw)
    assert (exc.arg, exc.rule) == ("quant_scale2", "same_dtype")  # bf16 only with bf16 input
    # the layouts of the meta kernel's table pass, and so does npu_trans_quant_param's int64
    with opcontracts.mode("strict"):
        fia(q, k, v, **{**kw, "input_layout": "BNSD_NBSD"})
    opcontracts.check("npu_fused_infer_attention_score", q.to(torch.int8), k.to(torch.int8),
                      v.to(torch.int8), dequant_scale1=torch.ones(1, dtype=torch.int64), **kw)
    # sparse_mode 9 is documented from 2.7.1.post8 / 2.9.0.post6 / 2.10.0.post4 on
    opcontracts.set_versions(torch_npu="2.9.0")
    with opcontracts.mode("strict"):  # not a violation there: that doc states no values
        fia(q, k, v, sparse_mode=7, **kw)


def test_serving_fix_casts_and_unchecked_calls_misread(npu: Any) -> None:
    q, k, v, table = _decode_inputs()
    kw: dict[str, Any] = dict(actual_seq_lengths_kv=[6, 3], num_heads=2, input_layout="BNSD",
                              block_size=4, scale=0.25)
    ref = npu.npu_fused_infer_attention_score(q, k, v, block_table=table, **kw)[0]
    with opcontracts.mode("fix"), pytest.warns(ContractFixWarning, match="key"):
        fixed = npu.npu_fused_infer_attention_score(q, k.float(), v, block_table=table, **kw)[0]
    torch.testing.assert_close(fixed, ref)
    with opcontracts.mode("off"):  # an int64 block table, read as int32: other blocks, silently
        wrong = npu.npu_fused_infer_attention_score(q, k, v, block_table=table.long(), **kw)[0]
    assert wrong.shape == ref.shape and not torch.allclose(wrong.float(), ref.float(), atol=1e-2)


def test_fused_infer_compiles_through_the_fake(npu: Any) -> None:
    q, k, v, table = _decode_inputs()

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = torch.ops.npu.npu_fused_infer_attention_score(
            q, k, v, actual_seq_lengths_kv=[6, 3], block_table=table, num_heads=2,
            input_layout="BNSD_BSND", block_size=4, scale=0.25, softmax_lse_flag=True)
        return out.float().sum() + lse.sum()

    torch._dynamo.reset()
    try:
        with opcontracts.mode("strict"):
            assert torch._dynamo.explain(f)(q, k, v).graph_break_count == 0
            got = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
        torch.testing.assert_close(got, f(q, k, v))
    finally:
        torch._dynamo.reset()


def test_layout_and_sparse_mode_cases(npu: Any) -> None:
    """What the value of sparse_mode / input_layout decides (contract cases): the known step-0
    overflow of varlen runs, a full (T, T) causal mask with sparse_mode 3 (the kernel reads the
    compressed 2048x2048 tile), is caught; TND needs its lengths; head_num is the query's N."""
    q, k, v = _tnd()
    fa = npu.npu_fusion_attention
    lens = {"actual_seq_qlen": CUM, "actual_seq_kvlen": CUM}
    with opcontracts.mode("strict"):
        fa(q, k, v, N, "TND", atten_mask=_causal(2048), sparse_mode=3, **lens)
    e = _violation(fa, q, k, v, N, "TND", atten_mask=_causal(T), sparse_mode=3, **lens)
    assert e.arg == "atten_mask" and "when sparse_mode in (2, 3, 4, 7, 8)" in e.expected
    assert "2048" in e.expected
    assert _violation(fa, q, k, v, N, "TND", sparse_mode=3, **lens).arg == "atten_mask"
    e = _violation(fa, q, k, v, N, "TND", actual_seq_kvlen=CUM)
    assert e.arg == "actual_seq_qlen" and e.rule == "missing"
    assert _violation(fa, q, k, v, N + 1, "TND", **lens).arg == "head_num"
    b = (_vals(1, 4, N, D, seed=i) for i in range(3))
    bq, bk, bv = b
    with opcontracts.mode("strict"):
        fa(bq, bk, bv, N, "BSND")
    assert _violation(fa, bq, bk, bv, 2 * N, "BSND").arg == "head_num"
