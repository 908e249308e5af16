"""``import opcontracts.patch`` on modules, aliases, later imports, classes and op packets."""

from __future__ import annotations

import importlib
import inspect
import linecache
import pickle
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import opcontracts
import opcontracts.patch as patch
from opcontracts import Arg, Contract, ContractViolation
from opcontracts._engine import registry

PKG = "octest_pkg"


def _contract(op: str, *targets: str, **args: Arg) -> Contract:
    return Contract(op, args or {"x": Arg("bf16", "N H")}, targets=list(targets),
                    source="test")


@pytest.fixture
def pkg(tmp_path: Path) -> Iterator[Path]:
    """A small package on disk, not imported yet."""
    root = tmp_path / PKG
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "ops.py").write_text(textwrap.dedent('''
        import torch

        def scale(x, factor=2.0):
            """Scale x."""
            return x * factor

        class Layer:
            def forward(self, x):
                return x + 1

            @staticmethod
            def kernel(x):
                return x - 1

            @classmethod
            def build(cls, x):
                return x * 3

        class Square(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 2 * x * g
    '''))
    (root / "user.py").write_text("from octest_pkg.ops import scale\n\ndef run(x):\n    return scale(x)\n")
    sys.path.insert(0, str(tmp_path))
    yield root
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
        del sys.modules[name]


@pytest.fixture
def clean_patch() -> Iterator[None]:
    patch.unpatch()
    ops_before = {c.op for c in registry.all_contracts()}
    yield
    patch.unpatch()
    for c in registry.all_contracts():
        if c.op not in ops_before:
            registry.unregister(c.op)


BAD = torch.ones(2, 3)  # fp32 where bf16 is required
GOOD = torch.ones(2, 3, dtype=torch.bfloat16)


def test_module_attribute_patched_and_unpatched_identically(pkg, clean_patch):
    from octest_pkg import ops

    original = ops.scale
    patch.apply([_contract("t.scale", f"{PKG}.ops.scale")])
    assert ops.scale is not original and ops.scale.__wrapped__ is original
    assert ops.scale.__name__ == "scale" and ops.scale.__doc__ == "Scale x."
    assert inspect.signature(ops.scale) == inspect.signature(original)
    with opcontracts.mode("strict"):
        ops.scale(GOOD)
        with pytest.raises(ContractViolation, match="t.scale"):
            ops.scale(BAD)
    [rec] = [r for r in patch.patched() if r.target == f"{PKG}.ops.scale"]
    assert rec.kind == "function" and rec.where == f"{PKG}.ops"
    patch.unpatch()
    assert ops.scale is original


def test_alias_bound_before_the_patch_is_rebound(pkg, clean_patch):
    from octest_pkg import ops, user

    assert user.scale is ops.scale
    patch.apply([_contract("t.scale", f"{PKG}.ops.scale")])
    assert user.scale is ops.scale  # the alias now points at the guard too
    with opcontracts.mode("strict"), pytest.raises(ContractViolation):
        user.run(BAD)
    assert any(r.kind == "alias" and r.target == f"{PKG}.user.scale" for r in patch.patched())
    original = ops.scale.__wrapped__
    patch.unpatch()
    assert user.scale is original and ops.scale is original


def test_aliases_are_found_whatever_else_a_module_holds(pkg, clean_patch):
    # the sweep tests each module by hashing its values in C; values that cannot be hashed, or
    # whose __hash__ raises, send the module to the identity test, and a value merely equal to
    # an original (same hash, ==) is never rebound
    import types

    from octest_pkg import ops

    original = ops.scale

    class Raises:
        def __hash__(self) -> int:
            raise ValueError("no hash today")

    class LooksLike:
        def __hash__(self) -> int:
            return hash(original)

        def __eq__(self, other: object) -> bool:
            return True

    mods = {}
    for name, extra in (("unhashable", [1, 2]), ("raising", Raises()), ("lookalike", None)):
        m = types.ModuleType(f"octest_alias_{name}")
        m.extra = extra  # type: ignore[attr-defined]
        m.scale = original  # type: ignore[attr-defined]
        mods[name] = m
    impostor = types.ModuleType("octest_alias_impostor")
    impostor.scale = LooksLike()  # type: ignore[attr-defined]
    sys.modules.update({m.__name__: m for m in (*mods.values(), impostor)})
    try:
        patch.apply([_contract("t.scale", f"{PKG}.ops.scale")])
        for m in mods.values():
            assert m.scale is ops.scale is not original, m.__name__
        assert type(impostor.scale) is LooksLike
        patch.unpatch()
        assert all(m.scale is original for m in mods.values())
    finally:
        for m in (*mods.values(), impostor):
            sys.modules.pop(m.__name__, None)


def test_module_imported_after_the_patch(pkg, clean_patch):
    assert PKG not in sys.modules
    patch.apply([_contract("t.scale", f"{PKG}.ops.scale")])
    assert f"{PKG}.ops.scale" in patch.pending()
    assert any(type(f).__name__ == "_ImportHook" for f in sys.meta_path)
    user = importlib.import_module(f"{PKG}.user")  # imports ops, then binds the name
    with opcontracts.mode("strict"), pytest.raises(ContractViolation):
        user.run(BAD)
    assert f"{PKG}.ops.scale" not in patch.pending()
    ops = sys.modules[f"{PKG}.ops"]
    assert ops.__spec__.loader.__class__.__name__ != "_PatchingLoader"


def test_hook_removed_when_nothing_is_pending(pkg, clean_patch):
    from octest_pkg import ops  # noqa: F401

    opcontracts.register(_contract("t.scale", f"{PKG}.ops.scale"), replace=True)
    patch._patcher.apply([("t.scale", [f"{PKG}.ops.scale"])])
    assert patch.pending() == []
    assert not any(type(f).__name__ == "_ImportHook" for f in sys.meta_path)


def test_unrelated_imports_are_not_intercepted(pkg, clean_patch):
    patch.apply([_contract("t.scale", f"{PKG}.ops.scale")])
    hook = next(f for f in sys.meta_path if type(f).__name__ == "_ImportHook")
    assert hook.find_spec("json.decoder") is None
    assert "json" not in patch._patcher.watched


def test_class_attributes_and_autograd_function(pkg, clean_patch):
    from octest_pkg import ops

    raw = dict(ops.Layer.__dict__)
    apply_before = ops.Square.apply
    patch.apply([
        _contract("t.forward", f"{PKG}.ops.Layer.forward"),
        _contract("t.kernel", f"{PKG}.ops.Layer.kernel"),
        _contract("t.build", f"{PKG}.ops.Layer.build"),
        _contract("t.square", f"{PKG}.ops.Square"),
    ])
    kinds = {r.target: r.kind for r in patch.patched()}
    assert kinds[f"{PKG}.ops.Layer.kernel"] == "staticmethod"
    assert kinds[f"{PKG}.ops.Layer.build"] == "classmethod"
    assert kinds[f"{PKG}.ops.Layer.forward"] == "method"
    layer = ops.Layer()
    with opcontracts.mode("strict"):
        assert layer.forward(GOOD).dtype is torch.bfloat16
        assert ops.Layer.kernel(GOOD).dtype is torch.bfloat16
        assert ops.Layer.build(GOOD).dtype is torch.bfloat16
        for call in (layer.forward, ops.Layer.kernel, ops.Layer.build, ops.Square.apply):
            with pytest.raises(ContractViolation):
                call(BAD)
        x = torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True)
        ops.Square.apply(x).sum().backward()
        assert x.grad is not None
    patch.unpatch()
    for k in ("forward", "kernel", "build"):
        assert ops.Layer.__dict__[k] is raw[k]
    assert "apply" not in ops.Square.__dict__ and ops.Square.apply == apply_before


def test_torch_ops_packet_keeps_overloads(clean_patch):
    lib = torch.library.Library("octest", "DEF")
    try:
        lib.define("myop(Tensor x, float factor=2.0) -> Tensor")
        lib.impl("myop", lambda x, factor=2.0: x * factor, "CompositeExplicitAutograd")
        packet = torch.ops.octest.myop
        patch.apply([_contract("t.myop", "torch.ops.octest.myop")])
        guarded = torch.ops.octest.myop
        # guarded in place: the same packet, still an OpOverloadPacket, its overloads intact
        assert guarded is packet and isinstance(guarded, torch._ops.OpOverloadPacket)
        assert guarded.default is packet.default and guarded.overloads() == ["default"]
        assert list(inspect.signature(guarded).parameters) == ["x", "factor"]
        with opcontracts.mode("strict"):
            guarded(GOOD)
            with pytest.raises(ContractViolation):
                guarded(BAD)
            guarded.default(BAD)  # a captured overload bypasses Python names
        patch.unpatch()
        assert torch.ops.octest.myop is packet and type(packet) is torch._ops.OpOverloadPacket
        assert "_oc_guard" not in packet.__dict__
        with opcontracts.mode("strict"):
            packet(BAD)  # unguarded again
    finally:
        lib._destroy()


def test_apply_is_idempotent_and_cycles_leave_nothing(pkg, clean_patch):
    from octest_pkg import ops, user

    original = ops.scale
    c = _contract("t.scale", f"{PKG}.ops.scale")
    patch.apply([c])
    n = len(patch.patched())
    guard = ops.scale
    patch.apply([c])
    import opcontracts.patch as again  # noqa: F401 - importing twice is a no-op too

    assert len(patch.patched()) == n and ops.scale is guard
    patch.unpatch()
    meta = list(sys.meta_path)
    cache = len(linecache.cache)
    for _ in range(1000):
        patch.apply([c])
        patch.unpatch()
    assert ops.scale is original and user.scale is original
    assert sys.meta_path == meta
    assert len(linecache.cache) <= cache  # nothing kept (checkers freed meanwhile leave it too)
    assert patch.patched() == []


def test_missing_target_is_reported_not_raised(pkg, clean_patch):
    from octest_pkg import ops  # noqa: F401

    patch.apply([_contract("t.gone", f"{PKG}.ops.no_such_function"),
                 _contract("t.gone2", f"{PKG}.ops.NoClass.method")])
    miss = patch.missing()
    assert f"{PKG}.ops.NoClass.method" in miss
    # a module attribute may still appear (a module can define it later): it stays pending
    assert f"{PKG}.ops.no_such_function" in patch.pending()


def test_guarded_function_pickles_by_reference(pkg, clean_patch):
    from octest_pkg import ops

    patch.apply([_contract("t.scale", f"{PKG}.ops.scale")])
    assert pickle.loads(pickle.dumps(ops.scale)) is ops.scale


def test_bad_user_contract_file_warns_and_job_continues(tmp_path, monkeypatch, clean_patch):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[contract]]\nop = "x"\n[contract.args.a]\ndtype = "bf17"\n')
    monkeypatch.setenv("OPCONTRACTS_CONTRACTS", str(bad))
    with pytest.warns(RuntimeWarning, match=r"bad\.toml, contract x, field args\.a\.dtype"):
        patch.apply()


def test_dispatch_mode_catches_a_captured_overload(clean_patch):
    from opcontracts.dispatch import ContractDispatchMode

    lib = torch.library.Library("octest2", "DEF")
    try:
        lib.define("myop(Tensor x) -> Tensor")
        lib.impl("myop", lambda x: x * 2, "CompositeExplicitAutograd")
        captured = torch.ops.octest2.myop.default
        c = _contract("t.myop2", "torch.ops.octest2.myop")
        with opcontracts.mode("strict"), ContractDispatchMode([c]):
            captured(GOOD)
            torch.add(BAD, BAD)  # unrelated ops pass through
            with pytest.raises(ContractViolation) as ei:
                captured(BAD)
        assert ei.value.call_site is not None and ei.value.call_site.startswith(__file__)
        with opcontracts.mode("warn"), ContractDispatchMode([c]), pytest.warns(opcontracts.ContractWarning):
            assert captured(BAD).dtype is torch.float32
    finally:
        lib._destroy()


def test_reapply_after_the_guarded_object_was_replaced(clean_patch):
    lib = torch.library.Library("octest3", "DEF")
    lib.define("myop(Tensor x) -> Tensor")
    lib.impl("myop", lambda x: x * 2, "CompositeExplicitAutograd")
    patch.apply([_contract("t.myop3", "torch.ops.octest3.myop")])
    assert getattr(torch.ops.octest3.myop, "__opcontracts_patched__", False)
    lib._destroy()  # what emulation.uninstall() does: the packet and our guard go away
    lib = torch.library.Library("octest3", "DEF")
    try:
        lib.define("myop(Tensor x) -> Tensor")
        lib.impl("myop", lambda x: x * 2, "CompositeExplicitAutograd")
        patch.apply()
        assert getattr(torch.ops.octest3.myop, "__opcontracts_patched__", False)
        with opcontracts.mode("strict"), pytest.raises(ContractViolation):
            torch.ops.octest3.myop(BAD)
    finally:
        lib._destroy()


def test_a_layer_over_a_guard_does_not_lose_the_record(pkg, clean_patch):
    import functools

    from octest_pkg import ops

    original = ops.scale
    patch.apply([_contract("t.scale", f"{PKG}.ops.scale")])
    guard = ops.scale
    ops.scale = functools.wraps(guard)(lambda *a, **k: guard(*a, **k))  # msprobe-style layer
    patch.apply()
    patch.unpatch()
    assert ops.scale is original


@pytest.fixture
def emulated_patch(tmp_path):
    """The emulation (narrow profile) with `import opcontracts.patch`'s state, as a job has."""
    from opcontracts import emulation

    patch.unpatch()
    was = emulation.installed()
    emulation.install("narrow")
    patch.apply()
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("octest_user")]:
        del sys.modules[name]
    patch.unpatch()
    if not was:
        emulation.uninstall()
    patch.apply()


def _unpermute_args(probs_dtype=torch.bfloat16):
    tokens = torch.randn(8, 16).to(torch.bfloat16)
    idx = torch.randperm(8).to(torch.int32)
    probs = torch.rand(4, 2).to(probs_dtype)
    return tokens, idx, probs


def test_every_route_to_the_emulated_ops_is_caught_in_strict(emulated_patch):
    import torch_npu
    from mindspeed.ops import npu_moe_token_unpermute as ms_mod
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute as imported_before

    # a user module imported only after the patch, binding the names at its import
    (emulated_patch / "octest_user.py").write_text(
        "from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute\n"
        "import torch_npu\n"
        "def run(*a):\n    return npu_moe_token_unpermute(*a)\n"
        "def run_npu(*a):\n    return torch_npu.npu_moe_token_unpermute(*a)\n")
    import octest_user

    good, bad = _unpermute_args(), _unpermute_args(torch.float32)
    opcontracts.set_targets(cann="8.0.RC3")  # the incident's stack: torch_npu's unpermute is bf16-only
    routes = {
        "torch_npu.x": torch_npu.npu_moe_token_unpermute,
        "torch.ops.npu.x": torch.ops.npu.npu_moe_token_unpermute,
        "mindspeed module function": ms_mod.npu_moe_token_unpermute,
        "from-import before the patch": imported_before,
        "module imported after the patch": octest_user.run,
        "torch_npu in a later module": octest_user.run_npu,
    }
    with opcontracts.mode("strict"):
        for name, fn in routes.items():
            fn(*good)
            fn(*good)  # answered by the signature memo: it must not hide what follows
            with pytest.raises(ContractViolation, match="probs") as ei:
                fn(*bad)
            assert ei.value.arg == "probs", name
    assert torch_npu.npu_moe_token_unpermute.__opcontracts_memo__[3]


def test_dispatch_mode_catches_a_captured_npu_overload(emulated_patch):
    from opcontracts.dispatch import ContractDispatchMode

    captured = torch.ops.npu.npu_moe_token_unpermute.default  # bypasses every Python name
    bad = _unpermute_args(torch.float32)
    opcontracts.set_targets(cann="8.0.RC3")  # where fp32 probs are wrong whatever the chip
    with opcontracts.mode("strict"):
        captured(*bad)  # silently computes garbage: nothing checks it
        with ContractDispatchMode(), pytest.raises(ContractViolation, match="probs"):
            captured(*bad)


def test_unpatch_restores_the_emulated_ops_identically(emulated_patch):
    import torch_npu
    from mindspeed.ops import npu_moe_token_unpermute as ms_mod

    patch.unpatch()
    originals = (torch_npu.npu_moe_token_unpermute, torch.ops.npu.npu_moe_token_unpermute,
                 ms_mod.npu_moe_token_unpermute)
    for _ in range(3):
        patch.apply()
        # the packet is guarded in place; MindSpeed's Python function is replaced
        assert torch_npu.npu_moe_token_unpermute is originals[0]
        assert type(originals[0]).__name__ == "GuardedPacket"
        assert ms_mod.npu_moe_token_unpermute is not originals[2]
        patch.unpatch()
        assert type(originals[0]) is torch._ops.OpOverloadPacket
    assert (torch_npu.npu_moe_token_unpermute, torch.ops.npu.npu_moe_token_unpermute,
            ms_mod.npu_moe_token_unpermute) == originals
    assert torch_npu.npu_moe_token_unpermute is originals[0]
    assert torch.ops.npu.npu_moe_token_unpermute is originals[1]
    assert ms_mod.npu_moe_token_unpermute is originals[2]


def test_unpatch_leaves_the_op_namespace_walkable(emulated_patch):
    # torch.export's decomposition table (built by aot_eager and inductor) walks every listed
    # op of every namespace; a packet the patch created and unpatch removed must not stay listed
    import torch_npu  # noqa: F401

    patch.unpatch()
    ns = torch.ops.npu
    # what torch's own Library._destroy keeps true: a listed op is a held packet (once the
    # emulation is uninstalled, a name listed but not held is an AttributeError in that walk)
    assert list(ns) and set(ns) <= set(vars(ns))


def test_uninstalling_the_emulation_under_the_patch_leaves_no_stale_record(clean_patch):
    from opcontracts import emulation

    if emulation.installed():
        pytest.skip("the emulation is installed for the whole session")
    patch.apply()
    emulation.install()
    try:
        import torch_npu  # noqa: F401

        assert any(r.target.startswith(("torch_npu.", "torch.ops.npu."))
                   for r in patch.patched())
    finally:
        emulation.uninstall()
    assert patch.is_applied()
    gone = ("torch_npu.", "torch.ops.npu.", "mindspeed.")
    assert [r.target for r in patch.patched() if r.target.startswith(gone)] == []
    assert set(torch.ops.npu) <= set(vars(torch.ops.npu))
