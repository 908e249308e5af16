"""The always-on NaN sentinel's step check (``opcontracts._observers.stepcheck``) over
gradients on several devices of the emulated npu device: one multi-tensor reduction per device,
one host read, and the non-finite gradient named (a test module of its own: the emulation it
installs and removes would remove the one a module-scoped fixture of another module holds)."""

from __future__ import annotations

import sys
from pathlib import Path

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
