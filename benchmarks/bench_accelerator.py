"""What each observer costs a training step on an accelerator: host reads per step, and time.

    python benchmarks/bench_accelerator.py [--quick] [--layers 2 6] [--rounds N] [--paired N]

On an NPU or GPU every host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``)
stalls the device: the host waits for the queue to drain instead of running ahead of the
kernels.  CPU timings cannot show it; the reads can be counted anywhere (``_host_reads``), and
they are the hardware-independent cost: an observer that adds N reads per step adds N
synchronisations per step on the device, whatever the CPU ratio says.

The step is the demo's model (``opcontracts demo``'s MoE transformer: per layer a fused
MindSpeed permute and unpermute through the emulation, the incident's fix applied so that
strict mode passes), built once, forward + backward + an SGD step; 2 and 6 layers.  Rows:

* ``bare``: nothing attached, contracts off;
* ``strict``: the guards in strict mode, nothing attached;
* ``sentinel``: the NaN sentinel (``NanSentinel``, contracts off), read at the end of each step;
* ``sentinel always-on``: ``NanSentinel(always_on=True)``, what to leave on in production;
* ``compare S``: the shadow compare at sample S (1.0, 0.1, 0.01), contracts off.

Columns: guarded calls per step, host reads per step added to the bare step's (the model's own
reads, the expert split's ``tolist``, are the bare step's), host copies added (``.cpu()`` /
``.to("cpu")``: the compare's reference copies), and the median over interleaved rounds of the
time ratio to the bare step of the same round (a slow phase of a shared machine hits every row
of a round alike), and the ratio of the best rounds; times are this process's CPU time
(``time.process_time``: another process's load on a shared machine does not count in it, as it
does in wall time).  1 torch thread by default (on a shared 2-core machine the OpenMP pool's
spin-waiting swamps small reductions).

``--batch B`` runs B sequences per step instead of the demo's 4 (the same guarded calls on
larger tensors: what is per call shrinks relative to the step).

``--paired N`` adds, per observer, N pairs of back-to-back steps, one observed and one with the
observer switched off at the layer's dispatch (``time_paired``): the median and quartiles of
the pairs' wall-time ratios, a figure whose spread is a few percent on a machine whose rounds
swing by ten, and the median extra time of the observed step divided by its guarded calls
(``us a guarded call``): what the observer costs per call, forward and backward together,
which a larger step (``--batch``) does not dilute.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _host_reads import HostReads

KINDS = ("bare", "strict", "sentinel", "sentinel always-on", "compare 1.0", "compare 0.1",
         "compare 0.01")


@contextlib.contextmanager
def observed(kind: str) -> Iterator[Callable[[], None]]:
    """The observer of ``kind`` around a series of steps; yields what to call at each step's
    end (the step boundary: the sentinel's and the compare's one read)."""
    import opcontracts
    from opcontracts.compare import ShadowCompare
    from opcontracts.nan import NanSentinel

    mode = "strict" if kind == "strict" else "off"
    with opcontracts.mode(mode):
        if kind in ("bare", "strict"):
            yield lambda: None
            return
        obs: Any
        if kind.startswith("sentinel"):
            obs = NanSentinel(**_always_on(kind))
        else:
            obs = ShadowCompare(sample=float(kind.split()[1]))
        with obs:
            yield lambda: _boundary(obs)


def _always_on(kind: str) -> dict[str, Any]:
    from opcontracts.nan import NanSentinel

    if kind != "sentinel always-on":
        return {}
    if "always_on" not in NanSentinel.__init__.__code__.co_varnames:
        return {}  # an older opcontracts: the plain sentinel
    return {"always_on": True}


def _boundary(obs: Any) -> None:
    if getattr(obs, "step_hook", False):
        return  # optimizer.step() is the boundary: it read already
    step = getattr(obs, "step", None)
    if step is not None:
        step()
    else:
        obs.result()


class Step:
    """The demo's model with ``layers`` MoE blocks, built once: forward, backward, SGD step."""

    def __init__(self, model_mod: Any, layers: int) -> None:
        from opcontracts._tools import demo

        torch.manual_seed(0)
        self.model = model_mod.MoEModel(vocab=demo.VOCAB, layers=layers).to(torch.bfloat16)
        self.model.set_fused(True, cast_probs=True)  # conforming: strict mode passes
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.batch = demo._batch(0)

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(*self.batch)
        loss.backward()
        self.opt.step()


def count(step: Step, kind: str, steps: int = 2) -> tuple[int, int, int]:
    """(guarded calls, host reads, host copies) per step with ``kind`` attached; the first
    step warms up, the last is counted with its boundary."""
    from opcontracts._observers import layer
    from opcontracts._observers.stats import CallStats

    stats = CallStats()
    with observed(kind) as boundary:
        for _ in range(steps - 1):
            step()
            boundary()
        layer.attach(stats)
        try:
            with HostReads() as reads:
                step()
                boundary()
        finally:
            layer.detach(stats)
    calls = sum(stats.calls.values())
    return calls, reads.total, reads.copies_total


def time_rounds(step: Step, kinds: tuple[str, ...], rounds: int, per: int
                ) -> dict[str, list[float]]:
    """Per round and kind: the mean step time over ``per`` steps."""
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            with observed(kind) as boundary:
                step()
                boundary()  # warm (first call of the observer's paths)
                t0 = time.process_time()
                for _ in range(per):
                    step()
                    boundary()
                times[kind].append((time.process_time() - t0) / per)
    return times


def time_paired(step: Step, kind: str, pairs: int,
                observed_step: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """Per pair of consecutive steps, (the observed step's wall time, the bare one's), with
    the observer attached throughout and switched off for the bare step at the layer's
    dispatch (``_Dispatch.observers``: what the wrapper reads before anything else, so the
    bare step pays the wrapper's two attribute reads and nothing more).  Pairs alternate
    which step runs first; a slow phase of a shared machine hits both steps of a pair, so the
    spread of the pairs' ratios is a few percent where whole rounds swing by ten.
    ``observed_step`` runs in place of ``step`` for the observed steps (a caller that
    accounts something per observed step)."""
    from opcontracts._observers import layer

    pc = time.perf_counter
    run_observed = step if observed_step is None else observed_step
    spans: list[tuple[float, float]] = []
    with observed(kind) as boundary:
        d = layer._dispatch
        on = d.observers
        for _ in range(3):
            step()
            boundary()
        try:
            for i in range(pairs):
                pair = {}
                for which in ((False, True) if i % 2 else (True, False)):
                    d.observers = on if which else ()
                    t0 = pc()
                    if which:
                        run_observed()
                        boundary()
                    else:
                        step()
                    pair[which] = pc() - t0
                spans.append((pair[True], pair[False]))
        finally:
            d.observers = on
    return spans


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (smoke test)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, metavar="KIND")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="also N step pairs per observer, bare and observed back to back "
                        "(wall time; median and quartiles of the pairs' ratios)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="sequences of 32 tokens per step (the demo's: 4); a larger step shows "
                        "which costs are per guarded call")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    rounds = ns.rounds or (2 if ns.quick else 9)
    per = 1 if ns.quick else 3
    kinds = tuple(ns.kinds)
    if "bare" not in kinds:
        kinds = ("bare", *kinds)

    import opcontracts
    from opcontracts._tools import demo

    print(f"{'layers':>6s} {'observer':20s} {'calls':>6s} {'+reads':>7s} {'+copies':>8s} "
          f"{'median x':>9s} {'best x':>7s} {'bare ms':>8s}")
    if ns.batch:
        demo.BATCH = ns.batch
    with demo._environment() as model_mod:
        for layers in ns.layers:
            step = Step(model_mod, layers)
            counted = {k: count(step, k) for k in kinds}
            times = time_rounds(step, kinds, rounds, per)
            bare = times["bare"]
            for kind in kinds:
                calls, reads, copies = counted[kind]
                ratios = [t / b for t, b in zip(times[kind], bare)]
                print(f"{layers:6d} {kind:20s} {calls:6d} {reads - counted['bare'][1]:7d} "
                      f"{copies - counted['bare'][2]:8d} {statistics.median(ratios):9.3f} "
                      f"{min(times[kind]) / min(bare):7.3f} "
                      f"{statistics.median(bare) * 1e3:8.2f}")
            if ns.paired:
                for kind in kinds:
                    if kind in ("bare", "strict"):
                        continue  # nothing attached to switch off
                    paired = time_paired(step, kind, ns.paired)
                    r = sorted(o / b for o, b in paired)
                    q1, q3 = r[len(r) // 4], r[(3 * len(r)) // 4]
                    # the step's extra time spread over its guarded calls: the figure that does
                    # not shrink with a larger step (``--batch``), i.e. the per-call budget
                    extra = statistics.median(o - b for o, b in paired)
                    per_call = extra / counted[kind][0] * 1e6
                    print(f"{layers:6d} {kind:20s} paired x {statistics.median(r):.3f} "
                          f"(quartiles {q1:.3f}-{q3:.3f}, {len(r)} pairs, wall time), "
                          f"{per_call:+.0f} us a guarded call")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), opcontracts {opcontracts.__version__}, "
          f"{rounds} rounds x {per} steps, {demo.BATCH} x {demo.SEQ} tokens per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
