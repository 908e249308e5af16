"""How long ``opcontracts check-dump`` takes on a dump of 8 ranks x 1,000 APIs, or on one big
dump.json, and how much memory.

    python benchmarks/bench_check_dump.py [--ranks 8] [--apis 1000] [--repeat 3]
    python benchmarks/bench_check_dump.py --size 1G [--keep DIR]

The synthetic dump is made from the committed real one (tests/data/msprobe/stats_wrong, step 0,
rank 0: msprobe's own entries and stack.json), its entries repeated with their counts
renumbered (``Tensor.__mul__.41.forward``) until each rank holds ``--apis`` of them, about 1 in 10
of an op with a contract, as in the real dump.  Rows: the whole command in a fresh process
(importing torch, loading the shipped contracts and the digest, reading 8 x 1,000 entries,
judging, printing) beside a process that only imports torch, and ``check_path`` in this process once warm (reading and judging only),
best of ``--repeat``.

``--size 1G`` writes one rank's ``dump.json`` of that size (``500M``, ``1G``, ``2G``: bytes of
the file) in a temporary folder, in msprobe's layout at level ``mix``: the committed entries
repeated with their counts renumbered, with a module entry (``Module.layers.N....forward.0``)
per layer and ``stack.json`` grouping each API's calls as msprobe 8.x does; then runs
``opcontracts check-dump`` on it in a fresh process and prints its wall time, CPU time and peak
resident memory (``ru_maxrss`` of that child, from ``resource.getrusage``).  The file is written
a chunk at a time: the benchmark itself holds no dump in memory.
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


MODULE_ENTRY = {"input_args": [{"type": "torch.Tensor", "dtype": "torch.bfloat16",
                                "shape": [4, 8], "Max": 2.0, "Min": -2.0, "Mean": 0.01,
                                "Norm": 5.6, "requires_grad": True}],
                "input_kwargs": {}, "output": [{"type": "torch.Tensor", "dtype": "torch.bfloat16",
                                                "shape": [4, 8], "Max": 1.5, "Min": -1.5,
                                                "Mean": 0.02, "Norm": 4.4,
                                                "requires_grad": True}]}
STACK_GROUP = 1000
"""APIs per stack.json group (msprobe 8.x groups the APIs of one stack)"""


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def make_big_dump(root: Path, size: int) -> tuple[Path, int, int]:
    """One rank's dump.json of about ``size`` bytes (msprobe's layout, level mix); returns its
    path, its entries and how many of them are forward calls of an op with a contract."""
    data = json.loads((SRC / "dump.json").read_text())
    frames = json.loads((SRC / "stack.json").read_text())["0"][1]
    entries = [(name.rsplit(".", 2), "\n  ".join(json.dumps(e, indent=1).splitlines()))
               for name, e in data["data"].items()]
    module = "\n  ".join(json.dumps(MODULE_ENTRY, indent=1).splitlines())
    folder = root / "step0" / "rank0"
    folder.mkdir(parents=True)
    path = folder / "dump.json"
    counts: dict[str, int] = {}
    groups: dict[str, list[str]] = {}
    n = ours = layer = group_id = 0
    with open(path, "w", encoding="utf-8") as f, \
            open(folder / "stack.json", "w", encoding="utf-8") as st:
        st.write("{")

        def flush(key: str) -> None:
            nonlocal group_id
            st.write(("," if group_id else "") + f"\n {json.dumps(str(group_id))}: " +
                     json.dumps([groups.pop(key), frames]))
            group_id += 1

        f.write('{\n "task": "statistics",\n "level": "mix",\n "framework": "pytorch",\n '
                '"dump_data_dir": null,\n "data": {')
        written = f.tell()
        while written < size:
            parts = [f'\n  "Module.layers.{layer}.mlp.MoELayer.forward.0": {module}']
            layer += 1
            for (base, _, direction), text in entries:
                k = counts[base + direction] = counts.get(base + direction, -1) + 1
                name = f"{base}.{k}.{direction}"
                parts.append(f'\n  "{name}": {text}')
                ours += direction == "forward" and base.startswith(("NPU.", "MindSpeed."))
                group = groups.setdefault(base + direction, [])
                group.append(name)
                if len(group) >= STACK_GROUP:
                    flush(base + direction)
            chunk = ("," if n else "") + ",".join(parts)
            n += len(parts)
            f.write(chunk)
            written += len(chunk)
        f.write("\n }\n}\n")
        for key in list(groups):
            flush(key)
        st.write("\n}\n")
    return path, n, ours


def big(ns: argparse.Namespace) -> int:
    size = _size(ns.size)
    with tempfile.TemporaryDirectory(dir=ns.keep) as tmp:
        t0 = time.perf_counter()
        path, n, ours = make_big_dump(Path(tmp), size)
        made = time.perf_counter() - t0
        actual = path.stat().st_size
        print(f"dump.json: {actual / 2**20:,.0f} MiB ({actual:,} bytes), {n:,} entries "
              f"({ours:,} forward calls of an op with a contract), level mix; written in "
              f"{made:.0f} s")
        t0, c0 = time.perf_counter(), _child_cpu()
        done = subprocess.run([sys.executable, "-m", "opcontracts", "check-dump", tmp,
                               "--json", str(Path(tmp) / "findings.json")],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        cpu = _child_cpu() - c0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB -> MiB
        if done.returncode not in (0, 1):
            print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
            return 2
        found = json.loads((Path(tmp) / "findings.json").read_text())
    print(f"  {found['checked']:,} call(s) judged, {len(found['findings'])} finding(s), "
          f"exit status {done.returncode}")
    print(f"opcontracts check-dump, fresh process: {wall:.1f} s wall, {cpu:.1f} s CPU, "
          f"peak RSS {peak:,.0f} MiB")
    print(f"  {actual / 2**20 / wall:.1f} MiB/s of dump.json; peak RSS / file size = "
          f"{peak * 2**20 / actual:.2f}")
    return 0


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--apis", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--size", metavar="SIZE", help="one big dump.json of SIZE (1G, 500M) "
                   "instead: time and peak memory of check-dump on it")
    p.add_argument("--keep", metavar="DIR", help="with --size: the folder for the temporary "
                   "dump (default: the system's temporary folder)")
    ns = p.parse_args(argv)
    if ns.size:
        return big(ns)
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
