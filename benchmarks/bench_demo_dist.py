"""What the patch costs per training step in strict mode, as a ratio of the step, in the
setting of ``opcontracts demo --ranks N``: the demo's MoE model sharded per block with FSDP on N
ranks (gloo, CPU), and in one process without FSDP.

    python benchmarks/bench_demo_dist.py [--ranks N] [--steps K] [--quick]

The model runs the fused path with the incident's fix written by hand (``cast_probs``: probs
cast to bf16 before the unpermute), so every guarded call conforms and strict mode checks
without raising: the cost of a job that is guarded and correct.  Per setting (one process;
FSDP1 on N ranks; FSDP2 on N ranks) the step (forward + backward, gradients dropped after
each) is timed in three ways, interleaved so that the machine's load drifts into
all three alike:

* ``unpatched``: ``opcontracts.patch.unpatch()``: the original functions and op packets;
* ``strict``: the patch applied, ``opcontracts.mode("strict")`` (every guarded call checked);
* ``unpatched again``: a second unpatched series: its distance to the first is the noise
  floor of this run on this machine (a difference smaller than that is no difference).

The series take turns in blocks of 5 steps (``patch.apply()`` builds new guards: the first
step after each switch is not timed).

Reported per setting, on rank 0 (FSDP keeps the ranks in step): the median and the best step
of each series, ``strict / unpatched`` from the medians and from the best steps, the noise
floor, and the guarded calls per step (counted by the NaN sentinel on one extra step), so that
the difference can be read per call too.  Under FSDP with as many ranks as cores the step
times are bimodal (a rank that loses its core waits in the next collective): the medians move
by several percent from run to run, the best steps much less.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

SERIES = ("unpatched", "strict", "unpatched again")


def _steps(setting: Any, steps: int) -> dict[str, Any]:
    """Time the demo's step in the three series; ``setting`` as ``demo._train_step`` takes it."""
    import torch

    import opcontracts
    import opcontracts.patch as patch
    from opcontracts._tools import demo
    from opcontracts.nan import NanSentinel

    times: dict[str, list[float]] = {s: [] for s in SERIES}
    with demo._environment() as mod:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        batch = demo._batch(0, rank)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            inner = mod.MoEModel(vocab=demo.VOCAB)
        inner.set_fused(True, cast_probs=True)
        model = setting.wrap(inner, mod)

        def step() -> None:
            model(*batch).backward()
            model.zero_grad(set_to_none=True)

        def guarded() -> bool:
            return any(getattr(v, "__opcontracts_patched__", False) for v in vars(mod).values())

        def block(series: str, n: int) -> None:
            """Switch the patch (un)applied, one untimed step (a fresh guard builds its checker
            and learns its memo on its first calls), then ``n`` timed steps.  The model file
            bound the ops by `from x import f` after the patch: unpatch() puts the originals
            back in those names too, and apply() rebinds them."""
            if series == "strict":
                patch.apply()
                assert guarded()
            else:
                patch.unpatch()
                assert not guarded()
            with opcontracts.mode("strict"):
                step()
                for _ in range(n):
                    t0 = time.perf_counter()
                    step()
                    times[series].append(time.perf_counter() - t0)

        per_block = 5
        for _ in range(max(1, steps // per_block)):
            for s in SERIES:
                block(s, per_block)
        patch.apply()
        with opcontracts.mode("strict"), NanSentinel() as sentinel:
            step()
        calls = sentinel.result().calls
    return {"times": times, "calls": calls}


def _summary(name: str, r: dict[str, Any]) -> list[str]:
    t = r["times"]
    med = {s: statistics.median(v) for s, v in t.items()}
    best = {s: min(v) for s, v in t.items()}
    ratio = med["strict"] / med["unpatched"]
    noise = abs(med["unpatched again"] / med["unpatched"] - 1)
    per_call = (med["strict"] - med["unpatched"]) / max(1, r["calls"])
    lines = [f"{name}: {len(t['strict'])} steps per series, {r['calls']} guarded calls per step"]
    for s in SERIES:
        lines.append(f"  {s:16s} median {med[s] * 1e3:8.2f} ms   best {best[s] * 1e3:8.2f} ms")
    lines.append(f"  strict / unpatched (medians): x{ratio:.4f} ({(ratio - 1) * 100:+.2f}% of the "
                 f"step; noise floor of this run {noise * 100:.2f}%), {per_call * 1e6:+.1f} us per "
                 "guarded call")
    lines.append(f"  strict / unpatched (best steps): x{best['strict'] / best['unpatched']:.4f} "
                 f"(unpatched again: x{best['unpatched again'] / best['unpatched']:.4f})")
    return lines


def _rank_main(ranks: int, steps: int) -> list[str] | None:
    """Each rank: FSDP1 then FSDP2; rank 0 returns the lines to print."""
    from opcontracts._tools import demo, demo_dist

    out: list[str] = []
    with demo_dist.process_group() as (rank, world):
        for fsdp in (1, 2):
            r = _steps(demo._fsdp_setting(fsdp), steps)
            out += _summary(f"FSDP{fsdp}, {world} ranks", r)
    return out if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks for the FSDP settings (default 2)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per series (default 30)")
    p.add_argument("--quick", action="store_true", help="5 steps per series (smoke test)")
    ns = p.parse_args(argv)
    steps = 5 if ns.quick else ns.steps

    import torch

    import opcontracts
    from opcontracts._tools import demo, demo_dist

    lines = _summary("one process, no FSDP", _steps(demo.SINGLE, steps))
    results = demo_dist.launch(ns.ranks, _rank_main, ns.ranks, steps)
    lines += results[0]
    print("\n".join(lines))
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, opcontracts "
          f"{opcontracts.__version__}; {torch.get_num_threads()} threads in the single process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
