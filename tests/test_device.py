"""The emulated ``npu`` device (``emulation.install(device=True)``): tensors, modules, the fused
ops on it, backward on the engine's worker thread, ``mode()`` reaching that thread."""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts import emulation


@pytest.fixture
def device() -> Iterator[Any]:
    """The emulation with the npu device and the patch, all put back afterwards."""
    import opcontracts.patch as patch

    was = patch.is_applied()
    patch.unpatch()
    emulation.install("narrow", device=True)
    patch.apply()
    import torch_npu

    try:
        yield torch_npu
    finally:
        patch.unpatch()
        emulation.uninstall()
        if was:
            patch.apply()


def test_tensors_live_on_npu_and_share_memory(device: Any) -> None:
    x = torch.randn(4, 8, device="npu")
    assert x.device == torch.device("npu", 0) and x.is_npu and type(x) is torch.Tensor
    host = torch.arange(6.0).reshape(2, 3)
    y = host.npu()
    assert y.device.type == "npu" and torch.equal(y.cpu(), host)
    view = y[1:]                      # a view shares the device memory
    view.mul_(0)
    assert torch.equal(y.cpu(), torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]))
    assert torch.arange(5, device="npu").cpu().tolist() == [0, 1, 2, 3, 4]  # out= resized
    assert x.to(torch.bfloat16).device.type == "npu" and x.to("cpu").device.type == "cpu"
    assert x.sum().item() == pytest.approx(x.cpu().sum().item())


def test_torch_npu_basics(device: Any) -> None:
    assert torch.npu.is_available() and torch.npu.device_count() == 1
    assert device.npu is torch.npu and sys.modules["torch_npu.npu"] is torch.npu
    torch.npu.set_device(0)
    assert torch.npu.current_device() == 0
    torch.npu.synchronize()
    assert torch.npu.get_device_name() == emulation.DEFAULT_SOC == "Ascend910B3"
    with pytest.raises(RuntimeError, match="error code is 107001 \\(invalid device id 1"):
        torch.npu.set_device(1)


def test_module_npu_trains_with_backward_on_the_worker_thread(device: Any) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 3)
    ref = torch.nn.Linear(8, 3)
    ref.load_state_dict(lin.state_dict())
    lin.npu()
    assert lin.weight.device.type == "npu" and isinstance(lin.weight, torch.nn.Parameter)
    x = torch.randn(5, 8)
    out = lin(x.npu())
    threads: list[int] = []
    out.register_hook(lambda g: threads.append(threading.get_ident()))
    out.square().sum().backward()
    ref(x).square().sum().backward()
    assert threads and threads[0] != threading.get_ident()  # as on an NPU: not the caller's
    assert lin.weight.grad is not None and lin.weight.grad.device.type == "npu"
    torch.testing.assert_close(lin.weight.grad.cpu(), ref.weight.grad)
    torch.optim.SGD(lin.parameters(), lr=0.1).step()  # foreach kernels through the fallback
    assert lin.weight.device.type == "npu"


def test_fused_ops_take_and_return_npu_tensors(device: Any) -> None:
    torch_npu = device
    torch.manual_seed(0)
    tokens = torch.randn(6, 8, dtype=torch.bfloat16)
    indices = torch.randint(0, 4, (6, 2))
    probs = torch.rand(6, 2).to(torch.bfloat16)

    def step(dev: str) -> tuple[torch.Tensor, ...]:
        t = tokens.to(dev).requires_grad_()
        p = probs.to(dev).requires_grad_()
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(t, indices.to(dev))
        out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, p)
        assert out.device.type == dev and permuted.device.type == dev
        out.float().sum().backward()
        assert t.grad is not None and p.grad is not None
        return out.cpu(), t.grad.cpu(), p.grad.cpu()

    for on_npu, on_cpu in zip(step("npu"), step("cpu"), strict=True):
        assert torch.equal(on_npu, on_cpu)


class _LinearWithGradAccumulation(torch.autograd.Function):
    """Megatron's linear with gradient-accumulation fusion, as MindSpeed runs it: the weight
    gradient goes into ``weight.main_grad`` through ``npu_matmul_add_fp32`` in the Python
    backward (on the device's worker thread)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        from mindspeed.ops.npu_matmul_add import npu_matmul_add_fp32

        x, weight = ctx.saved_tensors
        _LinearWithGradAccumulation.threads.append(threading.get_ident())
        npu_matmul_add_fp32(x, grad_output, weight.main_grad)
        return grad_output @ weight, None

    threads: list[int] = []


def _accumulating_step(main_grad_dtype: torch.dtype) -> torch.Tensor:
    weight = torch.randn(4, 8, dtype=torch.bfloat16).npu()
    weight.main_grad = torch.zeros(4, 8, dtype=main_grad_dtype).npu()  # type: ignore[attr-defined]
    x = torch.randn(3, 8, dtype=torch.bfloat16).npu().requires_grad_()
    return _LinearWithGradAccumulation.apply(x, weight).float().sum()  # type: ignore[no-any-return]


def test_strict_around_backward_reaches_the_worker_thread(device: Any) -> None:
    _LinearWithGradAccumulation.threads.clear()
    loss = _accumulating_step(torch.bfloat16)  # a bf16 main_grad: the fp32 kernel garbles it
    with opcontracts.mode("strict"), pytest.raises(opcontracts.ContractViolation,
                                                  match="npu_matmul_add_fp32"):
        loss.backward()
    assert _LinearWithGradAccumulation.threads[0] != threading.get_ident()


def test_off_around_backward_reaches_the_worker_thread(device: Any) -> None:
    opcontracts.set_mode("strict")
    loss = _accumulating_step(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opcontracts.mode("off"):
            loss.backward()  # no check on the worker thread either


def test_the_process_wide_mode_still_applies_on_the_worker_thread(device: Any) -> None:
    opcontracts.set_mode("strict")
    with pytest.raises(opcontracts.ContractViolation):
        _accumulating_step(torch.bfloat16).backward()
    _accumulating_step(torch.float32).backward()  # conforming: no error


def test_no_mode_context_costs_nothing() -> None:
    from opcontracts._lang import modes

    assert modes._global_state is modes._process_state
    with opcontracts.mode("strict"):
        assert modes._global_state is modes._LAUNCHER  # contextless threads ask the engine
        assert opcontracts.get_mode() == "strict"
    assert modes._global_state is modes._process_state


def test_install_is_idempotent_and_uninstall_removes_the_device() -> None:
    emulation.install(device=True)
    try:
        emulation.install(device="Ascend910_9382")  # again: only the SoC it reports changes
        assert torch.npu.get_device_name() == "Ascend910_9382"
        assert torch.randn(2, device="npu").device.type == "npu"
    finally:
        emulation.uninstall()
    assert not torch.npu.is_available() and torch.npu.device_count() == 0
    assert "torch_npu.npu" not in sys.modules
    with pytest.raises(NotImplementedError, match="npu"):
        torch.empty(2, device="npu")
    emulation.install(device=True)  # back again in the same process
    try:
        assert torch.ones(2, device="npu").cpu().tolist() == [1.0, 1.0]
    finally:
        emulation.uninstall()


class _UnpermuteInBackward(torch.autograd.Function):
    """A backward that calls a captured ``.default`` overload (no Python attribute a patch could
    guard), as C++ autograd nodes call their kernels; fp64 probs, which no release or CANN
    accepts (fp32 is a conditional verdict while CANN is unknown)."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor) -> torch.Tensor:
        return tokens * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        indices = torch.zeros(grad.shape[0], 1, dtype=torch.int64, device=grad.device)
        permuted, sorted_indices = torch.ops.npu.npu_moe_token_permute.default(grad, indices)
        probs = torch.ones(grad.shape[0], 1, dtype=torch.float64, device=grad.device)
        torch.ops.npu.npu_moe_token_unpermute.default(permuted, sorted_indices, probs)
        return grad


def test_dispatch_mode_in_backward_follows_the_callers_mode(device: Any) -> None:
    from opcontracts.dispatch import ContractDispatchMode

    tokens = torch.randn(4, 8, dtype=torch.bfloat16).npu().requires_grad_()
    loss = _UnpermuteInBackward.apply(tokens).float().sum()
    with ContractDispatchMode(), opcontracts.mode("strict"), \
            pytest.raises(opcontracts.ContractViolation, match="probs"):
        loss.backward()


def test_on_the_213_device_backward_dispatches_the_release_ops_on_the_worker_thread(
        device: Any) -> None:
    """What a dispatch mode below autograd sees on torch_npu 2.13's structure, on the device:
    the internal forward op, the v2 grad op, the latter on the engine's worker thread."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[str, int]] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func.namespace == "npu":
                seen.append((func._opname, threading.get_ident()))
            return func(*args, **(kwargs or {}))

    tokens = torch.randn(6, 8, dtype=torch.bfloat16).npu().requires_grad_()
    permuted, sorted_indices = device.npu_moe_token_permute(tokens, torch.randint(0, 4, (6, 2)).npu())
    probs = torch.rand(6, 2).to(torch.bfloat16).npu()
    with Log():
        device.npu_moe_token_unpermute(permuted, sorted_indices, probs).float().sum().backward()
    names = [name for name, _ in seen]
    assert names[0] == "_npu_moe_token_unpermute"
    assert "npu_moe_token_unpermute_grad_v2" in names and "npu_moe_token_permute_grad_v2" in names
    assert {tid for name, tid in seen if name.endswith("_grad_v2")} != {threading.get_ident()}


def test_switching_the_release_keeps_the_device() -> None:
    emulation.install(device="Ascend910B4")
    try:
        emulation.install(version="2.12.0")  # the ops registered anew for another release
        assert torch.npu.get_device_name() == "Ascend910B4"
        import torch_npu

        x = torch.randn(4, 16, dtype=torch.bfloat16, device="npu")
        assert torch_npu.npu_swiglu(x).device.type == "npu"  # the new ops' kernels for npu
    finally:
        emulation.uninstall()
