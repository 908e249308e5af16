"""The patch guards ``torch.ops`` packets in place (issue 22): ``torch.ops.npu.X`` stays the
same ``OpOverloadPacket``, so what torch_npu and torch do with a packet after the patch still
works (``register_lowering``, ``register_fake``, ``torch_npu.X is torch.ops.npu.X``), calling
it is checked in eager and under ``torch.compile``, and ``unpatch`` gives the class back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import opcontracts
import opcontracts.patch as patch
from opcontracts import Arg, Contract, ContractViolation
from opcontracts._attach import packets
from opcontracts.record import Recorder

ROOT = Path(__file__).resolve().parents[1]
Packet = torch._ops.OpOverloadPacket


def _unpermute_args(probs_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randn(8, 4).to(torch.bfloat16)
    return tokens, torch.randperm(8).to(torch.int32), torch.rand(4, 2).to(probs_dtype)


def _guarded_npu_packets() -> list[str]:
    # one record per packet, named by the first of its targets found (torch_npu.X or
    # torch.ops.npu.X: the same object)
    return [r.target.rsplit(".", 1)[1] for r in patch.patched()
            if r.kind == "packet" and r.target.startswith(("torch_npu.", "torch.ops.npu."))]


def test_every_guarded_npu_packet_stays_the_packet_torch_npu_binds(npu: Any) -> None:
    names = _guarded_npu_packets()
    assert len(names) == len(set(names)) > 20  # the shipped contracts target most emulated ops through torch.ops
    for name in names:
        packet = getattr(torch.ops.npu, name)
        assert type(packet) is packets.GuardedPacket and isinstance(packet, Packet), name
        assert getattr(npu, name, packet) is packet, name  # no alias to rebind: the same object
        assert packet.__opcontracts_patched__ and packet.__opcontracts_op__, name
    kept = {name: getattr(torch.ops.npu, name) for name in names}
    patch.unpatch()
    for name, packet in kept.items():
        assert getattr(torch.ops.npu, name) is packet and type(packet) is Packet, name
        assert "_oc_guard" not in packet.__dict__ and "__signature__" not in packet.__dict__
    patch.apply()
    assert set(_guarded_npu_packets()) == set(names)


def test_strict_warn_and_fix_through_either_name(npu: Any) -> None:
    opcontracts.set_versions(cann="8.0.RC3")  # the bf16-only kernel (CANN decides: issue 23)
    for call in (npu.npu_moe_token_unpermute, torch.ops.npu.npu_moe_token_unpermute):
        with opcontracts.mode("strict"), pytest.raises(ContractViolation, match="probs"):
            call(*_unpermute_args(torch.float32))
        with opcontracts.mode("warn"), pytest.warns(opcontracts.ContractWarning, match="probs"):
            call(*_unpermute_args(torch.float32))
        with opcontracts.mode("fix"), pytest.warns(opcontracts.ContractFixWarning):
            fixed = call(*_unpermute_args(torch.float32))
        with opcontracts.mode("strict"):
            good = call(*_unpermute_args(torch.bfloat16))
        assert fixed.shape == good.shape == (4, 4)


def test_a_captured_overload_is_the_packets_own(npu: Any) -> None:
    packet = torch.ops.npu.npu_moe_token_unpermute
    assert packet.default is packet.__wrapped__.default  # the guard's shadow shares it
    assert "default" in packet.overloads()


def test_register_lowering_after_the_patch_matches_the_op(npu: Any) -> None:
    # torch_npu's inductor registers this lowering on first use, after `import opcontracts.patch`
    from torch._inductor.lowering import lowerings, register_lowering

    packet = torch.ops.npu.npu_grouped_matmul
    assert type(packet) is packets.GuardedPacket
    before = {k: lowerings.get(k) for k in (packet.default, packet)}
    try:
        register_lowering(packet)(lambda *a, **k: None)
        # a packet's lowering is keyed on its overloads too, which is what inductor looks up
        # (a guard function in the packet's place was the only key: the lowering never matched)
        assert lowerings[packet.default] is lowerings[packet]
    finally:
        for k, v in before.items():
            if v is None:
                lowerings.pop(k, None)
            else:  # pragma: no cover - nothing registers one on CPU
                lowerings[k] = v


@pytest.fixture
def own_op() -> Iterator[Any]:
    lib = torch.library.Library("ocpk", "DEF")
    lib.define("f(Tensor x) -> Tensor")
    lib.impl("f", lambda x: x * 2, "CompositeExplicitAutograd")
    was = patch.is_applied()
    patch.unpatch()
    patch.apply([Contract("ocpk.f", {"x": Arg("bf16", "N")}, targets=["torch.ops.ocpk.f"],
                          source="test")])
    try:
        yield torch.ops.ocpk.f
    finally:
        patch.unpatch()
        lib._destroy()
        torch._dynamo.reset()
        if was:
            patch.apply()


def test_register_fake_after_the_patch_and_fullgraph_compile(own_op: Any) -> None:
    assert type(own_op) is packets.GuardedPacket
    torch.library.register_fake("ocpk::f")(lambda x: torch.empty_like(x))

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ocpk.f(x) + 1

    good = torch.ones(4, dtype=torch.bfloat16)
    explained = torch._dynamo.explain(fn)(good)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(good), good * 2 + 1)
    with opcontracts.mode("strict"), pytest.raises(Exception, match="expected bfloat16"):
        compiled(torch.ones(4))  # the guard is traced: the recompile for fp32 checks it


def test_an_observer_wraps_the_guard_not_the_packet(npu: Any) -> None:
    packet = torch.ops.npu.npu_moe_token_unpermute
    guard = packet.__dict__["_oc_guard"]
    with Recorder() as rec:
        assert torch.ops.npu.npu_moe_token_unpermute is packet  # still the packet
        assert packet.__dict__["_oc_guard"] is not guard  # the observer's wrapper in front
        packet(*_unpermute_args(torch.bfloat16))
    assert packet.__dict__["_oc_guard"] is guard
    assert rec.calls().get("npu_moe_token_unpermute") == 1


def test_dynamo_imported_after_the_patch_learns_the_packet() -> None:
    # `import torch` does not load dynamo; the patch's import hook registers the packet when
    # it is, so the first torch.compile traces the guard
    code = textwrap.dedent("""
        import sys, torch
        import opcontracts, opcontracts.patch as patch
        from opcontracts import Arg, Contract
        lib = torch.library.Library("ocpk2", "DEF")
        lib.define("f(Tensor x) -> Tensor")
        lib.impl("f", lambda x: x * 2, "CompositeExplicitAutograd")
        patch.apply([Contract("ocpk2.f", {"x": Arg("bf16", "N")},
                              targets=["torch.ops.ocpk2.f"], source="test")])
        assert "torch._dynamo" not in sys.modules, "dynamo already loaded"
        opcontracts.set_mode("strict")
        f = torch.compile(lambda x: torch.ops.ocpk2.f(x) + 1, backend="eager", fullgraph=True)
        try:
            f(torch.ones(3))
        except Exception as exc:
            print("raised", type(exc).__name__, "expected bfloat16" in str(exc))
        else:
            print("compiled unchecked")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "True", p.stdout + p.stderr


def test_torch_npu_onnx_rebinding_a_name_after_the_patch_is_still_checked(npu: Any) -> None:
    # `import torch_npu.onnx` rebinds 8 torch_npu names (npu_rms_norm among them) to Python
    # autograd.Function wrappers calling torch.ops.npu.X: the guarded packet checks their calls,
    # and unpatch leaves torch_npu's own rebinding alone (it used to set the packet back)
    class _NPURmsNormOP(torch.autograd.Function):  # the shape of torch_npu/onnx's wrappers
        @staticmethod
        def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            return torch.ops.npu.npu_rms_norm(*args, **kwargs)

    def wrapper(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> Any:
        return _NPURmsNormOP.apply(x, gamma, epsilon)

    packet = npu.npu_rms_norm
    npu.npu_rms_norm = wrapper
    try:
        x = torch.randn(2, 8).bfloat16()
        with opcontracts.mode("strict"):
            npu.npu_rms_norm(x, torch.ones(8).bfloat16())
            with pytest.raises(ContractViolation, match="gamma"):
                npu.npu_rms_norm(x, torch.ones(8, dtype=torch.int32))
        patch.unpatch()
        assert npu.npu_rms_norm is wrapper and type(packet) is Packet
    finally:
        npu.npu_rms_norm = packet


# --------------------------------------------------------------------------- torch.ops.atb
@pytest.fixture
def late_atb_library(atb_plugin_loaded: Any) -> Iterator[list[Any]]:
    """``torch.ops.load_library`` stood in for by what loading torch_npu's ATB plugin
    (libop_plugin_atb.so) does: define ops in the ``atb`` namespace (here, one fake op)."""
    schema = "_oc_reshape_and_cache(Tensor key, Tensor(a!) key_cache, Tensor slot_indices) -> ()"
    with atb_plugin_loaded(schema, lambda key, key_cache, slot_indices: None) as libs:
        yield libs


def test_atb_ops_loaded_after_the_patch_are_guarded_in_place(late_atb_library: list[Any]
                                                             ) -> None:
    """dlinfer loads the ATB plugin with torch.ops.load_library after torch_npu: no import
    announces the atb ops, so the patch retries its pending atb targets after each load."""
    target = "torch.ops.atb._oc_reshape_and_cache"
    fake_loader = vars(torch.ops)["load_library"]
    patch.apply([Contract("atb._oc_reshape_and_cache", {"slot_indices": Arg("int32", "N")},
                          targets=[target], source="test")])
    assert target in patch.pending()
    torch.ops.load_library("libop_plugin_atb.so")
    op = torch.ops.atb._oc_reshape_and_cache
    assert type(op) is packets.GuardedPacket and target not in patch.pending()
    # the watch stays while an atb target is pending (a shipped contract's, when the registry
    # holds them) and goes with the last one
    atb_pending = any(t.startswith("torch.ops.atb.") for t in patch.pending())
    assert (vars(torch.ops)["load_library"] is fake_loader) is not atb_pending
    key, cache = torch.ones(2, 4), torch.zeros(8, 4)
    op(key, cache, torch.tensor([0, 3], dtype=torch.int32))
    with opcontracts.mode("strict"), pytest.raises(ContractViolation, match="slot_indices"):
        op(key, cache, torch.tensor([0, 3]))  # int64 slots
    patch.unpatch()
    assert type(op) is Packet


def test_a_pending_atb_target_is_reported_and_unpatch_removes_the_watch(
        late_atb_library: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_loader = vars(torch.ops)["load_library"]
    monkeypatch.setitem(sys.modules, "torch_npu", sys.modules.get("torch_npu")
                        or type(sys)("torch_npu"))  # torch_npu imported, the plugin not loaded
    target = "torch.ops.atb._oc_not_loaded"
    patch.apply([Contract("atb._oc_not_loaded", {"x": Arg("bf16", "N")}, targets=[target],
                          source="test")])
    assert target in patch.pending()
    assert "libop_plugin_atb.so" in patch.missing()[target]  # says what would register it
    assert vars(torch.ops)["load_library"] is not fake_loader  # watched while pending
    patch.unpatch()
    assert vars(torch.ops)["load_library"] is fake_loader
