"""The emulation per torch_npu release, and the guards on that structure (issue 22).

Facts (``docs/real-stack.md``): from 2.7.1.post11 / 2.9.0.post9 / 2.12.0.post3 / 2.13 / 2.14 the
public ``npu_moe_token_unpermute`` is an ``AutogradPrivateUse1``-only kernel calling
``_npu_moe_token_unpermute``, whose backward node calls ``npu_moe_token_unpermute_grad_v2``;
2.12.0 calls ``npu_moe_token_permute_grad_v2`` and the old unpermute grad; 2.7.1 the old grads.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.utils._python_dispatch import TorchDispatchMode

import opcontracts
from opcontracts import ContractViolation, emulation, patch
from opcontracts._engine import registry as _registry
from opcontracts.dispatch import ContractDispatchMode
from opcontracts.wheel import digest

BF16, F32 = torch.bfloat16, torch.float32


class _Log(TorchDispatchMode):
    """What a dispatch mode below autograd sees of the npu namespace (as msprobe's dump does)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "npu":
            self.ops.append(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


@pytest.fixture
def release(request: pytest.FixtureRequest) -> Iterator[str]:
    version = request.param
    was = patch.is_applied()
    emulation.install("wide", version=version)
    try:
        yield version
    finally:
        emulation.uninstall()
        if not was:
            patch.unpatch()


def _inputs(probs_dtype: torch.dtype = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = (torch.randint(-8, 9, (4, 8), generator=gen) / 8).to(BF16).requires_grad_()
    indices = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    probs = (torch.randint(1, 9, (4, 2), generator=gen) / 8).to(probs_dtype).requires_grad_()
    return tokens, indices, probs


def _train_step() -> tuple[list[str], torch.Tensor, torch.Tensor]:
    import torch_npu  # type: ignore[import-not-found]  # the emulation's stand-in

    tokens, indices, probs = _inputs()
    with _Log() as log:
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
        out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
        out.float().sum().backward()
    assert tokens.grad is not None and probs.grad is not None
    return log.ops, tokens.grad, probs.grad


# --------------------------------------------------------------------------- the structure
EXPECTED = {  # release: (unpermute's internal op, unpermute backward, permute backward)
    "2.7.1": (None, "npu_moe_token_unpermute_grad", "npu_moe_token_permute_grad"),
    "2.7.1.post11": ("_npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2",
                     "npu_moe_token_permute_grad_v2"),
    "2.9.0.post9": ("_npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2",
                    "npu_moe_token_permute_grad_v2"),
    "2.12.0": (None, "npu_moe_token_unpermute_grad", "npu_moe_token_permute_grad_v2"),
    "2.12.0.post3": ("_npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2",
                     "npu_moe_token_permute_grad_v2"),
    "2.13.0": ("_npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2",
               "npu_moe_token_permute_grad_v2"),
    "2.14.0": ("_npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2",
               "npu_moe_token_permute_grad_v2"),
}


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_structure_from_the_digest_is_the_wheels(version: str) -> None:
    """The table of real-stack.md (read from the 2.7.1 / 2.12.0 / 2.13.0 wheels' yaml,
    Functions.h and libtorch_npu.so), derived from the digest's schemas alone."""
    s = emulation.structure(version)
    assert (s.unpermute_internal, s.unpermute_backward, s.permute_backward) == EXPECTED[version]
    assert s.routing_map_internal == "_npu_moe_token_unpermute_with_routing_map"


@pytest.mark.parametrize("release", ["2.13.0"], indirect=True)
def test_2_13_dispatches_the_internal_op_and_the_v2_grads(release: str) -> None:
    ops, _, _ = _train_step()
    assert ops == ["npu_moe_token_permute", "_npu_moe_token_unpermute",
                   "npu_moe_token_unpermute_grad_v2", "npu_moe_token_permute_grad_v2"]
    import torch_npu  # type: ignore[import-not-found]

    assert torch_npu._npu_moe_token_unpermute is torch.ops.npu._npu_moe_token_unpermute
    # the public op has no kernel of its own below autograd that a dispatch mode could see
    assert "npu_moe_token_unpermute" not in ops


@pytest.mark.parametrize("release", ["2.12.0"], indirect=True)
def test_2_12_0_plain_unpermute_and_permute_grad_v2(release: str) -> None:
    ops, _, _ = _train_step()
    assert ops == ["npu_moe_token_permute", "npu_moe_token_unpermute",
                   "npu_moe_token_unpermute_grad", "npu_moe_token_permute_grad_v2"]
    assert not hasattr(torch.ops.npu, "_npu_moe_token_unpermute")
    assert not hasattr(torch.ops.npu, "npu_moe_token_unpermute_grad_v2")
    # the release's own schema: 2.12.0 types the v2 sizes as int, 2.13.0 as SymInt
    schema = str(torch.ops.npu.npu_moe_token_permute_grad_v2.default._schema)
    assert "int tokens_size_0" in schema


@pytest.mark.parametrize("release", ["2.7.1"], indirect=True)
def test_2_7_1_the_old_grads(release: str) -> None:
    ops, _, _ = _train_step()
    assert ops == ["npu_moe_token_permute", "npu_moe_token_unpermute",
                   "npu_moe_token_unpermute_grad", "npu_moe_token_permute_grad"]


def test_every_release_computes_the_same_gradients() -> None:
    grads = {}
    try:
        for version in ("2.7.1", "2.12.0", "2.13.0"):
            emulation.install("wide", version=version)
            _, g_tokens, g_probs = _train_step()
            grads[version] = (g_tokens, g_probs)
    finally:
        emulation.uninstall()
    for version in ("2.12.0", "2.13.0"):
        torch.testing.assert_close(grads[version], grads["2.7.1"])


def test_unknown_release_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no torch_npu 2\.13\.7; known releases: 2\.5\.1, "):
        emulation.install(version="2.13.7")
    assert not emulation.installed()


# --------------------------------------------------------------------------- the guards
@pytest.mark.parametrize("release", ["2.13.0"], indirect=True)
def test_dispatch_mode_catches_a_captured_default_reaching_the_internal_op(release: str) -> None:
    captured = torch.ops.npu.npu_moe_token_unpermute.default  # no Python name is guarded
    tokens, _, probs = _inputs()
    bad = torch.arange(8)  # int64 sorted_indices: the kernel reads int32
    with opcontracts.mode("strict"), ContractDispatchMode():
        with pytest.raises(ContractViolation, match="_npu_moe_token_unpermute") as info:
            captured(tokens.detach().repeat(2, 1), bad, probs.detach())
    assert info.value.arg == "sorted_indices"


@pytest.mark.parametrize("release", ["2.13.0"], indirect=True)
def test_backward_kernel_checked_at_the_dispatcher(release: str) -> None:
    """fp32 probs pass the forward (mode off there) and reach npu_moe_token_unpermute_grad_v2
    from the emulated C++ node: the patch's dispatcher guard raises for it in strict mode,
    and the grad op's packet is still a packet (nothing was set on torch.ops.npu)."""
    import torch_npu  # type: ignore[import-not-found]

    patch.apply()
    assert isinstance(torch.ops.npu.npu_moe_token_unpermute_grad_v2,
                      torch._ops.OpOverloadPacket)
    assert torch_npu.npu_moe_token_unpermute_grad_v2 is torch.ops.npu.npu_moe_token_unpermute_grad_v2
    assert any(r.kind == "kernel" and r.op == "npu_moe_token_unpermute_grad_v2"
               for r in patch.patched())
    tokens, indices, probs = _inputs(F32)
    with opcontracts.versions(cann="7.0.0"):  # CANN < 8: the unpermute kernels: bf16 only
        with opcontracts.mode("off"):
            permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
            out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
        with opcontracts.mode("strict"), pytest.raises(ContractViolation) as info:
            out.float().sum().backward()
    assert (info.value.op, info.value.arg) == ("npu_moe_token_unpermute_grad_v2", "probs")


@pytest.mark.parametrize("release", ["2.13.0"], indirect=True)
def test_v2_grads_check_the_dtype_passed_as_a_value(release: str) -> None:
    """The _grad_v2 ops take the forward tensor's dtype (a ScalarType) instead of the tensor:
    it is checked against the dtypes the _grad op allows that tensor, per CANN, as the node
    calls the kernel."""
    from opcontracts.emulation import _captured

    patch.apply()
    grad, probs = torch.randn(4, 8).to(BF16), torch.rand(4, 2).to(BF16)
    idx = torch.randperm(8).to(torch.int32)

    def unpermute_grad(dtype: torch.dtype) -> None:
        _captured.call("npu_moe_token_unpermute_grad_v2", grad, idx, 8, dtype, probs, False,
                       None, None)

    prev = opcontracts.set_versions(cann="7.0.0")  # CANN < 8: bf16 only
    try:
        with opcontracts.mode("strict"):
            unpermute_grad(BF16)
            with pytest.raises(ContractViolation, match="expected a dtype among bfloat16\n"
                               ) as info:
                unpermute_grad(F32)
            assert (info.value.op, info.value.arg) == ("npu_moe_token_unpermute_grad_v2",
                                                       "permuted_tokens_dtype")
            opcontracts.set_versions(cann="8.2.RC1")  # fp16 / bf16 / fp32
            unpermute_grad(F32)
            with pytest.raises(ContractViolation, match="permuted_tokens_dtype"):
                unpermute_grad(torch.int8)
            with pytest.raises(ContractViolation, match="tokens_dtype"):
                _captured.call("npu_moe_token_permute_grad_v2", torch.randn(8, 8).to(BF16), idx,
                               4, torch.int8, 2, False)
    finally:
        opcontracts.set_versions(**prev)


def test_internal_contracts_take_the_public_ops_rules() -> None:
    """One kernel, one set of rules: _npu_moe_token_unpermute's contracts are the public op's
    (every version of them), not a copy."""
    public = _registry.expanded("npu_moe_token_unpermute")
    internal = _registry.expanded("_npu_moe_token_unpermute")
    assert len(internal) == len(public)
    for p, i in zip(public, internal, strict=True):
        assert {n: a.dtype for n, a in p.args.items()} == {n: a.dtype for n, a in i.args.items()}
        assert i.targets == ("torch_npu._npu_moe_token_unpermute",
                             "torch.ops.npu._npu_moe_token_unpermute")
        assert "rules of npu_moe_token_unpermute" in (i.source or "")
    # the v2 grad keeps the arguments it still takes; permuted_tokens became optional
    v2 = _registry.expanded("npu_moe_token_unpermute_grad_v2")
    assert v2 and all(set(c.args) <= set(c.signature or ()) for c in v2)
    assert all(c.args["permuted_tokens"].optional for c in v2)
    # its dtype passed as a value takes the _grad op's rules for the tensor it stands for
    grads = {c.when: c for c in _registry.expanded("npu_moe_token_unpermute_grad")}
    for c in v2:
        taken = c.args["permuted_tokens_dtype"]
        assert taken.dtype_value and not taken.is_tensor and taken.dtype
    assert {c.args["permuted_tokens_dtype"].dtype for c in v2} == \
        {g.args["permuted_tokens"].dtype for g in grads.values()}
    permute_v2 = _registry.expanded("npu_moe_token_permute_grad_v2")
    assert all("tokens" not in c.args and c.args["grad_permuted_tokens"].same_dtype_as is None
               for c in permute_v2)


@pytest.mark.parametrize("op", ["_npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2",
                                "npu_moe_token_permute_grad_v2",
                                "_npu_moe_token_unpermute_with_routing_map"])
def test_internal_contracts_name_the_releases_that_have_the_op(op: str) -> None:
    d = digest.load()
    with_op = {v for v in d.versions if op in d.release(v).schemas}
    entry = next(e for e in _registry.shipped_index() if e.op == op)
    assert entry.when is not None
    spec = entry.when["torch_npu"]
    alternatives = [spec] if isinstance(spec, str) else spec
    said = {v for v in d.versions
            if any(Version(v) in SpecifierSet(a) for a in alternatives)}
    assert said == with_op


def test_derived_rules_follow_a_change_to_the_public_op() -> None:
    """A contract registered for the public op reaches its internal op too."""
    from opcontracts import Arg, Contract

    _registry.load_shipped()
    try:
        _registry.register(Contract("npu_moe_token_unpermute",
                                    {"probs": Arg("fp16", optional=True)}, replace=True))
        got = _registry.resolve("_npu_moe_token_unpermute")
        assert got is not None and got.args["probs"].dtype == ("float16",)
    finally:
        _registry.clear()  # the shipped packs are read again on the next need
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _registry.resolve("_npu_moe_token_unpermute")
    assert got is not None and got.args["probs"].dtype != ("float16",)


def test_wheel_verify_fails_when_a_route_has_no_contract() -> None:
    """Guarding the public name alone misses 2.13's internal op and v2 grads: verify says so."""
    from opcontracts.spec import load_contracts
    from opcontracts.wheel import verify

    shipped = load_contracts(_registry.shipped_contracts_dir())
    d = digest.load()
    assert not any(r.fails for r in verify.verify(shipped, d, ["2.12.0", "2.13.0"], "*moe_token*",
                                                  routes=True))
    public_only = [c for c in shipped if c.file is None or "moe_token_internal" not in c.file]
    assert not any(r.fails for r in verify.verify(public_only, d, ["2.13.0"], "*moe_token*"))
    results = verify.verify(public_only, d, ["2.12.0", "2.13.0"], "*moe_token*", routes=True)
    routes = {r.op: r.groups[0].versions for r in results
              if any(f.kind == "unguarded-route" for g in r.groups for f in g.findings)}
    assert routes == {"_npu_moe_token_unpermute": ["2.13.0"],
                      "npu_moe_token_unpermute_grad_v2": ["2.13.0"],
                      "npu_moe_token_permute_grad_v2": ["2.12.0", "2.13.0"],
                      "_npu_moe_token_unpermute_with_routing_map": ["2.12.0", "2.13.0"]}
    assert all(r.fails for r in results if r.op in routes)
    text = verify.render(results, 2)
    assert "rules_of = 'npu_moe_token_unpermute'" in text


@pytest.mark.parametrize("release", ["2.13.0"], indirect=True)
def test_out_overload_registered_computed_and_checked(release: str) -> None:
    """torch_npu's npu_fused_infer_attention_score.out (used by its NPU-graph handlers): the
    emulation registers it, it writes what the default overload returns, and a call through the
    guarded packet that binds to it (out tensors given) is checked like the default one."""
    import torch_npu  # type: ignore[import-not-found]

    from opcontracts import reference

    patch.apply()
    assert "out" in torch.ops.npu.npu_fused_infer_attention_score.overloads()
    ref = reference.get("npu_fused_infer_attention_score")
    assert ref is not None and ref.example is not None
    args, kwargs = ref.example(torch.Generator().manual_seed(0))
    want = torch_npu.npu_fused_infer_attention_score(*args, **kwargs)
    outs = {"attention_out": torch.empty(0, dtype=want[0].dtype),
            "softmax_lse": torch.empty(0, dtype=want[1].dtype)}
    with opcontracts.mode("strict"):
        got = torch_npu.npu_fused_infer_attention_score(*args, **kwargs, **outs)
    assert got[0] is outs["attention_out"] and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    bad = (args[0].double(), *args[1:])
    with opcontracts.mode("strict"), pytest.raises(ContractViolation, match="query"):
        torch_npu.npu_fused_infer_attention_score(*bad, **kwargs, **outs)
