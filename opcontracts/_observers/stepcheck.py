"""The check of a whole training step at ``optimizer.step()``: one fused reduction over the
loss and every gradient, read once, and the step skipped when it is not finite.

What the always-on NaN sentinel (``opcontracts.nan``) runs on every step.  Its cost does not
grow with the guarded calls: nothing is hooked per call, no kernel is launched per call.  At
every ``optimizer.step()`` of any ``torch.optim.Optimizer`` (torch's global step pre-hook):

* the gradients of the optimizer's parameters (and the loss, when the user handed it over
  with ``loss()``) are reduced by the device's cheapest complete reduction (``_reduce``): on
  an accelerator ``torch._foreach_norm`` (one multi-tensor kernel, no copy, the reduction
  ``clip_grad_norm_`` runs; torch_npu has it: op-plugin's ``_foreach_norm.Scalar``) and a
  ``stack``; on the CPU, where torch runs a foreach op as one kernel call per tensor, the
  small gradients flattened into bounded buffers and each buffer summed (one flatten and one
  sum for a model of up to 2M gradient elements), large ones summed alone.  A NaN or an
  infinity anywhere makes the reduction non-finite; it is read back in ONE host read
  (``tolist``);
* in a distributed job (a process group of more than one rank) the step is judged the same on
  every rank: the count of ranks with a non-finite reduction is summed over the ranks first (one
  ``all_reduce`` of one number, before the read), so that every rank skips, and replays, the
  same steps;
* a step found non-finite is skipped as AMP's ``GradScaler`` skips it: the gradients are set
  aside for the optimizer's step (``p.grad = None``: every torch optimizer leaves such a
  parameter and its state alone) and put back by the step post-hook, so the parameters are
  still those the bad step started from, and the gradients are what the step made.

A 2-norm or a sum can overflow on huge finite values (float16 is summed in float32, whose
range ordinary gradients do not reach): a non-finite reduction is confirmed exactly, tensor by
tensor (``isfinite(t).all()``), before the step is called bad, which costs one more read on
that step only.

Gradients that are a ``DTensor`` (FSDP2) are checked through their local shard; sparse ones
are not checked.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StepCheck", "StepVerdict", "screen"]

_strided = torch.strided
_Tensor = torch.Tensor


def _local(g: torch.Tensor) -> torch.Tensor:
    """A gradient that is not a plain tensor: its local shard when it is a ``DTensor``
    (FSDP2), else itself (a ``Parameter``, another subclass)."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and isinstance(g, dt.DTensor):
        return g.to_local()  # type: ignore[no-any-return]
    return g


@dataclass
class StepVerdict:
    """What the check found at a non-finite ``optimizer.step()`` (a finite one makes none)."""

    step: int                                   # 1-based, the check's own count
    checked: int                                # tensors checked (gradients, and the loss)
    nonfinite: list[str] = field(default_factory=list)  # which ones (a few named)
    nonfinite_count: int = 0
    ranks_bad: int = 0                          # ranks whose step was non-finite (0 alone)
    optimizer: Any = None                       # the optimizer stepped (a weak reference)


def _no() -> bool:
    return False


def _world() -> int:
    dist = sys.modules.get("torch.distributed")
    # ``is_initialized`` exists only in a build with distributed support
    if dist is None or not getattr(dist, "is_initialized", _no)():
        return 1
    return int(dist.get_world_size())


# The CPU's reduction (``_cpu_sums``): torch runs a foreach op on the CPU as one kernel call per
# tensor (~1 us of dispatch each), which is what copying ~20k elements costs; so gradients of
# at most ``_SMALL`` elements are copied into flat buffers of about ``_FLAT`` elements (at most
# ``_FLAT + _SMALL``: bounded memory, ~8 MiB in float32) and summed there, one ``cat`` and one
# ``sum`` a buffer, and larger ones are summed alone (their reduction dwarfs the dispatch); a
# model of at most ``_FLAT`` elements in all is one buffer.  A sum is non-finite when any
# element is a NaN or an infinity (or when finite values overflow: confirmed exactly).
_SMALL = 1 << 15
_FLAT = 1 << 21
_f16 = torch.float16
_f32 = torch.float32
_below_autograd = torch._C._AutoDispatchBelowADInplaceOrView
_flatten = torch._C._nn.flatten_dense_tensors
_numel = torch.Tensor.numel


def _sum(t: torch.Tensor) -> torch.Tensor:
    # float16's range (65504) is overflowed by a sum of ordinary gradients: accumulate in float32
    return t.sum(dtype=_f32) if t.dtype is _f16 else t.sum()


def _cpu_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sums of CPU tensors, small ones flattened together: finite exactly when every tensor
    is (up to overflow), in one ``cat`` + one ``sum`` for the usual small model.  Run below
    autograd (the dispatch torch's own custom-op autograd uses for its redispatch): the
    flatten's view of each tensor then skips two dispatch keys (12 -> 8 us for the 2-layer
    demo's 29 gradients), and nothing here is ever differentiated."""
    with _below_autograd():
        if sum(map(_numel, tensors)) <= _FLAT:  # the usual small model: one buffer, no loop
            return _sum(_flatten(tensors))
        parts: list[torch.Tensor] = []
        small: list[torch.Tensor] = []
        n = 0
        for t in tensors:
            k = t.numel()
            if k > _SMALL:
                parts.append(_sum(t))
                continue
            small.append(t)
            n += k
            if n >= _FLAT:
                parts.append(_sum(_flatten(small)))
                small, n = [], 0
        if small:
            parts.append(_sum(_flatten(small)))
        return parts[0] if len(parts) == 1 else torch.stack(parts)


def _reduce(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A tensor (0-d or 1-d) on the tensors' device whose values are all finite unless a tensor holds
    a NaN or an infinity (or finite values overflow the reduction): on an accelerator the
    2-norm of each (``_foreach_norm``: one multi-tensor kernel, no copy, what
    ``clip_grad_norm_`` runs; torch_npu has it: op-plugin's ``_foreach_norm.Scalar``), on the
    CPU sums of flat buffers (``_cpu_sums``).  Raises ``RuntimeError`` when the tensors are on
    several devices."""
    if tensors[0].is_cpu:  # (``.device`` makes an object: 4 us against 1 in the step)
        return _cpu_sums(tensors)
    return torch.stack(torch._foreach_norm(tensors, 2))


def screen(tensors: list[torch.Tensor], sync: bool = False) -> tuple[list[float], int]:
    """Reductions of ``tensors`` (``_reduce``: all finite unless a tensor holds a NaN or an
    infinity, or finite values overflow) and, with ``sync``, how many ranks have a
    non-finite one, in ONE host read per device (one in the usual case: everything on one
    device).

    The usual case pays two or three ops and no Python loop over the tensors on an
    accelerator: their devices are not looked at (``t.device`` makes an object a tensor) unless
    the reduction refuses them, which is how several devices show."""
    if not tensors:
        return [], 0
    try:
        values = _reduce(tensors)
    except RuntimeError:  # several devices: each device's reduction, brought to the first one's
        values = _by_device(tensors)
    if not sync:
        read = values.tolist()  # the one read (a 0-d tensor reads as a number)
        return (read if isinstance(read, list) else [read]), 0
    import torch.distributed as dist

    bad = (~torch.isfinite(values)).any().to(_f32).reshape(1)
    dist.all_reduce(bad)  # every rank judges the step alike
    numbers = torch.cat([values.to(_f32).reshape(-1), bad]).tolist()  # the one read
    return numbers[:-1], int(numbers[-1])


def _by_device(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The reductions of tensors on several devices, one per device, on the first device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    first = next(iter(by_device))
    return torch.cat([_reduce(ts).to(first).reshape(-1) for ts in by_device.values()])


class StepCheck:
    """The per-step check, over torch's global optimizer step hooks while ``attached``.

    ``on_step(verdict)`` is called at every step found non-finite (on this rank or another),
    after the check (the step is set to be skipped by then); ``on_finite()``, when set, at
    every finite step (an owner that needs nothing then sets none: no verdict is made);
    ``before(optimizer)`` at every step before the check (the sentinel's armed watch reads
    there).  ``replaying``: inside a replay, every step is skipped and not counted.
    ``sync``: judge each step over the ranks (None: when a process group of more than one
    rank is initialised)."""

    def __init__(self, on_step: Callable[[StepVerdict], None],
                 before: Callable[[Any], None] | None = None, sync: bool | None = None,
                 on_finite: Callable[[], None] | None = None) -> None:
        self.on_step = on_step
        self.on_finite = on_finite
        self.before = before
        self.sync = sync
        self.steps = 0
        self.bad_steps: list[int] = []
        self.replaying = False
        self._loss: torch.Tensor | None = None
        self._stash: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        if not self._handles:
            self._handles = [register_optimizer_step_pre_hook(self._pre),
                             register_optimizer_step_post_hook(self._post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def loss(self, t: torch.Tensor) -> None:
        """Check ``t`` (the step's loss) with the gradients at the next ``optimizer.step()``."""
        self._loss = t.detach()

    # ------------------------------------------------------------------ the check
    def _pre(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        if self.replaying:
            self._skip(opt)
            return
        self.steps += 1
        if self.before is not None:  # the owner's (an armed watch's read; it may raise)
            self.before(opt)
        try:
            verdict = self.check(opt)
        except Exception as exc:  # the check never stops the job: the step runs unchecked
            from .._engine.callsite import warn_at_caller

            warn_at_caller(f"opcontracts.nan: the check of step {self.steps} failed "
                           f"({type(exc).__name__}: {exc}); the step runs unchecked",
                           RuntimeWarning)
            return
        if verdict is None:  # finite: no verdict made, the owner told only if it asked
            if self.on_finite is not None:
                self.on_finite()
            return
        self.bad_steps.append(verdict.step)
        self._skip(opt)
        self.on_step(verdict)

    def _post(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        stash = self._stash.pop(id(opt), None)
        if stash:
            for p, g in stash:
                if p.grad is None:
                    p.grad = g

    def _skip(self, opt: Any) -> None:
        stash = []
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    stash.append((p, g))
                    p.grad = None
        self._stash[id(opt)] = stash

    def _sync(self) -> bool:
        return _world() > 1 if self.sync is None else self.sync

    def check(self, opt: Any) -> StepVerdict | None:
        """Judge the gradients of ``opt``'s parameters (and the loss handed over): one host
        read; more on a step found non-finite (which tensors).  None: the step is finite
        (on every rank), the usual case, which makes no verdict.  The hot path of the
        always-on sentinel, once a step: per parameter one attribute read and two tests (the
        layout, and whether the gradient is a plain tensor: a ``DTensor`` is not); names
        made only on a bad step."""
        tensors = [g if type(g) is _Tensor else _local(g)
                   for group in opt.param_groups for p in group["params"]
                   if (g := p.grad) is not None and g.layout is _strided]
        loss, self._loss = self._loss, None
        if loss is not None:
            tensors.append(loss)
        values, ranks_bad = screen(tensors, self._sync())
        finite = math.isfinite(sum(values))
        if finite and not ranks_bad:
            return None
        bad: list[int] = []
        if not finite:
            # which tensors, exactly (a sum or a 2-norm also overflows on huge finite
            # values): one more read, on this step only
            first = tensors[0].device
            ok = torch.stack([torch.isfinite(t).all().to(first) for t in tensors]).tolist()
            bad = [i for i, fine in enumerate(ok) if not fine]
            if not bad and not ranks_bad:
                return None  # finite values whose reduction overflowed
        return StepVerdict(self.steps, len(tensors),
                           [_name(self._what(opt, i, loss is not None and i == len(tensors) - 1),
                                  tensors[i]) for i in bad[:8]],
                           len(bad), ranks_bad=ranks_bad, optimizer=opt)

    @staticmethod
    def _what(opt: Any, index: int, is_loss: bool) -> Any:
        """(parameter names of its group or None, index in the group, the parameter, the
        group's index or None when there is one group, the index over all the optimizer's
        parameters) of the ``index``-th tensor ``check`` judged, or "loss": the parameters are
        walked in the order ``check`` gathered their gradients (a ``DTensor`` gradient's local
        shard is a new tensor at every ``to_local()``: it is found by position, not by
        identity)."""
        if is_loss:
            return "loss"
        n = everyone = 0
        groups = opt.param_groups
        for gi, group in enumerate(groups):
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is not None and g.layout is _strided:
                    if n == index:
                        return (group.get("param_names"), i, p,
                                gi if len(groups) > 1 else None, everyone)
                    n += 1
                everyone += 1
        return None, -1, None, None, -1


def _name(what: Any, t: torch.Tensor) -> str:
    shape = "x".join(map(str, t.shape)) or "scalar"
    dtype = str(t.dtype).removeprefix("torch.")
    if what == "loss":
        return f"the loss ({dtype})"
    pnames, i, _p, group, everyone = what
    if pnames is not None and 0 <= i < len(pnames):
        return f"gradient of {pnames[i]} ({dtype}, {shape})"
    where = f", #{i} of param group {group}" if group is not None else ""
    return f"gradient of parameter #{everyone}{where} ({dtype}, {shape})"
