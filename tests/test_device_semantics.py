"""The emulated ``npu`` device behaves as an NPU where training code relies on it: modules keep
their Parameters when moved, autocast, activation checkpointing (both modes, never an abort),
Python numbers in ops, ops whose CPU kernel lacks the dtype, and several devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from opcontracts.emulation import _cpu_gaps, _device
from opcontracts.errors import SettingError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def npu(npu_device: Any) -> Any:
    """conftest's ``npu_device``: the emulation with its device, no patch."""
    return npu_device


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh process with the emulated device installed (an abort is caught)."""
    script = "from opcontracts import emulation\nemulation.install('narrow', device=True)\n" \
        + textwrap.dedent(code)
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=full, timeout=300)


# -- parameters keep their identity -------------------------------------------------------------

def test_module_to_npu_keeps_the_parameters_an_optimizer_holds(npu: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    weight = model.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)   # built before the move, as accelerate
    model.to("npu")
    assert model.weight is weight and weight.device.type == "npu"
    before = weight.detach().cpu().clone()
    model(torch.randn(3, 4, device="npu")).sum().backward()
    opt.step()
    assert not torch.equal(weight.detach().cpu(), before)  # the live parameter moved
    model.npu().cpu()
    assert model.weight is weight and weight.device.type == "cpu"


def test_param_data_takes_an_npu_tensor(npu: Any) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.data = torch.ones(3, device="npu")
    assert p.device.type == "npu" and p.cpu().tolist() == [1.0, 1.0, 1.0]


# -- autocast -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_npu_runs_matmuls_in_the_autocast_dtype(npu: Any, dtype: torch.dtype) -> None:
    lin = torch.nn.Linear(8, 4).npu()
    x = torch.randn(2, 8, device="npu")
    with torch.autocast("npu", dtype=dtype):
        y = lin(x)
        assert y.dtype == dtype and torch.mm(x, x.T).dtype == dtype
        assert torch.softmax(y, -1).dtype == torch.float32           # needs range: float32
        loss = torch.nn.functional.cross_entropy(y, torch.tensor([0, 1], device="npu"))
        assert loss.dtype == torch.float32
    loss.backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32
    assert lin(x).dtype == torch.float32                              # off outside the region


def test_torch_npu_amp_has_its_submodules(npu: Any) -> None:
    """torch_npu/npu/amp's autocast_mode and grad_scaler: torch's dynamo reads
    ``torch.cuda.amp.autocast_mode.autocast``, which transfer_to_npu makes torch.npu's."""
    amp = torch.npu.amp  # type: ignore[attr-defined]
    assert amp.autocast_mode.autocast is amp.autocast
    assert amp.autocast_mode.custom_fwd is amp.custom_fwd
    assert amp.grad_scaler.GradScaler is amp.GradScaler


def test_torch_npu_amp_as_torch_npu_provides(npu: Any) -> None:
    assert torch.npu.get_amp_supported_dtype() == [torch.float16, torch.bfloat16]
    assert torch.npu.is_bf16_supported()
    from torch_npu.npu.amp import GradScaler, autocast

    lin = torch.nn.Linear(4, 4).npu()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=128.0)
    with autocast():
        out = lin(torch.randn(2, 4, device="npu"))
    assert out.dtype == torch.float16                                 # torch_npu's default
    before = lin.weight.detach().cpu().clone()
    scaler.scale(out.float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(lin.weight.detach().cpu(), before)
    assert scaler.get_scale() == 128.0 * 2 ** 0  # no overflow, growth after 2000 steps only


def test_autocast_refuses_binary_cross_entropy_as_unsafe(npu: Any) -> None:
    p = torch.rand(3, device="npu")
    with torch.autocast("npu", dtype=torch.bfloat16), \
            pytest.raises(RuntimeError, match="unsafe to autocast"):
        torch.nn.functional.binary_cross_entropy(p, p)


# -- activation checkpointing, never an abort ----------------------------------------------------

_CHECKPOINT = """
import torch
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
lin = torch.nn.Linear(4, 4).npu()
x = torch.randn(3, 4, device="npu", requires_grad=True)
with torch.autocast("npu", dtype=torch.bfloat16):
    y = checkpoint(lambda t: torch.relu(lin(t)), x, use_reentrant={reentrant})
y.float().sum().backward()
ref = x.detach().clone().requires_grad_()
with torch.autocast("npu", dtype=torch.bfloat16):
    torch.relu(lin(ref)).float().sum().backward()
assert torch.equal(x.grad.cpu(), ref.grad.cpu()), (x.grad, ref.grad)
print("ok")
"""


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_in_both_modes_under_autocast(reentrant: bool) -> None:
    done = _run(_CHECKPOINT.format(reentrant=reentrant))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_an_exception_in_a_backward_hook_reaches_the_caller_without_an_abort() -> None:
    done = _run("""
        import torch
        x = torch.randn(3, device="npu", requires_grad=True)
        def unpack(t):
            raise ValueError("raised in the unpack hook")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = (x * x).sum()
        try:
            y.backward()
        except ValueError as exc:
            print("caught:", exc)
        z = x * 2
        z.register_hook(lambda g: 1 / 0)
        try:
            z.sum().backward()
        except ZeroDivisionError:
            print("caught: tensor hook")
        (x * x).sum().backward()          # the engine still works
        print("alive", x.grad is not None)
        """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["caught: raised in the unpack hook",
                                           "caught: tensor hook", "alive True"]


def test_a_checkpointed_recompute_that_raises_in_backward_raises_there(npu: Any) -> None:
    calls = []

    def block(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            raise KeyError("recompute failed")
        return torch.sin(t)           # saves its input: backward recomputes the block

    x = torch.randn(3, device="npu", requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    with pytest.raises(KeyError, match="recompute failed"):
        y.sum().backward()


# -- Python numbers and dtypes the CPU lacks ------------------------------------------------------

def test_python_numbers_in_ops_on_npu_tensors(npu: Any) -> None:
    t = torch.tensor([0x1F, 0xF3], dtype=torch.int32, device="npu")
    assert (t & 0xF0).cpu().tolist() == [0x10, 0xF0] and (t & 0xF0).dtype == torch.int32
    assert (t | 1).cpu().tolist() == [0x1F, 0xF3] and (t ^ 1).cpu().tolist() == [0x1E, 0xF2]
    half = torch.ones(2, dtype=torch.bfloat16, device="npu")
    assert (half * 2.5).dtype == torch.bfloat16                       # a number does not promote
    assert torch.where(t > 0x20, t, 0).cpu().tolist() == [0, 0xF3]


def test_histc_on_an_int_tensor_computes_and_keeps_the_dtype(npu: Any) -> None:
    t = torch.tensor([0, 1, 1, 3, 7, 7, 7], dtype=torch.int32, device="npu")
    hist = torch.histc(t, bins=4, min=0, max=7)
    assert hist.device.type == "npu" and hist.dtype == torch.int32
    assert hist.cpu().tolist() == [3, 1, 0, 3]
    assert "aten.histc.default" in _cpu_gaps.retried()
    with pytest.raises(NotImplementedError):                          # the CPU itself: unchanged
        torch.histc(t.cpu(), bins=4, min=0, max=7)


def test_an_unrelated_kernel_error_is_not_retried(npu: Any) -> None:
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.ones(2, device="npu") + torch.ones(3, device="npu")


def test_a_data_loader_pins_memory_for_the_device(npu: Any) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(6.0).reshape(3, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=3, pin_memory=True)
    (batch,) = next(iter(loader))
    assert batch.device.type == "cpu" and batch.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_deepcopy_of_npu_tensors_and_modules_gives_npu_copies() -> None:
    # torch makes the copy's storage with torch.UntypedStorage(nbytes, device="npu"), which asks
    # the device's allocator (it killed the process: a fresh process catches that)
    done = _run("""
        import copy, torch, torch_npu
        x = torch.arange(6.0).npu()
        y = copy.deepcopy(x[1:4])
        assert y.device.type == "npu" and y.tolist() == [1.0, 2.0, 3.0]
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        y.add_(1)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]   # its own memory
        model = torch.nn.Linear(3, 2).npu()
        twin = copy.deepcopy(model)
        assert twin.weight is not model.weight and twin.weight.device.type == "npu"
        assert torch.equal(twin.weight.cpu(), model.weight.cpu())
        s = torch.UntypedStorage(8, device="npu")
        assert s.device.type == "npu" and s.nbytes() == 8
        assert torch.UntypedStorage([1, 2], device="npu").tolist() == [1, 2]
        assert torch.UntypedStorage(4).device.type == "cpu"
        print("ok")
        """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_uninstall_puts_torchs_storage_constructor_back() -> None:
    done = _run("""
        import torch
        from opcontracts import emulation
        emulation.uninstall()
        assert "__new__" not in torch.UntypedStorage.__dict__
        assert torch.UntypedStorage(4).device.type == "cpu"
        print("ok")
        """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_float16_products_accumulate_in_float32_and_round_once(npu: Any) -> None:
    # the NPU's cube unit: fp32 accumulation, one rounding per element (the CPU's own fp16 bmm
    # rounds partial sums: another result, and a slow path)
    torch.manual_seed(0)
    a, b = torch.rand(4, 8, 512).half(), torch.rand(4, 512, 8).half()
    c, m1, m2 = torch.rand(8, 8).half(), torch.rand(8, 512).half(), torch.rand(512, 8).half()
    once = {
        "bmm": (torch.bmm(a.npu(), b.npu()), torch.bmm(a.float(), b.float())),
        "mm": (m1.npu() @ m2.npu(), m1.float() @ m2.float()),
        "addmm": (torch.addmm(c.npu(), m1.npu(), m2.npu()), torch.addmm(c.float(), m1.float(), m2.float())),
        "baddbmm": (torch.baddbmm(a.npu()[:, :, :8], a.npu(), b.npu()),
                    torch.baddbmm(a[:, :, :8].float(), a.float(), b.float())),
    }
    for name, (got, wide) in once.items():
        assert got.dtype == torch.float16 and got.device.type == "npu", name
        assert torch.equal(got.cpu(), wide.half()), name
    bf = torch.rand(2, 3, 64).bfloat16()
    assert torch.equal(torch.bmm(bf.npu(), bf.npu().mT).cpu(), torch.bmm(bf, bf.mT))  # unchanged


# -- several devices -----------------------------------------------------------------------------

def test_one_device_refuses_other_indices_alike(npu: Any) -> None:
    x = torch.zeros(2)
    for make in (lambda: x.to("npu:1"), lambda: torch.empty(2, device="npu:3"),
                 lambda: torch.npu.set_device(1), lambda: x.npu(2)):
        with pytest.raises(RuntimeError, match=r"error code is 107001 \(invalid device id \d"):
            make()
    assert x.to("npu:0").device == torch.device("npu", 0)


def test_devices_env_var_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("0", "two", "-1", "65"):
        monkeypatch.setenv(_device.DEVICES_ENV, bad)
        with pytest.raises(SettingError, match="OPCONTRACTS_EMULATE_DEVICES="):
            _device.devices_setting()
    monkeypatch.setenv(_device.DEVICES_ENV, "4")
    assert _device.devices_setting() == 4


def test_several_devices_as_asked() -> None:
    done = _run("""
        import torch, torch_npu
        assert torch.npu.device_count() == 2
        a = torch.randn(3, device="npu:1", requires_grad=True)
        assert torch.zeros(2).to("npu:1").device.index == 1 and (a * 2).device.index == 1
        (a * a).sum().backward()
        assert a.grad.device.index == 1 and torch.allclose(a.grad.cpu(), 2 * a.detach().cpu())
        torch.npu.set_device(1)
        assert torch.empty(1, device="npu").device.index == 1 and torch.npu.current_device() == 1
        try:
            a + torch.ones(3, device="npu:0")
        except RuntimeError as exc:
            assert "same device" in str(exc)
        else:
            raise AssertionError("two devices in one op")
        try:
            torch.empty(1, device="npu:2")
        except RuntimeError as exc:
            assert "invalid device id 2" in str(exc) and "2 npu devices" in str(exc)
        print("ok")
        """, env={_device.DEVICES_ENV: "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_run_emulate_devices_flag(tmp_path: Path) -> None:
    from opcontracts._tools import run

    assert run.parse(["--emulate", "--devices", "3", "s.py"]).devices == 3
    assert run.parse(["--emulate", "--devices=2", "s.py"]).devices == 2
    with pytest.raises(run.UsageError, match="--devices: devices='0'"):
        run.parse(["--emulate", "--devices", "0", "s.py"])
    script = tmp_path / "count.py"
    script.write_text("import os, torch, torch_npu\n"
                      "print(torch.npu.device_count(), os.environ['OPCONTRACTS_EMULATE_DEVICES'])\n"
                      "print(torch.ones(1).to('npu:2').device)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(_device.DEVICES_ENV, None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "opcontracts", "run", "-q", *args],
                              capture_output=True, text=True, env=env, timeout=300)

    done = cli("--emulate", "--devices", "3", str(script))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["3 3", "npu:2"]
    alone = cli("--devices", "2", str(script))
    assert alone.returncode == 2 and "--devices needs --emulate" in alone.stderr
    env[_device.DEVICES_ENV] = "many"
    bad = cli("--emulate", str(script))
    assert bad.returncode == 2 and "OPCONTRACTS_EMULATE_DEVICES='many'" in bad.stderr
