"""The shipped contract packs, exercised through the CPU emulation of the NPU ops.

For every shipped contract (every ``when`` variant): a call that conforms to it passes in
strict mode through each of its targets and returns what the reference kernel returns; every
tensor argument in a wrong dtype or rank is reported naming that argument; and the documented
violations (broken ``N*K``, index widths, duplicate sorted_indices, group_list sums, ...) are
caught.  The last tests show why: unchecked, the emulated bf16-only kernel misreads fp32 probs.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import opcontracts
from opcontracts import Contract, ContractViolation
from opcontracts._engine import registry
from opcontracts._lang import versions
from opcontracts._lang.dtypes import parse_dtype
from opcontracts._lang.shapes import parse_shape
from opcontracts.probe import _resolve  # the probe's own target lookup
from opcontracts.reference._unmodelled import UNMODELLED
from opcontracts.spec import load_contracts

emulation = pytest.importorskip("opcontracts.emulation")
from opcontracts.emulation import _kernels  # noqa: E402  (reference kernels, no dtype misreading)

SHIPPED = load_contracts(registry.shipped_contracts_dir())
# the contracts whose op has a reference (the others: reference._unmodelled, no case to build)
MODELLED = [c for c in SHIPPED if c.op not in UNMODELLED]
N, K, H, E = 4, 2, 8, 4
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _cid(c: Contract) -> str:
    when = ""
    if c.when is not None:
        when = "[" + ",".join(f"{k}{v}" for k, v in c.when.model_dump().items() if v) + "]"
    return c.op + when


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def emu() -> Iterator[Any]:
    """The emulation with its stand-in modules, for the whole module; removed afterwards.

    ``import opcontracts.patch`` (imported by another test module at collection) guards every
    target process-wide with the contracts resolved for this environment; these tests guard
    targets with one contract at a time, so the patch is lifted meanwhile and re-applied."""
    patch = sys.modules.get("opcontracts.patch")
    patched = patch is not None and patch.is_applied()
    if patched:
        patch.unpatch()
    was = emulation.installed()
    emulation.install("narrow")
    torch_npu = importlib.import_module("torch_npu")
    try:
        yield torch_npu
    finally:
        if not was:
            emulation.uninstall()
        versions.refresh()
        if patched:
            patch.apply()


@pytest.fixture(autouse=True)
def restore_globals() -> Iterator[None]:
    """Registry, version pins and value checks are put back as they were; the shipped packs
    are registered for the test (whatever an earlier test unregistered)."""
    before, loaded = registry.all_contracts(), registry._shipped_loaded
    pins = versions.set_versions()  # no change: just the current pins
    values = opcontracts.set_value_checks(False)
    registry.register(SHIPPED, replace=True)
    try:
        yield
    finally:
        opcontracts.set_value_checks(values)
        versions.set_versions(**pins)
        registry.clear()
        registry.register(before, replace=True)
        registry._shipped_loaded = loaded


def _profile_for(c: Contract) -> str:
    """The kernel profile a contract speaks for: the wide kernels when it needs CANN >= 8.0.0."""
    return "wide" if c.when is not None and c.when.cann and ">=" in c.when.cann else "narrow"


# --------------------------------------------------------------------------- conforming calls
def _pick(c: Contract, arg: str, default: torch.dtype) -> torch.dtype:
    """The dtype a conforming call uses for ``arg``: fp32 where the contract allows it (the
    interesting case of the wide tables), else its first dtype."""
    a = c.args.get(arg)
    if a is None or a.dtype is None:
        return default
    names = list(a.dtype)
    if default.is_floating_point and "float32" in names:
        return FP32
    return parse_dtype(names[0])


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=_g()).to(dtype)


def _experts(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, k) distinct expert ids per row, in [0, E)."""
    return torch.stack([torch.randperm(E, generator=_g())[:k] for _ in range(n)]).to(dtype)


def _routing_map(dtype: torch.dtype) -> torch.Tensor:
    m = torch.zeros(N, E, dtype=torch.bool)
    m.scatter_(1, _experts(N, K, torch.int64), True)
    return m.to(dtype)


Call = tuple[tuple[Any, ...], dict[str, Any]]


def _permute(c: Contract) -> Call:
    return (_randn(N, H, dtype=_pick(c, "tokens", BF16)),
            _experts(N, K, _pick(c, "indices", torch.int64))), {}


def _permute_grad(c: Contract) -> Call:
    ft = _pick(c, "tokens", BF16)
    return (_randn(N, H, dtype=ft), _randn(N * K, H, dtype=ft),
            _experts(N, K, _pick(c, "indices", torch.int64)),
            torch.randperm(N * K, generator=_g()).to(torch.int32)), {}


def _unpermute(c: Contract) -> Call:
    return (_randn(N * K, H, dtype=_pick(c, "permuted_tokens", BF16)),
            torch.randperm(N * K, generator=_g()).to(torch.int32)), \
        {"probs": torch.rand(N, K, generator=_g()).to(_pick(c, "probs", BF16))}


def _unpermute_grad(c: Contract) -> Call:
    ft = _pick(c, "permuted_tokens", BF16)
    return (_randn(N * K, H, dtype=ft), _randn(N, H, dtype=ft),
            torch.randperm(N * K, generator=_g()).to(torch.int32)), \
        {"probs": torch.rand(N, K, generator=_g()).to(_pick(c, "probs", BF16))}


def _permute_routing(c: Contract) -> Call:
    # bf16 tokens with fp32 probs: the one mixed pair the routing-map ops allow
    return (_randn(N, H, dtype=BF16), _routing_map(torch.int8)), \
        {"probs": torch.rand(N, E, generator=_g()), "num_out_tokens": N * K}


def _unpermute_routing(c: Contract) -> Call:
    rmap = _routing_map(torch.int8)
    probs = torch.rand(N, E, generator=_g())
    permuted, _, sorted_indices = _kernels.npu_moe_token_permute_with_routing_map(
        _randn(N, H, dtype=BF16), rmap, probs=probs, num_out_tokens=N * K)
    return (permuted, sorted_indices, [N, H]), {"probs": probs, "routing_map": rmap}


def _init_routing(c: Contract) -> Call:
    row_idx = torch.arange(N * K, dtype=torch.int32).view(K, N).t().contiguous()
    return (_randn(N, H, dtype=_pick(c, "x", BF16)), row_idx, _experts(N, K, torch.int32), N), {}


def _finalize_routing(c: Contract) -> Call:
    ft = _pick(c, "expanded_permuted_rows", BF16)
    return (_randn(N * K, H, dtype=ft), _randn(N, H, dtype=ft), None, _randn(E, H, dtype=ft),
            torch.rand(N, K, generator=_g()).to(ft),
            torch.randperm(N * K, generator=_g()).to(torch.int32),
            _experts(N, K, torch.int32)), {"drop_pad_mode": 0}


def _gating(c: Contract) -> Call:
    return (_randn(N, E, dtype=_pick(c, "x", BF16)),), {"k": K}


def _expert_tokens(c: Contract) -> Call:
    ids = torch.sort(torch.randint(0, E, (N * K,), generator=_g())).values.to(torch.int32)
    return (ids, E), {}


def _grouped_matmul(c: Contract) -> Call:
    ft = _pick(c, "x", BF16)
    return ([_randn(6, H, dtype=ft)], [_randn(3, H, 5, dtype=ft)]), {
        "group_list": torch.tensor([2, 5, 6]), "split_item": 3, "group_type": 0,
        "group_list_type": 0}


def _rms_norm(c: Contract) -> Call:
    ft = _pick(c, "self", BF16)
    return (_randn(N, H, dtype=ft), _randn(H, dtype=ft)), {}


def _swiglu(c: Contract) -> Call:
    return (_randn(N, 2 * H, dtype=_pick(c, "self", BF16)),), {}


def _rotary_mul(c: Contract) -> Call:
    ft = _pick(c, "self", BF16)
    return (_randn(1, 4, 2, H, dtype=ft), _randn(1, 4, 1, H, dtype=ft),
            _randn(1, 4, 1, H, dtype=ft)), {}


def _fusion_attention(c: Contract) -> Call:
    ft = _pick(c, "query", BF16)
    q, k, v = (_randn(1, 4, 16, dtype=ft) for _ in range(3))
    return (q, k, v, 2, "BSH"), {"scale": 0.25}


def _gmm(c: Contract) -> Call:
    ft = _pick(c, "x", BF16)
    return (_randn(6, H, dtype=ft), _randn(3, H, 5, dtype=ft)), {"group_list": [2, 5, 6]}


def _gmm_v2(c: Contract) -> Call:
    ft = _pick(c, "x", BF16)
    return (_randn(6, H, dtype=ft), _randn(3, H, 5, dtype=ft)), \
        {"group_list": torch.tensor([2, 3, 1])}


def _rope(c: Contract) -> Call:
    ft = _pick(c, "x", BF16)
    return (_randn(1, 4, 2, H, dtype=ft), _randn(1, 4, 1, H, dtype=ft),
            _randn(1, 4, 1, H, dtype=ft)), {"mode": 0}


def _ring(c: Contract) -> Call:
    ft = _pick(c, "prev_attn_out", BF16)
    s, b, n = 4, 1, 2
    stats = [torch.rand(b, n, s, 8, generator=_g()) + 0.5 for _ in range(4)]
    return (_randn(s, b, H, dtype=ft), stats[0], stats[1], _randn(s, b, H, dtype=ft),
            stats[2], stats[3]), {}


BUILDERS: dict[str, Callable[[Contract], Call]] = {
    "npu_moe_token_permute": _permute,
    "npu_moe_token_permute_grad": _permute_grad,
    "npu_moe_token_unpermute": _unpermute,
    "npu_moe_token_unpermute_grad": _unpermute_grad,
    "npu_moe_token_permute_with_routing_map": _permute_routing,
    "npu_moe_token_unpermute_with_routing_map": _unpermute_routing,
    "npu_moe_init_routing": _init_routing,
    "npu_moe_finalize_routing": _finalize_routing,
    "npu_moe_gating_top_k_softmax": _gating,
    "npu_moe_compute_expert_tokens": _expert_tokens,
    "npu_grouped_matmul": _grouped_matmul,
    "npu_rms_norm": _rms_norm,
    "npu_swiglu": _swiglu,
    "npu_rotary_mul": _rotary_mul,
    "npu_fusion_attention": _fusion_attention,
    "mindspeed.npu_moe_token_unpermute": _unpermute,
    "mindspeed.npu_moe_token_permute": _permute,
    "mindspeed.npu_gmm": _gmm,
    "mindspeed.npu_gmm_v2": _gmm_v2,
    "mindspeed.npu_rotary_position_embedding": _rope,
    "mindspeed.npu_ring_attention_update": _ring,
}


def _example(op: str) -> Callable[[Contract], Call]:
    """An op of issue 15's families: its reference's example inputs (conforming, and read
    correctly by every emulation profile)."""
    def build(c: Contract) -> Call:
        ref = opcontracts.reference.get(op)
        assert ref is not None and ref.example is not None, op
        return ref.example(_g())
    return build


# Every other shipped op that has a reference with example inputs gets them as its case; an op
# without one has no case (the first test below fails on it).
for _c in SHIPPED:
    _ref = opcontracts.reference.get(_c.op)
    if _c.op not in BUILDERS and _ref is not None and _ref.example is not None:
        BUILDERS[_c.op] = _example(_c.op)

def _narrowed(base: Callable[[Contract], Call]) -> Callable[[Contract], Call]:
    """The example, narrowed to what a chip's or a CANN range's own table wants (issue 23):
    CANN < 8.3.RC1's router takes exactly 256 experts, the 310P's init routing fp16 x."""
    def build(c: Contract) -> Call:
        args, kwargs = base(c)
        x = c.args.get("x")
        if x is not None and x.dims and "E" in x.dims and x.dims["E"].ge is not None:
            e, g = x.dims["E"].ge, _g()
            logits = torch.randn(args[0].size(0), e, generator=g).to(args[0].dtype)
            args = (logits, *args[1:])
            kwargs = {**kwargs, "bias": (torch.randn(e, generator=g) / 8).to(logits.dtype),
                      "group_count": 8, "k_group": 4}
        if x is not None and x.dtype is not None and "bfloat16" not in x.dtype \
                and args[0].dtype == torch.bfloat16:
            args = (args[0].to(torch.float16), *args[1:])
        return args, kwargs
    return build


for _op in ("npu_moe_gating_top_k", "npu_moe_init_routing_v2"):
    BUILDERS[_op] = _narrowed(BUILDERS[_op])


def _reference(op: str) -> Callable[..., Any]:
    """The op's one reference (``opcontracts.reference``: the emulation's kernels are the same)."""
    ref = opcontracts.reference.get(op)
    assert ref is not None, f"{op} has no reference"
    return ref.forward


# Each pack (the folder under contracts/, the op-name prefix) says where its sources come from
# and where its ops live: (source pattern, the targets of an op).  torch_npu's ops are
# torch_npu.<op> and torch.ops.npu.<op>, from the wheels, CANN's docs or MindSpeed's (which
# documents the torch_npu ops it calls); MindSpeed's wrappers live in mindspeed.ops / .core;
# fla_npu's kernels register themselves in torch.ops.npu (no torch_npu module has them) and
# are documented by their READMEs at a commit of its public mirror.
_TORCH_NPU_SOURCE = r"(torch_npu \d+\.\d+\.\d+|CANN \d+\.\d+\.\w+|MindSpeed master)"
PACKS: dict[str, tuple[str, Callable[[Contract], bool]]] = {
    "torch_npu/": (_TORCH_NPU_SOURCE, lambda c: set(c.targets) == {
        f"torch_npu.{c.op}", f"torch.ops.npu.{c.op}"}),
    "mindspeed/": (_TORCH_NPU_SOURCE, lambda c: all(
        t.startswith(("mindspeed.ops.", "mindspeed.core.")) for t in c.targets)),
    # ATB's plugin ops: op-plugin's glue (the schema) at a commit, then the ATB operator doc
    "atb/": (r"Ascend/op-plugin@[0-9a-f]{12}, op_plugin/ops/atb/.*CANN \d+\.\d+\.\w+ "
             r"Ascend Transformer Boost API", lambda c: c.op.startswith("atb.") and set(
                 c.targets) == {f"torch.ops.atb.{c.op.removeprefix('atb.')}"}),
    "fla_npu/": (r"flashserve/flash-linear-attention-npu@[0-9a-f]{12}, fla/ops/",
                 lambda c: c.op.startswith("fla_npu.") and set(c.targets) == {
                     f"torch.ops.npu.{c.op.removeprefix('fla_npu.')}"}),
}


def _pack_of(c: Contract) -> str:
    if c.op.startswith("mindspeed."):
        return "mindspeed/"
    if c.op.startswith("fla_npu."):
        return "fla_npu/"
    if c.op.startswith("atb."):
        return "atb/"
    return "torch_npu/"


def test_every_shipped_file_loads_and_every_op_has_a_case() -> None:
    folder = registry.shipped_contracts_dir()
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.toml"))
    assert {f.split("/", 1)[0] + "/" for f in files} == set(PACKS)
    for f in files:
        contracts = load_contracts(folder / f)
        assert contracts, f
        assert all(_pack_of(c) == f.split("/", 1)[0] + "/" for c in contracts), f
    # every op has a case, or is one of the documented ops without a reference, never both
    assert {c.op for c in SHIPPED} == set(BUILDERS) | set(UNMODELLED)
    assert not set(BUILDERS) & set(UNMODELLED)
    for c in SHIPPED:
        source_pattern, targets_ok = PACKS[_pack_of(c)]
        # package and version (or repository and commit), then the file or doc
        assert re.match(source_pattern, c.source or ""), c.source
        assert "/" in (c.source or ""), c.source
        assert c.targets, c.op
        assert c.signature is not None and c.doc, c.op
        assert targets_ok(c), (c.op, c.targets)


def test_an_op_without_a_reference_says_why() -> None:
    """The exemptions are shipped ops, each with its reason, and the probe gives the reason."""
    from opcontracts import probe

    assert set(UNMODELLED) <= {c.op for c in SHIPPED}
    for op, why in UNMODELLED.items():
        assert opcontracts.reference.get(op) is None, op
        assert opcontracts.reference.unmodelled(op) == why and len(why) > 40, op
    with pytest.raises(LookupError, match="random: the kernel's own draws"):
        probe.probe("torch_npu._npu_dropout")


def test_versioned_ops_have_their_variants() -> None:
    whens: dict[str, list[Any]] = {}
    for c in SHIPPED:
        whens.setdefault(c.op, []).append(c.when)
    for op in ("npu_moe_token_permute", "npu_moe_token_unpermute",
               "npu_moe_token_permute_grad", "npu_moe_token_unpermute_grad"):
        cann = {w.cann for w in whens[op] if w is not None}
        assert {">=8.0.0", "<8.0.0"} <= cann, op


@pytest.mark.parametrize("contract", MODELLED, ids=_cid)
def test_conforming_call_passes_strict_and_matches_reference(emu: Any, contract: Contract) -> None:
    emulation.install(_profile_for(contract))
    args, kwargs = BUILDERS[contract.op](contract)
    opcontracts.check(contract, *args, **kwargs)
    expected = _reference(contract.op)(*args, **kwargs)
    with opcontracts.mode("strict"):
        for target in contract.targets:
            guarded = opcontracts.enforce(contract)(_resolve(target))
            # fresh arguments per target: an in-place op (npu_silu_) writes into them
            a, k = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
            torch.testing.assert_close(guarded(*a, **k), expected, msg=target)


def test_resolved_contracts_accept_conforming_calls_by_op_name(emu: Any) -> None:
    """Through the registry (``enforce(op_name)``), with versions pinned to the wide tables."""
    emulation.install("wide")
    opcontracts.set_versions(torch_npu="2.13.0", cann="8.0.0", soc="Ascend910B3")
    with opcontracts.mode("strict"):
        for op, build in BUILDERS.items():
            resolved = registry.resolve(op)
            if resolved is None:  # its tables are for other chips (npu_dynamic_mx_quant: 950)
                assert all(c.when is not None and c.when.soc for c in registry.candidates(op))
                continue
            args, kwargs = build(resolved)
            target = _resolve(resolved.targets[0])
            opcontracts.enforce(op)(target)(*args, **kwargs)


# --------------------------------------------------------------------------- generic violations
def _wrong_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.is_floating_point() else torch.int16


# Conforming values for optional arguments the builders leave out (the emulated kernels do
# not need them), so the generic violation tests reach every argument.
EXTRAS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "mindspeed.npu_gmm": lambda b: {"bias": torch.zeros(3, 5, dtype=FP32)},
    "mindspeed.npu_gmm_v2": lambda b: {"bias": torch.zeros(3, 5, dtype=FP32)},
    "mindspeed.npu_ring_attention_update": lambda b: {
        "actual_seq_qlen": torch.tensor([1, 3, 4])},
    "npu_ring_attention_update": lambda b: {"actual_seq_qlen": torch.tensor([1, 3, 4])},
    "npu_trans_quant_param": lambda b: {"offset": torch.zeros_like(b["scale"])},
    "npu_fusion_attention": lambda b: {
        "pse": torch.zeros(1, 2, 4, 4, dtype=b["query"].dtype),
        "atten_mask": torch.zeros(4, 4, dtype=torch.bool),
        "prefix": [0], "actual_seq_qlen": [4], "actual_seq_kvlen": [4], "sink": torch.zeros(2)},
    # attention: the arguments the examples (varlen, TND) leave out
    "npu_fusion_attention_grad": lambda b: {"prefix": [0, 0]},
    "npu_fusion_attention_v2": lambda b: {
        "pse": torch.zeros(1, 2, 4, 4, dtype=b["query"].dtype), "prefix": [0, 0],
        "q_start_idx": [0], "kv_start_idx": [0]},
    "npu_fusion_attention_grad_v2": lambda b: {
        "pse": torch.zeros(1, 2, 4, 4, dtype=b["query"].dtype)},
    "mindspeed.npu_fusion_attention": lambda b: {
        "prefix": [0, 0], "q_start_idx": [0], "kv_start_idx": [0]},
    # serving attention: the quantization arguments, in their documented dtypes
    "npu_prompt_flash_attention": lambda b: {
        "deq_scale1": torch.ones(1), "quant_scale1": torch.ones(1), "deq_scale2": torch.ones(1),
        "quant_scale2": torch.ones(1), "quant_offset2": torch.zeros(1)},
    "npu_incre_flash_attention": lambda b: {
        "antiquant_scale": torch.ones(2, 16, dtype=BF16),
        "antiquant_offset": torch.zeros(2, 16, dtype=BF16), "dequant_scale1": torch.ones(1),
        "quant_scale1": torch.ones(1), "dequant_scale2": torch.ones(1),
        "quant_scale2": torch.ones(1), "quant_offset2": torch.zeros(1),
        "kv_padding_size": torch.zeros(1, dtype=torch.int64)},
    "npu_fused_infer_attention_score": lambda b: {
        "dequant_scale1": torch.ones(1), "quant_scale1": torch.ones(1),
        "dequant_scale2": torch.ones(1), "quant_scale2": torch.ones(1),
        "quant_offset2": torch.zeros(1), "antiquant_scale": torch.ones(2, 16, dtype=BF16),
        "antiquant_offset": torch.zeros(2, 16, dtype=BF16),
        **{f"{kv}_antiquant_{p}": torch.ones(2, 8) for kv in ("key", "value")
           for p in ("scale", "offset")},
        "query_padding_size": torch.zeros(1, dtype=torch.int64),
        "kv_padding_size": torch.zeros(1, dtype=torch.int64),
        "key_shared_prefix": torch.zeros(1, 4, 16, dtype=BF16),
        "value_shared_prefix": torch.zeros(1, 4, 16, dtype=BF16),
        "query_rope": torch.zeros(2, 2, 1, 4, dtype=BF16),
        "key_rope": torch.zeros(6, 4, 8, dtype=BF16),
        "key_rope_antiquant_scale": torch.ones(4, dtype=BF16)},
    "npu_moe_gating_top_k_softmax": lambda b: {"finished": torch.zeros(N, dtype=torch.bool)},
    "npu_moe_finalize_routing": lambda b: {"skip2": torch.zeros_like(b["skip1"])},
    # moe serving: the arguments their examples leave out (offset: unused in the supported
    # modes; the hash-mode tables of gating top-k)
    "npu_moe_init_routing_v2": lambda b: {"offset": torch.zeros(1)},
    "npu_moe_gating_top_k": lambda b: {
        "input_ids": torch.zeros(b["x"].size(0), dtype=torch.int32),
        "tid2eid": torch.zeros(3, b["k"], dtype=torch.int32)},
    # norm / quant family: the arguments their examples leave out (pertoken_scale: the bf16-
    # output mode; bias / quant_offset: the static mode without group_index)
    "npu_quant_matmul": lambda b: {"pertoken_scale": torch.ones(b["x1"].size(0))},
    "npu_dequant_swiglu_quant": lambda b: {
        "bias": torch.zeros(b["x"].size(-1), dtype=torch.int32),
        "quant_offset": torch.zeros(2, b["x"].size(-1) // 2)},
    # the quantized-mode arguments, in their documented dtypes (int8 x / weight are not needed
    # for the contract to accept them)
    "npu_grouped_matmul": lambda b: {
        "bias": [torch.zeros(5, dtype=FP32) for _ in range(3)],
        "scale": [torch.ones(5) for _ in range(3)],
        "antiquant_scale": [torch.ones(5, dtype=BF16) for _ in range(3)],
        "antiquant_offset": [torch.zeros(5, dtype=BF16) for _ in range(3)],
        "per_token_scale": [torch.ones(6)]},
    # grouped GEMM family: the a8w4-only bias / offset of finalize routing, the quantized
    # scales and the bias of all_gather_base_mm
    "npu_grouped_matmul_finalize_routing": lambda b: {
        "bias": torch.zeros(2, 256), "offset": torch.zeros(2, 256)},
    "npu_all_gather_base_mm": lambda b: {
        "bias": torch.zeros(4, dtype=b["self"].dtype), "x1_scale": torch.ones(2, 1),
        "x2_scale": torch.ones(1, 4)},
    # the weight-only quantised matmul: the int8-output quantisation and the bias
    "npu_weight_quant_batchmatmul": lambda b: {
        "quant_scale": torch.ones(b["weight"].size(1)),
        "quant_offset": torch.zeros(b["weight"].size(1)),
        "bias": torch.zeros(b["weight"].size(1), dtype=b["x"].dtype)},
    # MindSpeed's MC2 wrappers: the shared expert's pair their examples leave out
    **{op: lambda b: {"shared_inputs": torch.zeros(3, 8, dtype=BF16),
                      "shared_weight": torch.zeros(8, 4, dtype=BF16)}
       for op in ("mindspeed.all2all_grouped_matmul", "mindspeed.grouped_matmul_all2all")},
}


def _bind(contract: Contract, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The builder's call as {name: value}, with every optional argument filled in."""
    names = contract.signature or tuple(contract.args)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    extra = EXTRAS.get(contract.op)
    if extra is not None:
        for k, v in extra(bound).items():
            if k in contract.args and bound.get(k) is None:
                bound[k] = v
    opcontracts.check(contract, **bound)  # still a conforming call
    return bound


def _split(contract: Contract, bound: dict[str, Any]) -> Call:
    names = contract.signature or tuple(contract.args)
    return (), {n: bound[n] for n in names if n in bound}


def _tensor_cases(kind: str) -> list[Any]:
    out = []
    for c in MODELLED:
        for name, a in c.args.items():
            if not a.is_tensor:
                continue
            if kind == "dtype" and a.dtype is None:
                continue
            if kind == "rank" and not (a.rank or (a.shape and not any(
                    parse_shape(s).has_ellipsis for s in a.shape))):
                continue
            out.append(pytest.param(c, name, id=f"{_cid(c)}:{name}"))
    return out


def _partners(contract: Contract, name: str) -> set[str]:
    """Arguments whose rules mention ``name`` (they may report the mismatch first)."""
    return {name} | {n for n, a in contract.args.items()
                     if name in (a.same_dtype_as, a.same_shape_as)}


@pytest.mark.parametrize(("contract", "name"), _tensor_cases("dtype"))
def test_wrong_dtype_is_reported_naming_the_argument(contract: Contract, name: str) -> None:
    args, kwargs = BUILDERS[contract.op](contract)
    bound = _bind(contract, args, kwargs)
    value = bound[name]
    if contract.args[name].tensor_list:
        bound[name] = [value[0].to(_wrong_dtype(value[0])), *value[1:]]
        expected_arg = f"{name}[0]"
    else:
        if not isinstance(value, torch.Tensor):  # an int list accepted in place of a tensor
            value = torch.tensor(value)
        bound[name] = value.to(_wrong_dtype(value))
        expected_arg = name
    a, kw = _split(contract, bound)
    with pytest.raises(ContractViolation) as info:
        opcontracts.check(contract, *a, **kw)
    assert info.value.arg == expected_arg
    assert info.value.rule in ("dtype", "same_dtype")
    assert f"argument '{expected_arg}'" in str(info.value)


@pytest.mark.parametrize(("contract", "name"), _tensor_cases("rank"))
def test_wrong_rank_is_reported_naming_the_argument(contract: Contract, name: str) -> None:
    args, kwargs = BUILDERS[contract.op](contract)
    bound = _bind(contract, args, kwargs)
    value = bound[name]
    a = contract.args[name]
    allowed = set(a.rank or ()) | {parse_shape(s).fixed_rank for s in a.shape or ()}
    partners = _partners(contract, name)
    if a.tensor_list:  # a list of tensors: its first element gets the wrong rank
        value, partners = value[0], {f"{p}[0]" for p in partners}
    elif not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    bad = value
    while bad.dim() in allowed:
        bad = bad.unsqueeze(0)
    bound[name] = [bad, *bound[name][1:]] if a.tensor_list else bad
    args2, kw = _split(contract, bound)
    with pytest.raises(ContractViolation) as info:
        opcontracts.check(contract, *args2, **kw)
    assert info.value.arg in partners
    assert info.value.rule in ("rank", "shape", "same_shape")
    assert f"argument '{info.value.arg}'" in str(info.value)


# --------------------------------------------------------------------------- documented violations
def _only(op: str, **when: str) -> Contract:
    """The one shipped contract for ``op`` whose ``when`` has these conditions (and maybe
    others: the torch_npu ranges follow the wheels and are long lists)."""
    found = [c for c in SHIPPED if c.op == op and all(
        (c.when.model_dump(exclude_none=True) if c.when else {}).get(k) == v
        for k, v in when.items())]
    assert len(found) == 1, (op, when)
    return found[0]


UNPERMUTE_WIDE = _only("npu_moe_token_unpermute", cann=">=8.0.0")
UNPERMUTE_OLD = _only("npu_moe_token_unpermute", cann="<8.0.0")


def _violation(contract: Contract | str, *args: Any, **kwargs: Any) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        opcontracts.check(contract, *args, **kwargs)
    return info.value


def test_fp32_probs_allowed_by_new_docs_rejected_by_old() -> None:
    pt = _randn(N * K, H, dtype=BF16)
    si = torch.randperm(N * K).to(torch.int32)
    probs = torch.rand(N, K)  # fp32, what Megatron's fp32 router hands over
    opcontracts.check(UNPERMUTE_WIDE, pt, si, probs)
    exc = _violation(UNPERMUTE_OLD, pt, si, probs)
    assert (exc.arg, exc.rule) == ("probs", "dtype")
    assert "bfloat16" in exc.expected and "float32" in exc.actual
    assert "CANN 8.0.RC3" in (exc.source or "")


def test_broken_n_times_k_relation() -> None:
    pt = _randn(N * K + 1, H, dtype=BF16)
    si = torch.randperm(N * K + 1).to(torch.int32)
    # permute's two outputs agree: the caller's probs is the one that breaks N*K
    exc = _violation(UNPERMUTE_OLD, pt, si, torch.rand(N, K).to(BF16))
    assert exc.arg == "probs" and exc.bindings == {"H": H}
    assert f"N*K = {N * K + 1}" in exc.expected and "permuted_tokens" in exc.expected
    # permute's outputs disagree with each other: both are named, neither is to change alone
    exc = _violation(UNPERMUTE_OLD, _randn(N * K, H, dtype=BF16),
                     torch.randperm(N * K - 1).to(torch.int32))
    assert exc.arg == "sorted_indices" and exc.rule == "shape"
    assert exc.fix is not None and "permuted_tokens" in exc.fix and "one call" in exc.fix


def test_index_widths() -> None:
    pt, probs = _randn(N * K, H, dtype=BF16), torch.rand(N, K).to(BF16)
    exc = _violation(UNPERMUTE_WIDE, pt, torch.randperm(N * K), probs)  # int64
    assert (exc.arg, exc.rule) == ("sorted_indices", "dtype") and "int32" in exc.expected
    old_permute = _only("npu_moe_token_permute", cann="<8.0.0")
    exc = _violation(old_permute, _randn(N, H, dtype=BF16), _experts(N, K, torch.int32))
    assert (exc.arg, exc.rule) == ("indices", "dtype") and "int64" in exc.expected
    wide_permute = _only("npu_moe_token_permute", cann=">=8.0.0")
    opcontracts.check(wide_permute, _randn(N, H, dtype=BF16), _experts(N, K, torch.int32))


def test_duplicate_sorted_indices_caught_only_with_value_checks() -> None:
    pt, probs = _randn(N * K, H, dtype=BF16), torch.rand(N, K).to(BF16)
    dup = torch.arange(N * K, dtype=torch.int32)
    dup[1] = 0
    opcontracts.check(UNPERMUTE_OLD, pt, dup, probs)  # values are not read by default
    opcontracts.set_value_checks(True)
    exc = _violation(UNPERMUTE_OLD, pt, dup, probs)
    assert (exc.arg, exc.rule) == ("sorted_indices", "value")
    assert "occurs more than once" in str(exc)


def test_value_checks_from_environment_variable() -> None:
    """OPCONTRACTS_VALUES=1 turns the value checks on for a process (read at import)."""
    code = (
        "import torch, opcontracts\n"
        "from opcontracts._engine import registry\n"
        "registry.load_shipped()\n"
        "opcontracts.set_versions(cann='8.0.RC3', torch_npu='2.13.0', soc='Ascend950')\n"
        "si = torch.zeros(8, dtype=torch.int32)\n"
        "pt = torch.zeros(8, 4, dtype=torch.bfloat16)\n"
        "try:\n"
        "    opcontracts.check('npu_moe_token_unpermute', pt, si)\n"
        "except opcontracts.ContractViolation as e:\n"
        "    print(e.arg, e.rule)\n"
    )
    env = {**os.environ, "OPCONTRACTS_VALUES": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["sorted_indices", "value"]


def test_padded_mode_and_k_bound_on_a2() -> None:
    pt, si = _randn(N * K, H, dtype=BF16), torch.randperm(N * K).to(torch.int32)
    exc = _violation(UNPERMUTE_WIDE, pt, si, None, True)
    assert (exc.arg, exc.rule) == ("padded_mode", "allowed")
    opcontracts.set_versions(torch_npu="2.13.0", cann="8.0.0", soc="Ascend910B2")
    big_k = 513
    exc = _violation("npu_moe_token_unpermute", _randn(big_k, H, dtype=BF16),
                     torch.randperm(big_k).to(torch.int32), torch.rand(1, big_k))
    assert exc.arg == "probs" and "K <= 512" in exc.expected
    opcontracts.set_versions(soc="Ascend950")
    opcontracts.check("npu_moe_token_unpermute", _randn(big_k, H, dtype=BF16),
                      torch.randperm(big_k).to(torch.int32), torch.rand(1, big_k))


@pytest.mark.parametrize(
    ("tokens", "probs", "ok"),
    [(BF16, FP32, True), (BF16, BF16, True), (FP16, FP16, True), (FP32, FP32, True),
     (BF16, FP16, False), (FP16, FP32, False), (FP32, BF16, False)],
)
def test_routing_map_couples_probs_to_tokens(tokens: torch.dtype, probs: torch.dtype,
                                             ok: bool) -> None:
    args = (_randn(N, H, dtype=tokens), _routing_map(torch.bool))
    p = torch.rand(N, E).to(probs)
    if ok:
        opcontracts.check("npu_moe_token_permute_with_routing_map", *args, probs=p)
    else:
        exc = _violation("npu_moe_token_permute_with_routing_map", *args, probs=p)
        assert (exc.arg, exc.rule) == ("probs", "same_dtype")
        assert "float32 when tokens is bfloat16" in exc.expected


def test_gmm_group_list_values() -> None:
    x, w = _randn(6, H, dtype=BF16), _randn(3, H, 5, dtype=BF16)
    opcontracts.set_value_checks(True)
    opcontracts.check("mindspeed.npu_gmm", x, w, group_list=[2, 5, 6])
    opcontracts.check("mindspeed.npu_gmm", x, w, group_list=torch.tensor([2, 5, 6]))
    exc = _violation("mindspeed.npu_gmm", x, w, group_list=[2, 5, 5])
    assert (exc.arg, exc.rule) == ("group_list", "value") and "last value == M" in exc.expected
    exc = _violation("mindspeed.npu_gmm", x, w, group_list=[2, 1, 6])
    assert "decreases" in str(exc)
    exc = _violation("mindspeed.npu_gmm", x, w, group_list=torch.tensor([2, 5, 6], dtype=torch.int32))
    assert (exc.arg, exc.rule) == ("group_list", "dtype")
    opcontracts.check("mindspeed.npu_gmm_v2", x, w, group_list=torch.tensor([2, 3, 1]))
    exc = _violation("mindspeed.npu_gmm_v2", x, w, group_list=torch.tensor([2, 3, 2]))
    assert exc.arg == "group_list" and "sums to 7" in str(exc)
    exc = _violation("mindspeed.npu_gmm", x, w, group_list=[2, 5, 6], group_type=1)
    assert exc.arg == "group_type"
    exc = _violation("mindspeed.npu_gmm", _randn(6, 70000, dtype=BF16)[:, :65536], w,
                     group_list=[2, 5, 6])
    assert exc.arg == "x" and "Kx < 65536" in exc.expected


def test_expert_bounds_and_counts() -> None:
    c = _only("npu_moe_finalize_routing")
    args, kwargs = _finalize_routing(c)
    opcontracts.set_value_checks(True)
    opcontracts.check(c, *args, **kwargs)
    bad = list(args)
    bad[6] = torch.full((N, K), E, dtype=torch.int32)  # expert id == E: out of range
    exc = _violation(c, *bad, **kwargs)
    assert exc.arg == "export_for_source_row" and "< E" in exc.expected
    bad = list(args)
    bad[1] = _randn(N, H, dtype=FP16)  # skip1 in another dtype than the rows
    exc = _violation(c, *bad, **kwargs)
    assert (exc.arg, exc.rule) == ("skip1", "same_dtype")
    exc = _violation("npu_moe_compute_expert_tokens", torch.tensor([0, 2, 1], dtype=torch.int32), E)
    assert exc.arg == "sorted_expert_for_source_row" and "decreases" in str(exc)
    exc = _violation("npu_moe_compute_expert_tokens", torch.tensor([0], dtype=torch.int32), 2049)
    assert (exc.arg, exc.rule) == ("num_expert", "bound")
    exc = _violation("npu_moe_gating_top_k_softmax", _randn(N, E, dtype=BF16), None, E + 1)
    assert (exc.arg, exc.rule) == ("k", "bound") and "E" in exc.expected


def test_shape_bounds_and_evenness() -> None:
    exc = _violation("npu_swiglu", _randn(N, 7, dtype=BF16))
    assert exc.arg == "self" and "2*D" in exc.expected
    exc = _violation("npu_rotary_mul", *(_randn(1, 2, 1, 896, dtype=BF16) for _ in range(3)))
    assert exc.arg == "self" and "D < 896" in exc.expected
    exc = _violation("mindspeed.npu_rotary_position_embedding",
                     *(_randn(1, 2, 1, 9, dtype=BF16) for _ in range(3)))
    assert exc.arg == "x" and exc.rule == "shape"
    big = torch.zeros(1, dtype=BF16).expand(4096, 4096)  # 2**24 elements, no memory
    exc = _violation("npu_moe_init_routing", big, torch.zeros(4096, 1, dtype=torch.int32),
                     torch.zeros(4096, 1, dtype=torch.int32), 4096)
    assert exc.arg == "x" and "fewer than 16777216" in exc.expected
    exc = _violation("npu_grouped_matmul", [_randn(2, 2, dtype=BF16)] * 129,
                     [_randn(2, 2, dtype=BF16)])
    assert (exc.arg, exc.rule) == ("x", "list_len")
    exc = _violation("npu_rms_norm", _randn(N, H, dtype=BF16), _randn(H, dtype=FP32))
    assert (exc.arg, exc.rule) == ("gamma", "same_dtype")
    q = _randn(1, 4, 16, dtype=BF16)
    exc = _violation("npu_fusion_attention", q, q.to(FP16), q, 2, "BSH")
    assert (exc.arg, exc.rule) == ("key", "same_dtype")
    exc = _violation("npu_fusion_attention", q, q, q, 2, "BSH", atten_mask=torch.zeros(4, 4))
    assert exc.arg == "atten_mask"
    args, _ = _ring(_only("mindspeed.npu_ring_attention_update"))
    bad = list(args)
    bad[1] = bad[1].half()
    exc = _violation("mindspeed.npu_ring_attention_update", *bad)
    assert (exc.arg, exc.rule) == ("prev_softmax_max", "dtype")


# --------------------------------------------------------------------------- why: unchecked calls
def _unpermute_call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (_randn(N * K, H, dtype=BF16), torch.randperm(N * K, generator=_g()).to(torch.int32),
            torch.rand(N, K, generator=_g()) + 0.1)


def test_unchecked_fp32_probs_give_wrong_results_on_the_default_profile(emu: Any) -> None:
    """The incident: the bf16-only kernel reads fp32 probs' bytes as bf16.  Nothing raises;
    the result is wrong.  The contract stops the call in strict mode and repairs it in fix."""
    emulation.install()  # the default profile: bf16-only unpermute
    pt, si, probs = _unpermute_call()
    reference = _kernels.npu_moe_token_unpermute(pt, si, probs)
    unchecked = emu.npu_moe_token_unpermute(pt, si, probs)
    assert unchecked.dtype == reference.dtype and unchecked.shape == reference.shape
    assert not torch.allclose(unchecked.float(), reference.float(), rtol=0.05, atol=0.05)
    # what a bf16 caller gets is right: the kernel itself works
    torch.testing.assert_close(emu.npu_moe_token_unpermute(pt, si, probs.to(BF16)),
                               _kernels.npu_moe_token_unpermute(pt, si, probs.to(BF16)))
    guarded = opcontracts.enforce(UNPERMUTE_OLD)(emu.npu_moe_token_unpermute)
    with opcontracts.mode("strict"), pytest.raises(ContractViolation, match="'probs'"):
        guarded(pt, si, probs)
    with opcontracts.mode("fix"), pytest.warns(opcontracts.ContractFixWarning, match="probs"):
        fixed = guarded(pt, si, probs)
    torch.testing.assert_close(fixed, _kernels.npu_moe_token_unpermute(pt, si, probs.to(BF16)))


def test_emulation_stand_in_is_detected_as_such(emu: Any) -> None:
    env = versions.current()
    assert env.torch_npu == emu.__version__ == "2.13.0"
    assert "torch_npu" in env.emulated and "emulation" in env.origin("torch_npu")


# --------------------------------------------------------------------------- the CLI
def _cli(*argv: str) -> str:
    from opcontracts.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(list(argv)) == 0
    return buf.getvalue()


def test_cli_list_shows_what_applies() -> None:
    opcontracts.set_versions(torch_npu="2.13.0", cann="8.0.0", soc="Ascend950")
    out = _cli("list", "--verbose")
    assert out.startswith("environment: torch_npu 2.13.0")
    assert "npu_moe_token_unpermute\n" in out and "mindspeed.npu_gmm\n" in out
    assert "targets: torch_npu.npu_moe_token_unpermute" in out
    assert "probs            bf16/fp16/fp32, (N K), optional" in out
    # the pass-through ops are keyed on CANN (issue 23): torch_npu only says the op exists
    assert "[applies: torch_npu 2.13.0 meets >=2.5.1.post1; cann 8.0.0 meets >=8.0.0]" in out
    assert ("Ascend/op-plugin op_plugin/config/op_plugin_functions.yaml (7.1.0 .. master: exec: "
            "aclnnMoeTokenUnpermute, a bare aclnn call)") in out
    assert "does not apply" not in out
    assert "(--all shows them and why)" in out


def test_cli_list_all_explains_what_does_not_apply() -> None:
    opcontracts.set_versions(torch_npu="2.13.0", cann="8.0.RC3", soc="Ascend950")
    out = _cli("list", "--all")
    assert "[does not apply: needs cann >=8.0.0, found 8.0.RC3 (= 8.0rc3)]" in out
    # the chip tables of issue 23 say which chip they speak for
    assert "[does not apply: needs soc Ascend310P, found Ascend950]" in out
    assert "[does not apply: needs soc Ascend910B or Ascend910_93, found Ascend950]" in out
    assert "[applies: torch_npu 2.13.0 meets >=2.5.1.post1; cann 8.0.RC3 (= 8.0rc3) meets <8.0.0]" in out
    shown = out.count("\n  [")
    assert f"{shown} contract(s) shown" in out and shown == len(SHIPPED)


def test_cli_list_shows_the_strictest_merge_when_versions_are_unknown() -> None:
    opcontracts.set_versions(torch_npu="unknown", cann="unknown", soc="unknown")
    out = _cli("list", "--verbose")
    assert ("[may apply: torch_npu unknown (needed for torch_npu >=2.5.1.post1; set "
            "OPCONTRACTS_TORCH_NPU_VERSION); cann unknown (needed for cann <8.0.0; set "
            "OPCONTRACTS_CANN_VERSION)]") in out
    block = out.split("\nnpu_moe_token_unpermute\n")[1].split("\n\n")[0]
    assert "=> enforced: the strictest merge of these 4 contracts" in block
    merged = block.split("=> enforced")[1]
    assert "probs            bf16, (N K), K <= 512, optional" in merged


def test_cli_env_says_where_each_version_came_from() -> None:
    opcontracts.set_versions(cann="8.0.RC3", soc="unknown")
    out = _cli("env")
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "8.0.RC3 (= 8.0rc3)" in lines["cann"] and "set_versions()" in lines["cann"]
    assert "unknown" in lines["soc"]
    assert "torch.__version__" in lines["torch"] or "metadata" in lines["torch"]
    assert "OPCONTRACTS_CANN_VERSION" in out


def test_cli_env_marks_the_emulation(emu: Any) -> None:
    opcontracts.set_versions(torch_npu=None)
    out = _cli("env")
    line = next(ln for ln in out.splitlines() if ln.startswith("torch_npu"))
    assert "2.13.0" in line and "emulation" in line


def test_cli_list_marks_targets_that_cannot_be_reached_here(emu: Any) -> None:
    out = _cli("list", "--verbose")
    assert ("targets: torch_npu.npu_moe_token_unpermute, torch.ops.npu.npu_moe_token_unpermute\n"
            in out)  # the emulation provides both
    from opcontracts import emulation

    emulation.uninstall()
    try:
        out = _cli("list", "--verbose")
    finally:
        emulation.install()
    assert ("targets: torch_npu.npu_moe_token_unpermute (not installed here), "
            "torch.ops.npu.npu_moe_token_unpermute (not registered here)") in out
