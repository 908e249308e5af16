"""Preflight: the demo's model at DeepSeek-V3 size, one training step on fake tensors.

    python benchmarks/bench_preflight.py [--layers 1 61] [--repeat 2]

Each run is a fresh interpreter (``opcontracts preflight``'s cost from nothing: imports, the
emulation's install, the model built, forward, backward, AdamW's step, the report), timed
around the whole process; its peak RSS is the child's own ``ru_maxrss`` (``resource``).  The
machine's load average is printed with each run: the figures of a shared machine move with it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import dataclasses, resource, sys, time
t0 = time.perf_counter()
from opcontracts._tools import preflight_demo as d
pf = d.run_demo(dataclasses.replace(d.DEEPSEEK_V3, layers={layers}))
rep = pf.report
assert [v.call_site for v in rep.violations] == ["moe_block.py:107 in forward"], rep.text()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
print(f"{{time.perf_counter() - t0:.2f}} {{rss}} {{rep.peak_bytes}} {{rep.violations[0].count}}")
"""


def one(layers: int) -> tuple[float, float, float, int, int]:
    """(wall s, in-process s, peak RSS MiB, peak device bytes, violating calls) of a child."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD.format(layers=layers)], env=env,
                       capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"layers={layers}: the child failed:\n{p.stderr}")
    inner, rss, peak, calls = p.stdout.split()[-4:]
    return wall, float(inner), int(rss) / 1024, int(peak), int(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 61])
    ap.add_argument("--repeat", type=int, default=2)
    ns = ap.parse_args()
    print(f"{os.cpu_count()} CPU(s); python {sys.version.split()[0]}")
    print(f"{'layers':>6} {'wall s':>7} {'in-process s':>12} {'peak RSS MiB':>12} "
          f"{'device GiB':>10} {'violating calls':>15}  load average")
    for layers in ns.layers:
        for _ in range(ns.repeat):
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            wall, inner, rss, peak, calls = one(layers)
            print(f"{layers:>6} {wall:>7.1f} {inner:>12.1f} {rss:>12.0f} "
                  f"{peak / (1 << 30):>10,.0f} {calls:>15}  {load}")


if __name__ == "__main__":
    main()
