"""What a replay of a training step needs: the RNG states the step started from, and the
calls that made it (the user's step function and its inputs).

The always-on NaN sentinel (``opcontracts.nan``) checks a step once, at ``optimizer.step()``;
when the step is non-finite it runs the step again under the per-call watch, on the same
inputs, from the same parameters (the bad step was skipped) and the same random numbers, so
that the watch names the op that made the first NaN.  This module keeps exactly that:

* ``RngStates``: the CPU generator's state and each initialised accelerator's (``torch.cuda``,
  ``torch.npu``: every device's ``get_rng_state_all``), captured and put back, as
  ``torch.random.fork_rng`` does, in two halves (capture at the step's start, restore before
  its replay) rather than as one ``with`` block.  The CPU generator is cloned
  (``Generator.clone_state``: its state copied, no tensor made), the devices' states taken
  as tensors; the emulated npu device's state is the CPU generator's and its Philox state,
  taken like any device's once the device is initialised;
* ``StepScope``: one step in flight: its RNG states and the calls recorded in it (function,
  positional and keyword arguments, held by reference: nothing is copied).  A scope lives
  for one step: when the step ends well it is dropped, and with it every reference to the
  step's inputs (``live_scopes`` counts the scopes alive, so a test can see that a long run
  keeps none).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RngStates", "StepScope", "live_scopes"]

_DEVICE_MODULES = ("cuda", "npu", "xpu", "mps")
_torch_attrs = vars(torch)


def _candidates(key: tuple[Any, ...]) -> list[Any]:
    """The accelerator modules of ``key`` (``torch.cuda``, ``torch.npu``... or None each) that
    can have generators in use: those with ``get_rng_state_all`` whose backend is available
    (``is_available()``: a backend this process cannot use never initialises, so it is dropped
    for good).  Asked once per set of modules, not per step."""
    found = []
    for mod in key:
        if mod is None or not hasattr(mod, "get_rng_state_all"):
            continue
        try:
            available = getattr(mod, "is_available", None)
            if available is not None and not available():
                continue
        except Exception:  # a backend that cannot say: kept, its is_initialized() decides
            pass
        found.append(mod)
    return found


_cached: list[Any] = [None, []]  # [the modules' key, their candidates]


def _device_modules() -> list[Any]:
    """The accelerator modules whose generators are in use (initialised), with
    ``get_rng_state_all``; a module not imported yet is not imported here.  Run at every
    step's start in the replay mode, right after the last step's optimizer step, where every
    miss costs: the modules are looked up in torch's own attributes in one pass (``getattr``
    would go through torch's lazy-module ``__getattr__``, which raises for a name it lacks),
    and which of them can ever have a generator in use (``_candidates``) is asked again only
    when one of them changes (``torch.npu`` appears once torch_npu or the emulation is
    installed); what is left per step is ``is_initialized()`` of the available backends
    (none on a CPU-only build)."""
    key = tuple(map(_torch_attrs.get, _DEVICE_MODULES))
    if key != _cached[0]:
        _cached[0], _cached[1] = key, _candidates(key)
    found = []
    for mod in _cached[1]:
        try:
            init = getattr(mod, "is_initialized", None)
            if init is not None and not init():
                continue
        except Exception:  # a backend that cannot say: not ours to initialise
            continue
        found.append(mod)
    return found


# The CPU generator's state: a clone of the generator (``Generator.clone_state``, torch 2.4: a
# copy of its 5 KB state, no tensor made), put back by its ``get_state``; else the state tensor
_clone_cpu = getattr(torch.default_generator, "clone_state", None)


class RngStates:
    """The random generators' states at one moment (CPU, and each initialised accelerator's
    devices); ``restore()`` puts them back."""

    __slots__ = ("cpu", "devices")

    def __init__(self) -> None:
        self.cpu: Any = torch.get_rng_state() if _clone_cpu is None else _clone_cpu()
        self.devices: list[tuple[Any, list[torch.Tensor]]] = []
        for mod in _device_modules():
            try:
                self.devices.append((mod, list(mod.get_rng_state_all())))
            except Exception:  # pragma: no cover - a device module without generators
                continue

    def restore(self) -> None:
        cpu = self.cpu
        torch.set_rng_state(cpu if isinstance(cpu, torch.Tensor) else cpu.get_state())
        for mod, states in self.devices:
            mod.set_rng_state_all(states)


def live_scopes() -> int:
    """Step scopes alive now (each holds one step's inputs until it ends), counted by the
    garbage collector: no bookkeeping on the step's path (a test's question, slow)."""
    return sum(type(o) is StepScope for o in gc.get_objects())


class StepScope:
    """One training step in flight: where its random numbers started and the calls that make
    it, to run again if the step turns out non-finite."""

    __slots__ = ("rng", "calls")

    def __init__(self) -> None:
        self.rng = RngStates()
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def record(self, fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        self.calls.append((fn, args, kwargs))

    def release(self) -> None:
        """Drop the references to the step's inputs."""
        self.calls.clear()
