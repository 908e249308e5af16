"""How long ``opcontracts check-dump`` takes on a dump of 8 ranks x 1,000 APIs.

    python benchmarks/bench_check_dump.py [--ranks 8] [--apis 1000] [--repeat 3]

The synthetic dump is made from the committed real one (tests/data/msprobe/stats_wrong, step 0,
rank 0: msprobe's own entries and stack.json), its entries repeated with their counts
renumbered (``Tensor.__mul__.41.forward``) until each rank holds ``--apis`` of them, about 1 in 10
of an op with a contract, as in the real dump.  Rows: the whole command in a fresh process
(importing torch, loading the shipped contracts and the digest, reading 8 x 1,000 entries,
judging, printing) beside a process that only imports torch, and ``check_path`` in this process once warm (reading and judging only),
best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "tests" / "data" / "msprobe" / "stats_wrong" / \
    "step0" / "rank0"


def make_dump(root: Path, ranks: int, apis: int) -> int:
    """Write the synthetic dump; returns how many entries are of an op with a contract."""
    data = json.loads((SRC / "dump.json").read_text())
    frames = json.loads((SRC / "stack.json").read_text())["0"][1]
    entries = list(data["data"].items())
    ours = 0
    for rank in range(ranks):
        out: dict[str, object] = {}
        counts: dict[str, int] = {}
        i = 0
        while len(out) < apis:
            name, entry = entries[i % len(entries)]
            i += 1
            base, _, direction = name.rsplit(".", 2)
            n = counts[base + direction] = counts.get(base + direction, -1) + 1
            out[f"{base}.{n}.{direction}"] = entry
            ours += rank == 0 and name.startswith(("NPU.", "MindSpeed."))
        folder = root / "step0" / f"rank{rank}"
        folder.mkdir(parents=True)
        (folder / "dump.json").write_text(json.dumps({**data, "data": out}, indent=1))
        (folder / "stack.json").write_text(json.dumps({"0": [list(out), frames]}, indent=1))
    return ours


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--apis", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ours = make_dump(Path(tmp), ns.ranks, ns.apis)
        cold, base, cold_cpu, base_cpu = [], [], [], []
        for _ in range(ns.repeat):
            t0, c0 = time.perf_counter(), _child_cpu()
            subprocess.run([sys.executable, "-c", "import torch"], check=True)
            base.append(time.perf_counter() - t0)
            base_cpu.append(_child_cpu() - c0)
            t0, c0 = time.perf_counter(), _child_cpu()
            done = subprocess.run([sys.executable, "-m", "opcontracts", "check-dump", tmp],
                                  capture_output=True, text=True)
            cold.append(time.perf_counter() - t0)
            cold_cpu.append(_child_cpu() - c0)
            if done.returncode not in (0, 1):
                print(done.stderr, file=sys.stderr)
                return 2
        from opcontracts._tools.check_dump import check_path, environment

        env = environment()
        check_path(tmp, env)  # warm: contracts loaded, checkers compiled
        warm = []
        for _ in range(ns.repeat):
            t0 = time.perf_counter()
            result = check_path(tmp, env)
            warm.append(time.perf_counter() - t0)
    print(f"dump: {ns.ranks} rank(s) x {ns.apis} API entries ({ours} per rank of an op with a "
          f"contract); {result.checked} call(s) judged, {len(result.findings)} finding(s)")
    print(f"opcontracts check-dump, fresh process:  {min(cold):.2f} s wall, {min(cold_cpu):.2f} s "
          f"CPU (best of {ns.repeat})")
    print(f"  python -c 'import torch' alone:       {min(base):.2f} s wall, {min(base_cpu):.2f} s "
          f"CPU")
    print(f"check_path, warm, in process:           {min(warm):.2f} s (best of {ns.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
