"""Cost of checking a backward kernel at the dispatcher (``opcontracts._attach.kernels``).

    python benchmarks/bench_kernel_guard.py [--quick]

A backward kernel is reached from C++ (torch_npu's autograd nodes), so the patch guards it with
a Python kernel at its ``BackendSelect`` key instead of an attribute.  Rows, median ns per call
of a cheap backward op (``opcbench::scale_grad``, ``torch.mul`` behind it, a contract on both
arguments) called as a C++ node calls it (its ``OpOverload``), with ratios to a bare ``torch.add`` of two small CPU tensors measured
in the same run (the machines are noisy: read the ratios):

* unguarded (no patch): the op alone;
* kernel-guarded, mode ``off``: what the dispatcher route costs when nothing is checked (the
  Python kernel, the slot and the ``redispatch``);
* kernel-guarded, mode ``strict`` (a conforming call: the signature memo's hit);
* the same call under ``ContractDispatchMode`` (no patch), for comparison: a mode costs every
  op of the block a trip through Python, the kernel guard only the guarded op.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import torch


def median_ns(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    ns = p.parse_args(argv)
    number, repeat = (200, 5) if ns.quick else (2000, 11)

    import opcontracts
    from opcontracts import Arg, Contract, patch
    from opcontracts.dispatch import ContractDispatchMode

    # a cheap backward op of its own (an aten kernel behind it), so the route is what is timed
    lib = torch.library.Library("opcbench", "DEF")
    lib.define("scale_grad(Tensor grad, Tensor x) -> Tensor")
    lib.impl("scale_grad", torch.mul, "CompositeExplicitAutograd")
    opcontracts.register(Contract("scale_grad", {"grad": Arg("fp32", "N H"),
                                                 "x": Arg("fp32", "N H")},
                                  targets=["torch.ops.opcbench.scale_grad"]))
    op = torch.ops.opcbench.scale_grad.default  # held as a C++ node holds it
    g, x = torch.ones(4, 8), torch.ones(4, 8)

    def call() -> Any:
        return op(g, x)

    a, b = torch.ones(8), torch.ones(8)
    base = median_ns(lambda: torch.add(a, b), number, repeat)
    rows: list[tuple[str, float]] = []
    patch.unpatch()
    rows.append(("unguarded", median_ns(call, number, repeat)))
    patch.apply()
    assert any(r.kind == "kernel" and r.op == "scale_grad" for r in patch.patched())
    for mode in ("off", "strict"):
        with opcontracts.mode(mode):
            call()
            rows.append((f"kernel-guarded, mode {mode}", median_ns(call, number, repeat)))
    patch.unpatch()
    with opcontracts.mode("strict"), ContractDispatchMode():
        call()
        rows.append(("ContractDispatchMode, strict", median_ns(call, number, repeat)))
    print(f"torch.add (8 floats): {base:,.0f} ns")
    unguarded = rows[0][1]
    for name, ns_ in rows:
        print(f"{name:32s} {ns_:>10,.0f} ns  {ns_ / base:6.1f}x add  +{ns_ - unguarded:,.0f} ns")
    lib._destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
