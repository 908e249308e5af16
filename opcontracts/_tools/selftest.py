"""``opcontracts selftest``: does opcontracts work on this stack?  One short run for an NPU box.

What it checks, and in which order, is ``DESCRIPTION`` (``opcontracts selftest --help``
prints it: a constant, so that ``python -OO``, which drops docstrings, keeps it).

Exit status: 0 when no check failed, 1 when one did, 2 when the emulation cannot be installed.
The same checks are the real-stack lane of the test suite (``tests/test_real_stack.py``).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKS", "Result", "Stack", "add_parser", "main", "open_stack", "run_checks"]

DESCRIPTION = """\
With a real torch_npu importable the checks run on it (the NPU, real MindSpeed if importable,
torchair if importable); without one they run on opcontracts' CPU emulation with its emulated
npu device, and every line says which.  The checks, in order (the SoC first, before anything
touches the device):

soc            the SoC is detected from `torch_npu.npu.get_device_name()` and detecting it
               does not initialise the device (`torch_npu.npu.is_initialized()` unchanged)
packets        after `opcontracts.patch`: `torch_npu.X is torch.ops.npu.X` and
               `torch.ops.npu.X` is still an `OpOverloadPacket` (inductor's
               `register_lowering` and `register_fake` need one)
strict         strict mode stops float64 `probs` (wrong on every release and CANN) to
               `torch_npu.npu_moe_token_unpermute`
mindspeed      the same through `mindspeed.ops.npu_moe_token_unpermute` (skipped without
               MindSpeed)
dispatched     the `npu::` op names a forward and a backward of the unpermute really dispatch
               (a logging `TorchDispatchMode`): what contracts must name to see them
backward-mode  `with _modes.mode("strict")` around `loss.backward()` reaches a check
               made on the device's autograd worker thread
torchair       a `torch.compile` through torchair's NPU backend of a guarded call (skipped
               without torchair)

Exit status: 0 when no check failed, 1 when one did, 2 when the emulation cannot be installed.
"""

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
_OPS = ("npu_moe_token_permute", "npu_moe_token_unpermute", "npu_grouped_matmul",
        "npu_rms_norm", "npu_swiglu")


@dataclass(frozen=True)
class Result:
    name: str
    status: str   # PASS, FAIL or SKIP
    detail: str


@dataclass
class Stack:
    """What the checks run on."""

    torch_npu: Any
    real: bool      # a real torch_npu (else the emulation, device included)
    installed: bool  # this run installed the emulation (and removes it afterwards)
    patched: bool = False  # this run applied opcontracts.patch (and removes it afterwards)

    @property
    def where(self) -> str:
        return "real stack" if self.real else "emulation"

    @property
    def device(self) -> str:
        return "npu"


def _real_torch_npu_importable() -> bool:
    """Whether a real torch_npu is loaded or importable (the emulation's own test)."""
    from ..emulation._install import _real_torch_npu

    return _real_torch_npu() is not None


def open_stack() -> Stack:
    """The real torch_npu when importable, else the emulation with its npu device; with
    ``opcontracts.patch`` applied."""
    if _real_torch_npu_importable():
        import torch_npu  # the point of this command: run on the real stack

        stack = Stack(torch_npu, real=True, installed=False)
    else:
        from .. import emulation

        installed = not emulation.installed()
        emulation.install("narrow", device=True)
        import torch_npu

        stack = Stack(torch_npu, real=False, installed=installed)
    import opcontracts.patch as patch

    stack.patched = not patch.is_applied()
    patch.apply()
    return stack


def close_stack(stack: Stack) -> None:
    """Undo what :func:`open_stack` did."""
    if stack.patched:
        import opcontracts.patch as patch

        patch.unpatch()
    if stack.installed:
        from .. import emulation

        emulation.uninstall()


# --------------------------------------------------------------------------- the checks
def _moe_inputs(stack: Stack, probs_dtype: Any) -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    tokens = torch.randn(8, 16, dtype=torch.bfloat16).to(stack.device)
    indices = torch.randint(0, 4, (8, 2)).to(stack.device)
    permuted, sorted_indices = stack.torch_npu.npu_moe_token_permute(tokens, indices)
    probs = torch.rand(8, 2).to(probs_dtype).to(stack.device)
    return permuted, sorted_indices, probs


def check_soc(stack: Stack) -> Result:
    from .._lang import versions as _versions

    npu = getattr(stack.torch_npu, "npu", None)
    is_init = getattr(npu, "is_initialized", None)
    before = is_init() if is_init is not None else None
    env = _versions.refresh()
    after = is_init() if is_init is not None else None
    if env.soc is None:
        return Result("soc", FAIL, f"SoC unknown ({env.origin('soc')})")
    if before is False and after is True:
        return Result("soc", FAIL, f"SoC {env.soc}, but detecting it initialised the device")
    state = "device not initialised by it" if before is False else \
        "device already initialised before the check"
    return Result("soc", PASS, f"SoC {env.soc} from {env.origin('soc')}; {state}")


def check_packets(stack: Stack) -> Result:
    import torch

    broken = []
    for name in _OPS:
        if not hasattr(torch.ops.npu, name):
            continue
        packet = getattr(torch.ops.npu, name)
        if getattr(stack.torch_npu, name, None) is not packet:
            broken.append(f"torch_npu.{name} is not torch.ops.npu.{name}")
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            broken.append(f"torch.ops.npu.{name} is a {type(packet).__name__}, not an "
                          "OpOverloadPacket")
    if broken:
        return Result("packets", FAIL, "; ".join(broken[:3]) + (" ..." if len(broken) > 3 else ""))
    return Result("packets", PASS, f"torch_npu.X is torch.ops.npu.X, an OpOverloadPacket, for "
                  f"{', '.join(_OPS)} after the patch")


def _strict_stops(name: str, call: Callable[[], Any]) -> Result:
    from .._lang import modes as _modes
    from ..errors import ContractViolation

    try:
        with _modes.mode("strict"):
            call()
    except ContractViolation as exc:
        return Result(name, PASS, f"stopped: {str(exc).splitlines()[0]}")
    return Result(name, FAIL, "a call its contract rejects went through in strict mode")


def check_strict(stack: Stack) -> Result:
    import torch

    # float64 probs: wrong on every release and CANN (fp32 is wrong only on CANN < 8.0.0, a
    # conditional verdict where CANN is unknown), so the check means the same on every stack
    permuted, sorted_indices, probs = _moe_inputs(stack, torch.float64)
    return _strict_stops("strict", lambda: stack.torch_npu.npu_moe_token_unpermute(
        permuted, sorted_indices, probs))


def check_mindspeed(stack: Stack) -> Result:
    import torch

    try:
        from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
    except ImportError as exc:
        return Result("mindspeed", SKIP, f"MindSpeed not importable ({exc})")
    permuted, sorted_indices, probs = _moe_inputs(stack, torch.float32)
    return _strict_stops("mindspeed", lambda: npu_moe_token_unpermute(
        permuted, sorted_indices, probs))


def check_dispatched(stack: Stack) -> Result:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, list[str]] = {"forward": [], "backward": []}
    phase = ["forward"]

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            name = str(func.name())
            if name.startswith("npu::") and name[5:] not in seen[phase[0]]:
                seen[phase[0]].append(name[5:])
            return func(*args, **(kwargs or {}))

    permuted, sorted_indices, probs = _moe_inputs(stack, torch.bfloat16)
    permuted.requires_grad_()
    with Log():
        out = stack.torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
        phase[0] = "backward"
        out.float().sum().backward()
    text = (f"forward: {', '.join(seen['forward']) or 'no npu op'}; "
            f"backward: {', '.join(seen['backward']) or 'no npu op'}")
    return Result("dispatched", PASS if seen["forward"] and seen["backward"] else FAIL, text)


def check_backward_mode(stack: Stack) -> Result:
    import torch

    from .._lang import modes as _modes
    from ..errors import ContractViolation

    threads: list[int] = []

    class UnpermuteInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            threads.append(threading.get_ident())
            stack.torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
            return grad

    permuted, sorted_indices, probs = _moe_inputs(stack, torch.float64)  # wrong everywhere
    x = torch.randn(4, device=stack.device, requires_grad=True)
    loss = UnpermuteInBackward.apply(x).sum()
    where = ""
    try:
        with _modes.mode("strict"):
            loss.backward()
    except ContractViolation:
        where = "on the autograd worker thread" if threads and threads[0] != \
            threading.get_ident() else "on the caller's thread"
        return Result("backward-mode", PASS, f"strict around loss.backward() stopped a call "
                      f"{where}")
    return Result("backward-mode", FAIL, "strict around loss.backward() did not reach the "
                  "check in backward (torch < 2.12 does not hand the caller's context to the "
                  "engine's threads)")


def check_torchair(stack: Stack) -> Result:
    import torch

    try:
        import torchair
    except ImportError as exc:
        return Result("torchair", SKIP, f"torchair not importable ({exc})")
    permuted, sorted_indices, probs = _moe_inputs(stack, torch.bfloat16)
    fn = torch.compile(lambda p, s, q: stack.torch_npu.npu_moe_token_unpermute(p, s, q),
                       backend=torchair.get_npu_backend())
    try:
        out = fn(permuted, sorted_indices, probs)
    except Exception as exc:  # noqa: BLE001 - what the compile of a guarded call raised
        return Result("torchair", FAIL, f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return Result("torchair", PASS, f"compiled the guarded unpermute: output {tuple(out.shape)}")


CHECKS: tuple[Callable[[Stack], Result], ...] = (
    check_soc, check_packets, check_strict, check_mindspeed, check_dispatched,
    check_backward_mode, check_torchair,
)


def run_checks(stack: Stack) -> list[Result]:
    results = []
    for check in CHECKS:
        try:
            results.append(check(stack))
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check
            name = check.__name__.removeprefix("check_").replace("_", "-")
            results.append(Result(name, FAIL, f"{type(exc).__name__}: {exc}"))
    return results


def main() -> int:
    import torch

    try:
        stack = open_stack()
    except RuntimeError as exc:
        print(f"opcontracts selftest: {exc}", file=sys.stderr)
        return 2
    try:
        version = getattr(stack.torch_npu, "__version__", "?")
        print(f"opcontracts selftest on the {stack.where}: torch_npu {version}"
              f"{'' if stack.real else ' (CPU emulation, emulated npu device)'}, "
              f"torch {torch.__version__}")
        results = run_checks(stack)
    finally:
        close_stack(stack)
    for r in results:
        print(f"  {r.status}  {r.name:<14} [{stack.where}] {r.detail}")
    failed = sum(r.status == FAIL for r in results)
    skipped = sum(r.status == SKIP for r in results)
    tail = "" if stack.real else "; on the emulation: run it on an NPU machine for the real stack"
    print(f"selftest: {len(results) - failed - skipped} passed, {failed} failed, "
          f"{skipped} skipped{tail}")
    return 1 if failed else 0


def add_parser(sub: Any) -> None:
    """``opcontracts selftest`` (``sub``: the CLI's subparsers)."""
    p = sub.add_parser("selftest", help="check that opcontracts works on this stack (the real "
                       "torch_npu if importable, else the CPU emulation); exit 1 on a failure",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=_cmd)


def _cmd(ns: argparse.Namespace) -> int:
    return main()
