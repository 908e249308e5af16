"""``opcontracts.NanStepCallback``: the always-on NaN sentinel in a transformers ``Trainer``.

::

    from opcontracts import NanStepCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    NanStepCallback(trainer)            # adds itself; replays a non-finite step
    trainer.train()

What it does, per optimizer step of the Trainer (an update step: its micro-batches, their
``training_step`` calls, ``optimizer.step()``):

* the always-on sentinel (``opcontracts.nan.NanSentinel(always_on=True)``, made at
  ``on_train_begin`` unless one is active already) checks the step at ``optimizer.step()``:
  one fused reduction over the gradients, one host read; a non-finite step is skipped (the
  parameters stay those it started from; the learning-rate schedule moves on, as with AMP's
  skipped steps);
* the callback opens a step at ``on_step_begin`` (the RNG states are taken there) and records
  each ``trainer.training_step(model, inputs, ...)`` of it (the Trainer's forward and backward:
  the callback wraps that method on the trainer it was given); at ``on_step_end`` a step that
  went non-finite is replayed: its micro-batches run again on the same inputs, from the same
  parameters and RNG states, under the per-call watch, which names the first culprit (or says
  the NaN did not reproduce).  The replay's gradients are cleared afterwards (the Trainer
  accumulates into ``.grad``).  A step that ended well drops its inputs.

Without the trainer (``callbacks=[NanStepCallback()]``: a callback is not handed its trainer)
the training steps are not known: the step check still skips a bad step, and the watch arms
itself from the next step on (``StepFinding.how == "recurrence"``).

``callback.result`` holds the sentinel's ``NanResult`` after ``on_train_end``.

transformers is imported when this module is (it is imported only when
``opcontracts.NanStepCallback`` is first used); without transformers the class is a plain
object with the same methods, which a Trainer-like loop can call.
"""

from __future__ import annotations

import functools
from typing import Any

from ..nan import NanResult, NanSentinel, active

__all__ = ["NanStepCallback"]


def _base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError:  # a Trainer-like loop without transformers
        return object
    return TrainerCallback  # type: ignore[no-any-return]


class NanStepCallback(_base()):  # type: ignore[misc]
    """A ``TrainerCallback``: the always-on NaN sentinel over the Trainer's steps, a bad step
    replayed under the watch (give the trainer, or call ``attach(trainer)``)."""

    def __init__(self, trainer: Any = None, *, sentinel: NanSentinel | None = None) -> None:
        super().__init__()
        self.sentinel = sentinel
        self.result: NanResult | None = None
        self._own = False
        self._trainer: Any = None
        if trainer is not None:
            self.attach(trainer)

    def attach(self, trainer: Any) -> NanStepCallback:
        """Add this callback to ``trainer`` and record its ``training_step`` calls (for a
        replay); idempotent."""
        if self._trainer is trainer:
            return self
        self._trainer = trainer
        handler = getattr(trainer, "callback_handler", None)
        if handler is not None and self not in getattr(handler, "callbacks", []):
            trainer.add_callback(self)
        original = trainer.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            s = self.sentinel
            if s is not None:
                s.record_call(original, args, kwargs)
            return original(*args, **kwargs)

        trainer.training_step = training_step
        return self

    # --------------------------------------------------------------- the Trainer's events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        s = self.sentinel or active()
        if s is None:
            s = NanSentinel(always_on=True)
            s.enable()
            self._own = True
        self.sentinel = s

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.sentinel is not None and self._trainer is not None:
            self.sentinel.begin_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.sentinel is not None and self._trainer is not None:
            self.sentinel.end_step(clear_grads=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        s = self.sentinel
        if s is None:
            return
        self.result = s.disable() if self._own else s.result()
        if self._own:
            self.sentinel = None
            self._own = False
