"""Start-up: ``import opcontracts.patch`` against ``import torch``, and the alias sweeps.

    python benchmarks/bench_startup.py [--quick] [--modules 8000]

* ``import torch`` and ``import opcontracts.patch`` on top of it, fresh interpreters, median of
  runs (``bench_patch.import_times``), byte-compiled as pip installs it and compiled from
  source (``PYTHONDONTWRITEBYTECODE`` on a tree never compiled: how the earlier figures were
  taken), with the shipped contracts' targets read from the precomputed index
  (``contracts/index.json``) and, for comparison, from the contract files (the index made
  stale in a copy of the folder is what the files cost);
* the alias sweeps over a synthetic process of N loaded modules (a real torch_npu + Megatron +
  MindSpeed process holds ~8,000): the patch's rebinding of ``from x import f`` names when it
  guards a target (``_attach.patcher._rebind_aliases``, at patch time and at each guarded import),
  and the observer layer's (``_observers.layer._layer._rebind``, when an observer attaches).  Each
  synthetic module holds 60 names (functions, classes, constants), one in 200 an alias of a
  guarded function.  Median of repeats, ms per sweep.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from bench_patch import import_times


def synthetic_modules(n: int, guarded: Callable[..., Any]) -> list[str]:
    names = []
    for i in range(n):
        name = f"_bench_startup_mod_{i}"
        mod = types.ModuleType(name)
        d = mod.__dict__
        for j in range(20):
            d[f"f{j}"] = lambda x: x
            d[f"C{j}"] = type(f"C{j}", (), {})
            d[f"K{j}"] = j
        if i % 200 == 0:
            d["op"] = guarded
        sys.modules[name] = mod
        names.append(name)
    return names


def sweep_times(n: int, repeat: int) -> dict[str, float]:
    import opcontracts.patch as patch
    from opcontracts._observers import layer

    def op(x: Any) -> Any:
        return x

    def guard(x: Any) -> Any:
        return x

    guard.__opcontracts_op__ = "bench.op"  # type: ignore[attr-defined]
    names = synthetic_modules(n, op)
    aliased = [sys.modules[m] for m in names if "op" in vars(sys.modules[m])]
    out: dict[str, float] = {}
    try:
        patcher = patch._patcher
        originals = {id(op): (op, guard)}

        def patch_sweep() -> None:
            saved = list(patcher.records)
            patcher._rebind_aliases(originals)
            patcher.records[:] = saved
            for m in aliased:  # as before the sweep
                m.op = op  # type: ignore[attr-defined]

        def layer_sweep() -> None:
            layer._layer._rebind({id(op): (op, "bench")})
            layer._layer.restore()

        for label, fn in (("patch alias sweep", patch_sweep),
                          ("observer layer wrap + restore (two sweeps)", layer_sweep)):
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            out[label] = statistics.median(ts)
    finally:
        for name in names:
            sys.modules.pop(name, None)
    return out


def index_vs_files(runs: int) -> tuple[float, float]:
    """``_engine.registry.shipped_index()`` in a fresh interpreter (torch and opcontracts imported
    first): from the index, and with the index refused (what a stale one costs)."""
    import subprocess

    code = ("import time, torch, opcontracts._engine.registry as r, opcontracts._engine.contract_index as c\n"
            "{}t = time.perf_counter(); r.shipped_index(); print(time.perf_counter() - t)")

    def t(pre: str) -> float:
        out = subprocess.run([sys.executable, "-c", code.format(pre)], capture_output=True,
                             text=True, check=True)
        return float(out.stdout.strip())

    a, b = [], []
    for _ in range(runs):  # interleaved
        a.append(t(""))
        b.append(t("c.load = lambda folder: None\n"))
    return statistics.median(a), statistics.median(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer runs (smoke test)")
    p.add_argument("--modules", type=int, default=8000)
    ns = p.parse_args(argv)
    runs, repeat = (3, 3) if ns.quick else (9, 9)

    for bytecode, how in ((True, "byte-compiled, as installed"), (False, "compiled from source")):
        torch_s, patch_s = import_times(runs, bytecode=bytecode)
        print(f"import torch: {torch_s * 1e3:.1f} ms; import opcontracts.patch on top ({how}): "
              f"{patch_s * 1e3:.1f} ms ({patch_s / torch_s * 100:.1f}% of torch), targets from the "
              "precomputed index")
    idx, files = index_vs_files(runs)
    print(f"the shipped targets, median of {runs} fresh interpreters: {idx * 1e3:.1f} ms from "
          f"the index, {files * 1e3:.1f} ms from the contract files")
    loaded = len(sys.modules)
    for label, ms in sweep_times(ns.modules, repeat).items():
        print(f"{label} over {ns.modules + loaded} modules: {ms:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
