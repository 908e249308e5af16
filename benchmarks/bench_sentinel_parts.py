"""Where the watch's time goes inside a training step (left on: ``always_on=True, watch=True``):
its cost per part, in situ.

    python benchmarks/bench_sentinel_parts.py [--steps N] [--layers L] [--batch B]

``bench_accelerator.py`` says what the watch left on costs a step (``paired x``, and
``us a guarded call``); this says which part of it costs what, measured inside the demo's
step (the same model, 6 layers, 4 x 32 tokens, 1 torch thread), not in a loop of its own: a
part run between the step's kernels finds its code and data out of the caches, and costs two
to five times what the same part costs repeated in a tight loop (a ``_checks`` call: ~5.5 us
in a loop for one bf16 (256, 64) tensor and an index, ~21 us on average in the step; an
``aminmax`` of that tensor ~2.9 us and ~5.7 us).  So a cut that a tight loop shows can vanish
in the step, and the step is what a user pays.

Each part is timed with ``time.perf_counter`` around it (a wrapper per part, which costs a few
microseconds a call in the step itself: the figures are upper bounds; the reductions are timed
in a pass of their own, so that their timers do not count in ``checks``) over ``--steps`` steps, as microseconds per step and
per guarded call, and as a share of the bare step's time measured in the same run:

* ``call record``: the layer's ``Call`` (its tensors listed) for each guarded call;
* ``call site + module``: the caller's line and ``nn.Module`` read off the frames;
* ``checks``: every ``_checks`` of the sentinel (forward inputs and outputs, gradients in and
  sent), of which ``reductions``: the ``aminmax`` kernels themselves;
* ``output hooks``: the outputs' node learns its call and gets the shared post-hook (the
  one-node edge check, ``register_hook``);
* ``backward post-hook``: the node post-hook's own work (without its checks);
* ``the step's read``: the one host read at ``optimizer.step()``.

What is left of the step's extra time (``paired``, measured apart) is the wrapper and the
layer's dispatch, the observers' ``begin``/``end`` calls, torch's own work to call a Python
hook from the autograd engine, and the wrappers of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

PARTS = ("call record", "call site + module", "checks", "reductions", "output hooks",
         "backward post-hook", "the step's read")


@contextlib.contextmanager
def timed_parts(totals: dict[str, float],
                parts: tuple[str, ...] = PARTS) -> Iterator[None]:
    """Wrap each of ``parts`` with a timer while inside (every wrapper is taken off on
    exit)."""
    from opcontracts import nan
    from opcontracts._observers import layer

    pc = time.perf_counter
    undo: list[Callable[[], None]] = []
    in_hook = [False]  # inside the post-hook: its checks are counted apart too

    def wrap(owner: Any, name: str, part: str) -> None:
        if part not in parts:
            return
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            hook = part == "backward post-hook"
            if hook:
                in_hook[0] = True
            t0 = pc()
            try:
                return old(*args, **kwargs)
            finally:
                dt = pc() - t0
                totals[part] += dt
                if hook:
                    in_hook[0] = False
                elif part == "checks" and in_hook[0]:
                    totals["checks in the post-hook"] += dt

        setattr(owner, name, timed)
        undo.append(lambda: setattr(owner, name, old))

    wrap(layer.Call, "__init__", "call record")
    wrap(layer.Call, "_place", "call site + module")
    wrap(nan.NanSentinel, "_checks", "checks")
    wrap(nan, "_aminmax", "reductions")
    wrap(layer._Dispatch, "_hook_outputs", "output hooks")
    wrap(layer, "_node_posthook", "backward post-hook")  # hooks registered from now on
    wrap(nan.NanSentinel, "step", "the step's read")
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def measure(step: Any, steps: int) -> tuple[dict[str, float], list[float], list[float], int]:
    """(part -> seconds per observed step, bare step times, observed step times, guarded calls
    per step) for the watch left on, on ``step``: observed and bare steps in pairs (the
    sentinel switched off at the layer's dispatch: ``bench_accelerator.time_paired``), so that
    a slow phase of the machine hits both alike.  Two passes:
    the reductions are timed alone, so that their timers (one per checked tensor) do not
    count in ``checks``; the step times are the first pass's."""
    import bench_accelerator as bench

    calls = bench.count(step, "watch always-on")[0]
    kept: dict[str, float] = defaultdict(float)
    bare, observed = _pass(step, steps, tuple(p for p in PARTS if p != "reductions"), kept)
    _pass(step, steps, ("reductions",), kept)
    per_step = {p: kept[p] / steps for p in PARTS}
    # the post-hook's own work: its checks are counted under ``checks``
    per_step["backward post-hook"] = (kept["backward post-hook"]
                                      - kept["checks in the post-hook"]) / steps
    return per_step, bare, observed, calls


def _pass(step: Any, steps: int, parts: tuple[str, ...],
          kept: dict[str, float]) -> tuple[list[float], list[float]]:
    """``steps`` pairs of observed and bare steps (``bench_accelerator.time_paired``) with
    ``parts`` timed: adds the observed steps' time per part to ``kept`` (the bare step's read
    of nothing is not the sentinel's cost); (bare step times, observed step times)."""
    import bench_accelerator as bench

    totals: dict[str, float] = defaultdict(float)

    def observed_step() -> None:
        before = dict(totals)
        step()
        for part, v in totals.items():
            kept[part] += v - before.get(part, 0.0)

    with timed_parts(totals, parts):
        # the sentinel is made inside the wrappers: its optimizer-step hook is the timed read
        spans = bench.time_paired(step, "watch always-on", steps, observed_step)
    return [b for _, b in spans], [o for o, _ in spans]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="sequences of 32 tokens per step (the demo's: 4)")
    p.add_argument("--threads", type=int, default=1)
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)

    import bench_accelerator as bench

    import opcontracts
    from opcontracts._tools import demo

    if ns.batch:
        demo.BATCH = ns.batch
    with demo._environment() as model_mod:
        step = bench.Step(model_mod, ns.layers)
        parts, bare_times, observed_times, calls = measure(step, ns.steps)
    bare = statistics.median(bare_times)
    print(f"{'part':22s} {'us a step':>10s} {'us a call':>10s} {'% of bare':>10s}")
    for part in PARTS:
        s = parts[part]
        print(f"{part:22s} {s * 1e6:10.1f} {s / calls * 1e6:10.1f} {s / bare * 100:10.2f}")
    extra = statistics.median(observed_times) - bare
    print(f"{'observed - bare':22s} {extra * 1e6:10.1f} {extra / calls * 1e6:10.1f} "
          f"{extra / bare * 100:10.2f}   (medians of {ns.steps} steps each, interleaved; "
          "the timers included)")
    print(f"{ns.layers} layers, {calls} guarded calls a step, bare step {bare * 1e3:.2f} ms; "
          f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), opcontracts {opcontracts.__version__}, "
          f"{demo.BATCH} x {demo.SEQ} tokens per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
