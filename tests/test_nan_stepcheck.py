"""The always-on NaN sentinel's step check (``opcontracts._observers.stepcheck``) over
gradients on several devices of the emulated npu device: one multi-tensor reduction per device,
one host read, and the non-finite gradient named (a test module of its own: the emulation it
installs and removes would remove the one a module-scoped fixture of another module holds)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts.nan import NanSentinel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _host_reads import HostReads  # noqa: E402


def test_gradients_on_two_devices_are_judged_in_one_read_and_named_in_their_own_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters on npu:0 and npu:1, interleaved: one reduction per device, one read, and the
    non-finite gradient is the one named (not its neighbour on the other device)."""
    from opcontracts import emulation
    from opcontracts.emulation import _device

    monkeypatch.setenv(_device.DEVICES_ENV, "2")
    emulation.install("narrow", device=True)
    try:
        ws = [torch.nn.Parameter(torch.ones(n + 1, device=f"npu:{n % 2}")) for n in range(3)]
        opt = torch.optim.SGD(ws, lr=1.0)
        with NanSentinel(always_on=True, on_nan="record") as s:
            for w in ws:
                w.grad = torch.ones_like(w)
            ws[1].grad = torch.full_like(ws[1], float("nan"))  # on npu:1, between two npu:0
            with HostReads() as reads:
                opt.step()
        assert reads.total == 2  # the norms, then the culprit confirmed (a bad step only)
        (f,) = s.findings
        assert f.nonfinite == ["gradient of parameter #1 (float32, 2)"]
        assert all(torch.equal(w.detach().cpu(), torch.ones(len(w))) for w in ws)  # skipped
    finally:
        emulation.uninstall()
        opcontracts.set_versions(cann=None)


def test_a_dtensor_gradient_is_judged_by_its_local_shard() -> None:
    """FSDP2's gradients are ``DTensor``s: the check reduces each one's local shard (a
    one-rank gloo group here), names it, and skips the step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = torch.nn.Parameter(torch.ones(2))
        sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
        opt = torch.optim.SGD([plain, sharded], lr=1.0)
        with NanSentinel(always_on=True, on_nan="record") as s:
            plain.grad = torch.ones(2)
            sharded.grad = distribute_tensor(torch.tensor([1.0, float("-inf"), 1.0, 1.0]),
                                             mesh, [Shard(0)])
            with HostReads() as reads:
                opt.step()
        assert reads.total == 2  # the norms, then the culprit confirmed (a bad step only)
        (f,) = s.findings
        assert f.nonfinite == ["gradient of parameter #1 (float32, 4)"]
        assert torch.equal(sharded.detach().to_local(), torch.ones(4))  # skipped
        assert torch.equal(plain.detach(), torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_gradients_of_several_param_groups_are_named_apart() -> None:
    """Two parameter groups (a Trainer's: with and without weight decay): the non-finite
    gradient is named by its index over the optimizer's parameters and its place in its group,
    so two gradients never share a name; a parameter without a gradient still counts."""
    a, b, c, d = (torch.nn.Parameter(torch.ones(n + 1)) for n in range(4))
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c, d], "weight_decay": 0.0}], lr=1.0)
    with NanSentinel(always_on=True, on_nan="record") as s:
        a.grad = torch.ones_like(a)           # b has no gradient
        c.grad = torch.ones_like(c)
        d.grad = torch.full_like(d, float("nan"))
        opt.step()
    (f,) = s.findings
    assert f.nonfinite == ["gradient of parameter #3, #1 of param group 1 (float32, 4)"]
    assert torch.equal(d.detach(), torch.ones(4))  # the step was skipped


def _grads(spec: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    return [torch.full((n,), 0.5, dtype=dt) for n, dt in spec]


# small (flattened together), float16 (summed in float32), large (summed alone)
_SPEC = [(3, torch.bfloat16), (7, torch.float16), (40, torch.float32), (5, torch.bfloat16),
         (64, torch.float16)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", range(len(_SPEC)))
@pytest.mark.parametrize("layout", ["one buffer", "buffers and large alone"])
def test_the_cpu_reduction_finds_any_non_finite_value_wherever_it_is(
        bad: float, where: int, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's reduction (small gradients flattened into bounded buffers, large ones summed
    alone) is non-finite exactly when one value is: a -inf among finite values too (which a
    maximum would miss), in any dtype, in every place of the flattening."""
    from opcontracts._observers import stepcheck

    if layout != "one buffer":  # 40 and 64 elements are "large"; buffers of 8 elements
        monkeypatch.setattr(stepcheck, "_SMALL", 32)
        monkeypatch.setattr(stepcheck, "_FLAT", 8)
    gs = _grads(_SPEC)
    assert all(map(math.isfinite, stepcheck.screen(gs)[0]))
    gs[where][-1] = bad
    assert not math.isfinite(sum(stepcheck.screen(gs)[0]))


def test_the_cpu_reduction_copies_at_most_one_bounded_buffer_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No flat buffer is larger than ``_FLAT`` elements plus one small gradient, and a gradient
    larger than ``_SMALL`` is never copied: the memory the check takes is bounded, whatever the
    model's size."""
    from opcontracts._observers import stepcheck

    monkeypatch.setattr(stepcheck, "_SMALL", 32)
    monkeypatch.setattr(stepcheck, "_FLAT", 64)
    sizes: list[int] = []
    real = stepcheck._flatten

    def flatten(ts: list[torch.Tensor]) -> torch.Tensor:
        sizes.append(sum(t.numel() for t in ts))
        return real(ts)

    monkeypatch.setattr(stepcheck, "_flatten", flatten)
    gs = _grads([(30, torch.float32)] * 10 + [(1000, torch.float32)] * 2)
    # two large alone; the small, 30 elements each, in buffers of 90, 90, 90 and 30
    assert len(stepcheck.screen(gs)[0]) == 2 + 4
    assert sizes == [90, 90, 90, 30]


def test_float16_gradients_whose_sum_overflows_float16_are_finite_in_one_read() -> None:
    """Gradients of a float16 model (scaled by AMP's GradScaler, they are large) whose sum
    exceeds float16's range (65504): summed in float32, the step is finite at one read, with
    no confirmation pass."""
    w = torch.nn.Parameter(torch.ones(256, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.0)
    with NanSentinel(always_on=True, on_nan="record") as s:
        w.grad = torch.full((256,), 30000.0, dtype=torch.float16)  # sums to 7.7e6
        with HostReads() as reads:
            opt.step()
    assert reads.total == 1 and s.findings == [] and s.result().bad_steps == []


def test_the_check_writes_to_no_gradient() -> None:
    """The reduction reads the gradients and writes none of them: values, storage and version
    counters (an in-place write would bump them) are as the backward pass left them."""
    ws = [torch.nn.Parameter(torch.ones(n)) for n in (3, 50_000, 7)]
    opt = torch.optim.SGD(ws, lr=0.0)
    grads = [torch.randn(w.shape, dtype=torch.float32) for w in ws]
    before = [(g.clone(), g.data_ptr(), g._version) for g in grads]
    with NanSentinel(always_on=True, on_nan="record"):
        for w, g in zip(ws, grads):
            w.grad = g
        opt.step()
    for g, (values, ptr, version) in zip(grads, before):
        assert torch.equal(g, values) and g.data_ptr() == ptr and g._version == version


def test_each_device_gets_its_own_reduction() -> None:
    """On the CPU the check flattens and sums (torch runs a foreach op there as one kernel
    call per tensor); on an accelerator (the emulated npu) it runs ``_foreach_norm``, one
    multi-tensor kernel with no copy: the ops each one dispatches, views left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from opcontracts import emulation
    from opcontracts._observers import stepcheck

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if not func.is_view:
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gs = _grads([(3, torch.float32), (5, torch.float32)])
    with Ops() as cpu:
        stepcheck._reduce(gs)
    assert cpu.names == ["flatten_dense_tensors", "sum"]  # (one cat below autograd)
    emulation.install("narrow", device=True)
    try:
        npu = [g.to("npu") for g in gs]
        with Ops() as dev:
            stepcheck._reduce(npu)
        assert dev.names[0] == "_foreach_norm" and dev.names[-1] == "stack", dev.names
    finally:
        emulation.uninstall()
        opcontracts.set_versions(cann=None)
