"""Issue 13, "no stale decision": guards follow every change to what applies, the checkers
never let a wrong call through, and the bookkeeping holds at scale.  Each test failed on the
code before the fix it is named for."""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import pytest
import torch

import opcontracts
import opcontracts.patch as patch
from opcontracts import Arg, Contract, ContractViolation, emulation
from opcontracts._engine import records as _report
from opcontracts._engine import registry


@pytest.fixture
def emu(npu: Any) -> Any:
    """The emulation and the patch (conftest's ``npu``)."""
    return npu

def _unpermute_args(probs_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    n, k, h = 4, 2, 8
    tokens = torch.randn(n * k, h, dtype=torch.bfloat16)
    idx = torch.randperm(n * k).to(torch.int32)
    probs = torch.rand(n, k).to(probs_dtype)
    return tokens, idx, probs


# --------------------------------------------------------------------------- item 1
def test_patched_guard_follows_set_versions_both_ways(emu: Any) -> None:
    """A stale acceptance (2.13 + CANN 8.0.0 allows fp32 probs; CANN 8.0.RC3 does not) and a
    stale false alarm (the reverse), on a guard that has been called and memoised."""
    opcontracts.set_mode("strict")
    f = emu.npu_moe_token_unpermute
    opcontracts.set_versions(torch_npu="2.13.0", cann="8.0.0")
    for _ in range(3):  # called, learnt by the memo
        f(*_unpermute_args(torch.float32))
    opcontracts.set_versions(cann="8.0.RC3")
    with pytest.raises(ContractViolation, match="probs"):
        f(*_unpermute_args(torch.float32))
    opcontracts.set_versions(cann="8.0.0")
    f(*_unpermute_args(torch.float32))  # no stale false alarm


def test_patched_guard_follows_register_replace(emu: Any) -> None:
    opcontracts.set_mode("strict")
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    emu.npu_swiglu(x)
    emu.npu_swiglu(x)
    old = registry.get_contract("npu_swiglu")
    narrowed = old.model_copy(update={"args": {**old.args, "self": Arg("fp16")}})
    registry.register(narrowed, replace=True)
    with pytest.raises(ContractViolation, match="self"):
        emu.npu_swiglu(x)
    registry.register(old, replace=True)
    emu.npu_swiglu(x)


def test_decorated_guard_by_name_follows_the_registry() -> None:
    opcontracts.set_mode("strict")
    opcontracts.register(Contract("trust_op1", {"x": Arg("bf16")}, source="v1"))

    @opcontracts.enforce("trust_op1")
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    f(torch.ones(2, dtype=torch.bfloat16))
    f(torch.ones(2, dtype=torch.bfloat16))
    opcontracts.register(Contract("trust_op1", {"x": Arg("fp32")}, source="v2"), replace=True)
    f(torch.ones(2))
    with pytest.raises(ContractViolation, match="v2"):
        f(torch.ones(2, dtype=torch.bfloat16))


def test_compiled_code_follows_the_registry() -> None:
    opcontracts.set_mode("strict")
    opcontracts.register(Contract("trust_op1c", {"x": Arg("bf16")}))

    @opcontracts.enforce("trust_op1c")
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    torch._dynamo.reset()
    g = torch.compile(lambda x: f(x) + 1, backend="eager")
    g(torch.ones(2, dtype=torch.bfloat16))
    opcontracts.register(Contract("trust_op1c", {"x": Arg("fp32")}), replace=True)
    with pytest.raises(ContractViolation, match="float32"):
        g(torch.ones(2, dtype=torch.bfloat16))
    g(torch.ones(2))


# --------------------------------------------------------------------------- item 2
@pytest.mark.parametrize("arg", [
    Arg(),
    Arg(values={"nonnegative": True}),
    Arg(list=True),
    Arg(optional=True, same_dtype_as="y"),
])
def test_must_be_a_tensor_holds_without_other_rules(arg: Arg) -> None:
    opcontracts.set_mode("strict")
    args = {"x": arg, "y": Arg(optional=True)}
    c = Contract("trust_o2", args)

    @opcontracts.enforce(c)
    def f(x: Any, y: Any = None) -> Any:
        return x

    with pytest.raises(ContractViolation):
        opcontracts.check(c, 5)
    with pytest.raises(ContractViolation, match="'x'"):
        f(5)
    with pytest.raises(ContractViolation, match=r"'x(\[1\])?'"):
        f([torch.ones(1), 5] if arg.tensor_list else 5)


# --------------------------------------------------------------------------- item 3
def test_required_bounded_scalar_rejects_none_and_wrong_types() -> None:
    opcontracts.set_mode("strict")
    c = Contract("trust_o3", {"x": Arg("fp32"), "k": Arg(ge=1)})

    @opcontracts.enforce(c)
    def f(x: torch.Tensor, k: Any) -> torch.Tensor:
        raise AssertionError("the kernel must not run")

    x = torch.ones(2)
    with pytest.raises(ContractViolation, match="'k'"):
        f(x, None)
    with pytest.raises(ContractViolation, match="'k'"):
        f(x, "abc")
    with pytest.raises(ContractViolation, match="'k'"):
        f(x, 0)
    with pytest.raises(ContractViolation, match="'k'"):
        opcontracts.check(c, x, "abc")


# --------------------------------------------------------------------------- item 4
def test_check_reports_a_missing_required_tensor() -> None:
    c = Contract("trust_o4", {"x": Arg("fp32"), "w": Arg("fp32")})
    with pytest.raises(ContractViolation, match="'w'"):
        opcontracts.check(c, torch.ones(2))


# --------------------------------------------------------------------------- item 5
def test_contiguous_rule_holds_under_torch_compile() -> None:
    opcontracts.set_mode("strict")
    c = Contract("trust_o5", {"x": Arg("fp32", contiguous=True)})

    @opcontracts.enforce(c)
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    torch._dynamo.reset()
    bad = torch.ones(8, 4).t()
    with pytest.raises(ContractViolation, match="contiguous"):
        op(bad)
    with pytest.raises(ContractViolation, match="contiguous"):
        torch.compile(lambda x: op(x) + 1, backend="eager")(bad)
    opcontracts.set_mode("fix")
    out = torch.compile(lambda x: op(x) + 1, backend="eager")(torch.ones(8, 4).t())
    assert torch.equal(out, torch.full((4, 8), 3.0))


# --------------------------------------------------------------------------- item 6
def test_same_device_tells_cpu_from_meta() -> None:
    c = Contract("trust_o6", {"x": Arg("fp32"), "y": Arg("fp32")}, same_device=True)
    opcontracts.check(c, torch.ones(2), torch.ones(2))
    with pytest.raises(ContractViolation, match="device"):
        opcontracts.check(c, torch.ones(2), torch.ones(2, device="meta"))


# --------------------------------------------------------------------------- item 7
def test_fix_mode_call_site_with_different_argument_counts() -> None:
    opcontracts.set_mode("fix")
    c = Contract("trust_o7", {"x": Arg("bf16"), "w": Arg("bf16", optional=True)})

    @opcontracts.enforce(c)
    def f(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        return x if w is None else x + w

    x = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(3):
            out = f(x) if i % 2 == 0 else f(x, torch.ones(2))  # one line, two arities
            assert out.dtype is torch.bfloat16


# --------------------------------------------------------------------------- item 8 is the
# mode module's (tests/test_modes.py); item 9
def test_warn_once_and_dropped_beyond_many_call_sites() -> None:
    c = Contract("trust_o9", {"x": Arg("bf16")})

    @opcontracts.enforce(c)
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    x = torch.ones(1)
    n = 10_000
    # n distinct call sites: one generated function per site, each called twice
    src = "\n".join(f"def s{i}(f, x):\n    return f(x)" for i in range(n))
    ns: dict[str, Any] = {}
    exec(compile(src, "<trust-sites>", "exec"), ns)
    sites = [ns[f"s{i}"] for i in range(n)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            for s in sites:
                s(f, x)
    shown = [w for w in caught if issubclass(w.category, opcontracts.ContractWarning)]
    assert len(shown) == n
    rep = opcontracts.report()
    assert len(rep.records) == _report.MAX_RECORDS
    assert rep.dropped == n - _report.MAX_RECORDS
    assert rep.total == 2 * n


# --------------------------------------------------------------------------- item 10
def test_unpatch_releases_the_guards(emu: Any) -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    emu.npu_swiglu(x)
    # the packet is guarded in place and stays; the guard it was given must go
    ref = weakref.ref(emu.npu_swiglu.__dict__["_oc_guard"])
    for _ in range(3):  # each cycle must not keep more
        patch.unpatch()
        patch.apply()
        emu.npu_swiglu(x)
    patch.unpatch()
    gc.collect()
    assert ref() is None and "_oc_guard" not in emu.npu_swiglu.__dict__


# --------------------------------------------------------------------------- item 11
def test_emulation_install_after_the_patch_guards_the_ops() -> None:
    patch.unpatch()
    patch.apply()
    try:
        emulation.install()
        assert getattr(torch.ops.npu.npu_swiglu, "__opcontracts_patched__", False)
    finally:
        patch.unpatch()
        emulation.uninstall()


# --------------------------------------------------------------------------- item 12
def test_missing_lists_only_what_cannot_be_found(tmp_path: Any, monkeypatch: Any) -> None:
    pkg = tmp_path / "trust_pkg12"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "ops.py").write_text(
        "import sys\n"
        "missing = dict(sys.modules['opcontracts.patch'].missing())\n"
        "def f(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patch.unpatch()
    try:
        import trust_pkg12  # the parent is loaded, the submodule not yet

        patch.apply([Contract("trust_o12", {"x": Arg("fp32")},
                              targets=["trust_pkg12.sub.ops.f", "trust_pkg12.sub.ops.g",
                                       "trust_pkg12.nosuch.h"])])
        assert "trust_pkg12.sub.ops.f" not in patch.missing()
        assert "trust_pkg12.nosuch.h" in patch.missing()
        import trust_pkg12.sub.ops as ops

        assert "trust_pkg12.sub.ops.f" not in ops.missing  # while its module executes
        assert getattr(ops.f, "__opcontracts_patched__", False)
        assert "trust_pkg12.sub.ops.g" in patch.missing()
        assert trust_pkg12 is not None
    finally:
        patch.unpatch()
        for m in [m for m in list(__import__("sys").modules) if m.startswith("trust_pkg12")]:
            del __import__("sys").modules[m]


# --------------------------------------------------------------------------- item 14 (code)
@pytest.mark.parametrize("args", [
    {"x": Arg(optional=True)},
    {"_c0": Arg("fp32"), "_e0": Arg("fp32", "N*K"), "_s": Arg("fp32", "N K"), "_d_N": Arg()},
])
def test_generated_code_compiles_for_any_contract(args: dict[str, Arg]) -> None:
    c = Contract("trust_o14", args)
    tensors = [torch.ones(2, 1) if "N K" in (a.shape or ()) else torch.ones(2) for a in args.values()]
    opcontracts.check(c, *tensors)


def test_a_contract_that_cannot_compile_never_kills_the_job() -> None:
    """A parameter the generated checker cannot take: a warning naming the contract, and the
    target runs unguarded (its file is the user's, the job is not)."""
    c = Contract("trust_o14b", {"x": Arg("fp32")}, targets=["trust_mod14.f"])
    import sys
    import types

    mod = types.ModuleType("trust_mod14")
    ns: dict[str, Any] = {}
    exec("def f(x, _oc_internal=None):\n    return x\n", ns)
    mod.f = ns["f"]  # type: ignore[attr-defined]
    sys.modules["trust_mod14"] = mod
    patch.unpatch()
    try:
        patch.apply([c])
        opcontracts.set_mode("strict")
        with pytest.warns(RuntimeWarning, match="trust_o14b"):
            assert mod.f(5) == 5
    finally:
        patch.unpatch()
        del sys.modules["trust_mod14"]


# --------------------------------------------------------------------------- item 19
def test_one_user_mistake_is_one_record(emu: Any) -> None:
    """MindSpeed's fused_swiglu is Python calling torch_npu's npu_swiglu, and its backward runs
    npu_swiglu_backward: one record for the user's call, the nested ones attached to it.
    (MindSpeed's unpermute nests nothing: its C++ extension calls aclnn directly, see
    tests/test_mindspeed_opaque.py.)"""
    from mindspeed.core.fusions.fused_bias_swiglu import fused_swiglu

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)  # no kernel takes fp64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fused_swiglu(x)
        out.sum().backward()
    rep = opcontracts.report()
    assert len(rep.records) == 1, rep.table()
    top = rep.records[0]
    assert top.op == "mindspeed.fused_swiglu" and top.arg == "x"
    assert {n["op"] for n in top.nested} >= {"npu_swiglu", "npu_swiglu_backward"}
    assert "1 contract violation(s) at 1 site(s)" in rep.table()
    shown = [w for w in caught if issubclass(w.category, opcontracts.ContractWarning)]
    assert len(shown) == 1


def test_merged_sources_do_not_repeat() -> None:
    a = Contract("trust_o19", {"x": Arg("bf16", source="doc A + doc B")}, source="pack A + B; C")
    b = Contract("trust_o19", {"x": Arg("bf16", source="doc B")}, source="C",
                 when={"soc": "Ascend910B"})
    m = registry.merge_contracts([a, b])
    assert m.args["x"].source == "doc A; doc B"
    assert m.source == "pack A; B; C"
    again = registry.merge_contracts([m, b])
    assert again.source == "pack A; B; C" and again.args["x"].source == "doc A; doc B"


# --------------------------------------------------------------------------- item 21
def _violation(c: Contract, *args: Any) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        opcontracts.check(c, *args)
    return info.value


def test_messages_say_what_to_do() -> None:
    same = Contract("trust_o21a", {"x": Arg(["bf16", "fp32"]), "w": Arg(same_dtype_as="x")})
    v = _violation(same, torch.ones(2, dtype=torch.bfloat16), torch.ones(2))
    assert "bfloat16" in v.expected  # the partner's dtype, not just its name

    dims = Contract("trust_o21b", {"x": Arg("fp32", "B S H", dims={"H": {"le": 1024}})})
    v = _violation(dims, torch.ones(1, 1, 2048))
    assert v.fix is not None and "H <= 1024" in v.fix and "H=2048" not in v.fix

    bound = Contract("trust_o21c", {"x": Arg("fp32"), "k": Arg(ge=1, le=8)})
    v = _violation(bound, torch.ones(1), 9)
    assert v.fix is not None and "k" in v.fix

    lst = Contract("trust_o21d", {"x": Arg("fp32", list=True, max_len=2)})
    v = _violation(lst, [torch.ones(1)] * 3)
    assert v.fix is not None
    v = _violation(lst, [torch.ones(1), torch.ones(1, dtype=torch.int32)])
    assert v.fix is not None and "x[1]" in v.fix


def test_merging_a_user_contract_never_kills_the_job(tmp_path: Any) -> None:
    """One contract's shape with another's size limits made an invalid merged rule, and
    `patch.apply()` died resolving it."""
    f = tmp_path / "user.toml"
    f.write_text('[[contract]]\nop = "npu_swiglu"\nwhen = {cann = ">=99"}\nsource = "user"\n'
                 '[contract.args.self]\nshape = "N H"\ndims = {H = {le = 4}}\n')
    opcontracts.set_versions(cann="unknown")
    try:
        registry.load_shipped()
        registry.register(opcontracts.load_contracts(f))
        merged = registry.resolve("npu_swiglu")
        assert merged is not None and "user" in (merged.source or "")
        patch.unpatch()
        patch.apply()
    finally:
        patch.unpatch()
        opcontracts.set_versions(cann=None)


def test_fix_mode_that_refuses_a_call_warns_no_fix() -> None:
    """A call with a castable dtype and an unrepairable shape fails: no 'fixed' warning."""
    c = Contract("trust_fixrefuse", {"x": Arg("bf16", "N H"), "w": Arg("bf16", "H")})

    @opcontracts.enforce(c)
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x

    opcontracts.set_mode("fix")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ContractViolation, match="'w'"):
            f(torch.ones(2, 4), torch.ones(5, dtype=torch.bfloat16))
    assert not [w for w in caught if issubclass(w.category, opcontracts.ContractFixWarning)]
    assert {(r.arg, r.fixed) for r in opcontracts.report().records} == {("x", 0), ("w", 0)}


def test_unpatch_restores_names_bound_after_the_patch(emu: Any) -> None:
    import types

    user = types.ModuleType("trust_user_mod")
    import sys

    sys.modules["trust_user_mod"] = user
    try:
        exec("from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute",
             user.__dict__)
        assert getattr(user.npu_moe_token_unpermute, "__opcontracts_patched__", False)
        patch.unpatch()
        assert not getattr(user.npu_moe_token_unpermute, "__opcontracts_patched__", False)
    finally:
        del sys.modules["trust_user_mod"]


def test_submodules_are_reachable_after_a_bare_import() -> None:
    import subprocess
    import sys

    code = ("import sys, opcontracts; r = opcontracts.reference; "
            "print(callable(r.register), 'opcontracts.patch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


@pytest.mark.parametrize(("var", "value", "expect_rc", "text"), [
    ("OPCONTRACTS_VALUES", "maybe", 1, "SettingError: OPCONTRACTS_VALUES: cannot read 'maybe'"),
    ("OPCONTRACTS_CANN_VERSION", "garbage", 0, "'garbage' is not a version"),
])
def test_other_settings_are_read_or_refused_out_loud(var: str, value: str, expect_rc: int,
                                                      text: str) -> None:
    """A typo in OPCONTRACTS_VALUES silently turned value checks off; an unreadable version
    override was taken as given (and read as unknown without a word)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, var: value}
    code = ("import opcontracts.patch, opcontracts._lang.versions as v; "
            "print('cann', v.current().cann)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == expect_rc, out.stderr
    assert text in out.stderr
    if expect_rc == 0:
        assert out.stdout.strip() == "cann None"


def test_inductor_compiles_under_the_patch() -> None:
    """A guarded torch.ops.npu packet lacked op_overloads(): torch's walk over the namespace
    (inductor's decomposition table, built at its import) failed with "'CustomDecompTable'
    object is not a mapping". A fresh process: the table is built once per process."""
    import subprocess
    import sys

    code = ("import torch\nfrom opcontracts import emulation\nemulation.install()\n"
            "import opcontracts.patch\n"
            "f = torch.compile(lambda x, g: torch.ops.npu.npu_rms_norm(x, g)[0] * 2, "
            "backend='inductor')\n"
            "print(f(torch.randn(4, 8), torch.ones(8)).shape)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([4, 8])" in out.stdout


def test_a_checker_freed_while_torch_compile_traces_is_forgotten_after_the_trace() -> None:
    """A compiled contract's finalizer can run inside dynamo's tracing, while dynamo iterates
    the dicts the traced guard reads: it must not change them then (the trace failed with
    "dictionary changed size during iteration"); the entry goes at the next removal outside a
    trace."""
    from torch._guards import TracingContext, tracing

    from opcontracts._engine import compile as _compile

    _compile.OP_BY_KEY[-7] = "gone_op"
    _compile.FAST_BY_KEY[-7] = lambda *a, **k: True
    with tracing(TracingContext(None)):
        _compile._forget(-7, ())
        assert _compile.OP_BY_KEY[-7] == "gone_op"  # kept while the trace is on
    _compile.OP_BY_KEY[-8] = "other_op"
    _compile._forget(-8, ())  # outside a trace: both go
    assert -7 not in _compile.OP_BY_KEY and -8 not in _compile.OP_BY_KEY
    assert -7 not in _compile.FAST_BY_KEY
