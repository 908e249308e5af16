"""What a replay of a training step needs: the RNG states the step started from, and the
calls that made it (the user's step function and its inputs).

The always-on NaN sentinel (``opcontracts.nan``) checks a step once, at ``optimizer.step()``;
when the step is non-finite it runs the step again under the per-call watch, on the same
inputs, from the same parameters (the bad step was skipped) and the same random numbers, so
that the watch names the op that made the first NaN.  This module keeps exactly that:

* ``RngStates``: the CPU generator's state and each initialised accelerator's (``torch.cuda``,
  ``torch.npu``: every device's ``get_rng_state_all``), captured and put back, as
  ``torch.random.fork_rng`` does, in two halves (capture at the step's start, restore before
  its replay) rather than as one ``with`` block.  The emulated npu device draws from the CPU
  generator (it has no generator of its own), so the CPU state covers it;
* ``StepScope``: one step in flight: its RNG states and the calls recorded in it (function,
  positional and keyword arguments, held by reference: nothing is copied).  A scope lives
  for one step: when the step ends well it is dropped, and with it every reference to the
  step's inputs (``live_scopes`` counts the scopes alive, so a test can see that a long run
  keeps none).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RngStates", "StepScope", "live_scopes"]

_DEVICE_MODULES = ("cuda", "npu", "xpu", "mps")
_torch_attrs = vars(torch)


def _device_modules() -> list[tuple[str, Any]]:
    """The accelerator modules whose generators are in use (initialised), with
    ``get_rng_state_all``; a module not imported yet is not imported here.  Run at every
    step's start in the replay mode, right after a backward pass, where every miss costs:
    torch's own attributes are read (``getattr`` would go through torch's lazy-module
    ``__getattr__``, which raises for a name it lacks: 8 us a step), and whether a module has
    ``get_rng_state_all`` is asked once per module object (``hasattr`` on ``torch.mps``
    raises inside: 4 us a step)."""
    found = []
    for name in _DEVICE_MODULES:
        mod = _torch_attrs.get(name)  # torch.npu: there once torch_npu / the emulation set it
        if mod is None:
            continue
        known = _has_states.get(name)
        if known is None or known[0] is not mod:
            known = _has_states[name] = (mod, hasattr(mod, "get_rng_state_all"))
        if not known[1]:
            continue
        try:
            init = getattr(mod, "is_initialized", None)
            if init is not None and not init():
                continue
        except Exception:  # a backend that cannot say: not ours to initialise
            continue
        found.append((name, mod))
    return found


_has_states: dict[str, tuple[Any, bool]] = {}  # name -> (its module, has get_rng_state_all)


class RngStates:
    """The random generators' states at one moment (CPU, and each initialised accelerator's
    devices); ``restore()`` puts them back."""

    __slots__ = ("cpu", "devices")

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.devices: list[tuple[Any, list[torch.Tensor]]] = []
        for _name, mod in _device_modules():
            try:
                self.devices.append((mod, list(mod.get_rng_state_all())))
            except Exception:  # pragma: no cover - a device module without generators
                continue

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for mod, states in self.devices:
            mod.set_rng_state_all(states)


_live: weakref.WeakSet[StepScope] = weakref.WeakSet()


def live_scopes() -> int:
    """Step scopes alive now (each holds one step's inputs until it ends)."""
    return len(_live)


class StepScope:
    """One training step in flight: where its random numbers started and the calls that make
    it, to run again if the step turns out non-finite."""

    __slots__ = ("rng", "calls", "__weakref__")

    def __init__(self) -> None:
        self.rng = RngStates()
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
        _live.add(self)

    def record(self, fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        self.calls.append((fn, args, kwargs))

    def release(self) -> None:
        """Drop the references to the step's inputs."""
        self.calls.clear()
