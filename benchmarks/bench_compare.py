"""Cost of the shadow compare, the recorder and run's call statistics, and of the probe.

    python benchmarks/bench_compare.py [--quick]

All three are observers of one layer over the patch's guards (``opcontracts._observers.layer``): off,
nothing is installed (checked here: the guards are the patch's own objects again).  Rows, best
of N per call (shared machines are noisy: the best run is the least disturbed one), and the
ratio to the same call with nothing attached:

* a patched op (``x * w``, a (64, 64) fp32 tensor, strict) with nothing attached, with the call
  statistics (what ``opcontracts run`` always attaches), the recorder, and the compare at
  sample 1, 0.1 and 0; without grad, and forward + backward of three calls in a row;
* the emulated ``npu_moe_token_unpermute`` (bf16 (256, 64) tokens, top-2) through the patch,
  nothing attached vs the compare (the reference runs on fp32 copies on the CPU);
* the demo's training step (``opcontracts demo``'s unguarded run: 3 MoE blocks, 18 guarded
  calls forward and backward), nothing vs the statistics vs the compare at sample 1, 0.1, 0,
  interleaved round by round;
* the probe of every op with an example, on the emulation, per profile.
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from _guarded_scale import guarded_scale


def best_ns(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """The best of ``repeat`` runs: other load on a shared machine only ever adds time."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


@contextmanager
def attached(kind: str) -> Iterator[None]:
    """Nothing, the call statistics, the recorder or the compare (``compare:RATE``)."""
    from opcontracts._observers import layer
    from opcontracts._observers.stats import CallStats
    from opcontracts.compare import ShadowCompare
    from opcontracts.record import Recorder

    if kind == "nothing":
        yield
        return
    if kind == "stats":
        stats = CallStats()
        layer.attach(stats)
        try:
            yield
        finally:
            layer.detach(stats)
        return
    obs: Any = Recorder() if kind == "recorder" else ShadowCompare(
        sample=float(kind.split(":")[1]))
    with obs:
        yield


KINDS = ("nothing", "stats", "recorder", "compare:1", "compare:0.1", "compare:0")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine the OpenMP pool's "
                   "spin-waiting swamps small reductions, ~7 ms for a (256, 2, 64) sum)")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    number, repeat = (100, 5) if ns.quick else (500, 9)

    import opcontracts
    import opcontracts.patch as patch
    from opcontracts import reference

    op = guarded_scale("bench_compare_ops")
    reference.register("bench.scale", lambda x, w: x * w, source="benchmark", replace=True)
    mod, guard, x, w, chain = op.mod, op.mod.scale, op.x, op.w, op.chain

    rows: dict[str, float] = {}
    with opcontracts.mode("strict"):
        for kind in KINDS:
            with attached(kind):
                with torch.no_grad():
                    rows[f"guarded op, no grad | {kind}"] = best_ns(lambda: mod.scale(x, w),
                                                                   number, repeat)
                rows[f"3 guarded ops, fwd + bwd | {kind}"] = best_ns(chain, number // 5 or 1,
                                                                    repeat)
    assert mod.scale is guard, "the layer was not taken off"
    patch.unpatch()
    op.close()
    reference.unregister("bench.scale")
    rows.update(emulated_kernel(max(20, number // 10), repeat))
    rows.update(demo_step(max(3, repeat)))
    probe_s = probe_all()

    print(f"{'row':44s} {'observer':12s} {'best us':>10s} {'ratio':>7s}")
    for name, v in rows.items():
        what, kind = name.split(" | ")
        base = rows[f"{what} | nothing"]
        print(f"{what:44s} {kind:12s} {v / 1000:10.1f} {v / base:7.2f}")
    print()
    for prof, (n_ops, runs, secs) in probe_s.items():
        print(f"probe, every op with an example ({n_ops} ops, {runs} runs), profile {prof}: "
              f"{secs:.2f} s")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, opcontracts {opcontracts.__version__}")
    return 0


def emulated_kernel(number: int, repeat: int) -> dict[str, float]:
    """The emulated unpermute kernel through the patch, without and with the compare."""
    import opcontracts
    import opcontracts.patch as patch
    from opcontracts import emulation

    out: dict[str, float] = {}
    was = emulation.installed()
    emulation.install("incident")
    patch.apply()
    try:
        import torch_npu

        g = torch.Generator().manual_seed(0)
        tokens = torch.randn(512, 64, generator=g).to(torch.bfloat16)
        si = torch.randperm(512, generator=g).to(torch.int32)
        probs = torch.rand(256, 2, generator=g).to(torch.bfloat16)
        with opcontracts.mode("strict"), torch.no_grad():
            for kind in ("nothing", "compare:1", "compare:0.1"):
                with attached(kind):
                    out[f"emulated unpermute kernel | {kind}"] = best_ns(
                        lambda: torch_npu.npu_moe_token_unpermute(tokens, si, probs), number,
                        repeat)
    finally:
        if not was:
            patch.unpatch()
            emulation.uninstall()
            patch.apply()
    return out


def demo_step(repeat: int) -> dict[str, float]:
    """The demo's unguarded training step (mode off), with each observer."""
    import opcontracts
    from opcontracts._tools import demo

    out: dict[str, float] = {}
    with demo._environment() as model_mod:
        batch = demo._batch(0)

        def step() -> None:
            with opcontracts.mode("off"):
                demo._train_step(model_mod, 0, batch, fused=True)

        kinds = ("nothing", "stats", "compare:1", "compare:0.1", "compare:0")
        for kind in kinds:  # warm up every path once
            with attached(kind):
                step()
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(repeat):  # interleaved: slow phases of a shared machine hit all alike
            for kind in kinds:
                with attached(kind):
                    t0 = time.perf_counter()
                    step()
                    best[kind] = min(best[kind], (time.perf_counter() - t0) * 1e9)
        for kind in kinds:
            out[f"demo training step | {kind}"] = best[kind]
    return out


def probe_all() -> dict[str, tuple[int, int, float]]:
    from opcontracts import emulation, reference
    from opcontracts.probe import probe

    ops = [n for n in reference.names() if reference.get(n).example is not None]  # type: ignore[union-attr]
    out = {}
    for prof in ("narrow", "incident", "wide"):
        emulation.install(prof)
        try:
            import torch_npu  # noqa: F401 - the stand-in

            probe(ops[0])  # warm up
            t0 = time.perf_counter()
            runs = sum(len(probe(op).cells) for op in ops)
            out[prof] = (len(ops), runs, time.perf_counter() - t0)
        finally:
            emulation.uninstall()
    return out


if __name__ == "__main__":
    sys.exit(main())
