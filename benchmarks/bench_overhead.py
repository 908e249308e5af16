"""Per-call overhead of opcontracts, as ratios measured in one run.

    python benchmarks/bench_overhead.py [--quick]

Rows (median ns per call over many repeats; the machines are noisy, so read the ratios):
  * bare ``torch.add`` of two small CPU tensors (the yardstick)
  * the unpermute rules (3 tensors: dtype, rank, the ``N*K`` relation) written by
    hand as an ``if`` chain
  * the same rules through the generated checker, called directly (what a call with tensor
    metadata not seen before runs)
  * the same call answered by the signature memo (``opcontracts/_engine/memo.py``): the C++ check a
    guard learns from a conforming call and runs first on later calls (the steady state)
  * the whole guard of a decorated no-op function, minus the bare no-op call
  * jaxtyping + beartype on the same function, when both are installed
Further rows (patched op, off/fix modes, dispatcher mode, import time) are added by
``benchmarks/bench_patch.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch

import opcontracts
from opcontracts import Arg, Contract

BF16, I32 = torch.bfloat16, torch.int32
CONTRACT = Contract("bench_unpermute", {
    "permuted_tokens": Arg("bf16", "N*K H"),
    "sorted_indices": Arg("int32", "N*K"),
    "probs": Arg("bf16", "N K", optional=True),
})


def hand_written(permuted_tokens: Any, sorted_indices: Any, probs: Any = None) -> None:
    T = torch.Tensor
    if not isinstance(permuted_tokens, T) or permuted_tokens.dtype is not BF16:
        raise TypeError("permuted_tokens")
    s = permuted_tokens.shape
    if len(s) != 2:
        raise TypeError("permuted_tokens rank")
    nk = s[0]
    if not isinstance(sorted_indices, T) or sorted_indices.dtype is not I32:
        raise TypeError("sorted_indices")
    s = sorted_indices.shape
    if len(s) != 1 or s[0] != nk:
        raise TypeError("sorted_indices shape")
    if probs is not None:
        if not isinstance(probs, T) or probs.dtype is not BF16:
            raise TypeError("probs")
        s = probs.shape
        if len(s) != 2 or s[0] * s[1] != nk:
            raise TypeError("probs shape")


def noop(permuted_tokens: Any, sorted_indices: Any, probs: Any = None) -> None:
    return None


def median_ns(fn: Callable[[], Any], number: int, repeat: int) -> float:
    times = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(times) / number * 1e9


def rows(quick: bool = False) -> list[tuple[str, float]]:
    number, repeat = (2000, 7) if quick else (20000, 15)
    tokens = torch.randn(8, 16).to(BF16)
    idx = torch.randperm(8).to(I32)
    probs = torch.rand(4, 2).to(BF16)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    guarded = opcontracts.enforce(CONTRACT)(noop)
    check = guarded.__opcontracts__.check
    assert check(tokens, idx, probs) is None
    guarded(tokens, idx, probs)  # a conforming call: the guard learns its signature
    learnt = guarded.__opcontracts_memo__.get(3, ())
    memo = learnt[0] if learnt else None
    prev = opcontracts.set_mode("strict")
    try:
        out = [
            ("torch.add (4x4 fp32, CPU)", median_ns(lambda: torch.add(a, b), number, repeat)),
            ("hand-written if chain", median_ns(lambda: hand_written(tokens, idx, probs), number, repeat)),
            ("generated checker", median_ns(lambda: check(tokens, idx, probs), number, repeat)),
            ("signature memo (metadata seen before)",
             median_ns(lambda: memo(tokens, idx, probs), number, repeat) if memo else float("nan")),
            ("bare no-op call", median_ns(lambda: noop(tokens, idx, probs), number, repeat)),
            ("@enforce guard + no-op (strict)", median_ns(lambda: guarded(tokens, idx, probs), number, repeat)),
        ]
    finally:
        opcontracts.set_mode(prev)
    jb = _jaxtyping_row(tokens, idx, probs, number, repeat)
    if jb is not None:
        out.append(jb)
    return out


def _jaxtyping_row(tokens: Any, idx: Any, probs: Any, number: int, repeat: int
                   ) -> tuple[str, float] | None:
    try:
        import beartype  # noqa: F401
        from jaxtyping import BFloat16, Int32, jaxtyped
    except ImportError:
        return None
    from beartype import beartype as bt

    @jaxtyped(typechecker=bt)
    def f(permuted_tokens: BFloat16[torch.Tensor, "NK H"], sorted_indices: Int32[torch.Tensor, "NK"],  # noqa: F722,F821,UP037
          probs: BFloat16[torch.Tensor, "N K"] | None = None) -> None:  # noqa: F722
        return None

    return ("jaxtyping + beartype", median_ns(lambda: f(tokens, idx, probs), number, repeat))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    ns = p.parse_args(argv)
    r = dict(rows(ns.quick))
    add, hand, gen = r["torch.add (4x4 fp32, CPU)"], r["hand-written if chain"], r["generated checker"]
    overhead = r["@enforce guard + no-op (strict)"] - r["bare no-op call"]
    print(f"{'row':40s} {'median ns':>10s} {'/ torch.add':>12s}")
    for name, ns_ in r.items():
        print(f"{name:40s} {ns_:10.0f} {ns_ / add:12.2f}")
    print(f"{'guard overhead (guard - bare call)':40s} {overhead:10.0f} {overhead / add:12.2f}")
    print()
    print(f"generated checker / hand-written chain: {gen / hand:.2f}x (target <= 1.3)")
    print(f"generated checker / torch.add:          {gen / add:.2f}x (target < 0.5; a signature seen for the first time)")
    seen = r["signature memo (metadata seen before)"]
    print(f"signature memo / torch.add:             {seen / add:.2f}x (target < 0.5; every later call)")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, opcontracts {opcontracts.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
