"""Cost of the emulated ``npu`` device (``emulation.install(device=True)``) per op.

    python benchmarks/bench_device.py [--quick]

Every op on npu tensors goes through the device's Python kernels: the boxed fallback for ATen
ops, the same ``call_on_cpu`` for the emulated fused ops (each npu argument seen as a CPU
tensor over the same memory, the op run on CPU, each result handed out as an npu tensor).
Rows, best-of-N microseconds per call on small tensors, cpu vs npu and their ratio:

* ``aten.add`` of two (64, 64) fp32 tensors;
* ``aten.mm`` of two (64, 64) fp32 tensors;
* ``npu_swiglu`` of a (64, 128) bf16 tensor (an emulated fused op);
* ``npu_moe_token_unpermute`` of (64, 32) bf16 tokens with top-2 bf16 probs;
* forward + backward of ``nn.Linear(64, 64)`` (backward on the engine's worker thread on npu).

Also, with the device installed: the guarded ``npu_swiglu`` on npu tensors (the patch's check
plus the device), and the mode lookup a contextless thread makes while a ``mode()`` context is
active elsewhere (``_modes._LAUNCHER``) against the plain process-wide state.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch


def best_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """The best of ``repeat`` runs: other load on a shared machine only ever adds time."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    ns = p.parse_args(argv)
    number, repeat = (20, 3) if ns.quick else (300, 7)

    from opcontracts import emulation

    torch.set_num_threads(1)  # one intra-op thread: a shared machine's other load decides less
    emulation.install("narrow", device=True)
    import torch_npu

    torch.manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    tokens = torch.randn(64, 32, dtype=torch.bfloat16)
    indices = torch.randint(0, 8, (32, 2))
    probs = torch.rand(32, 2).to(torch.bfloat16)
    _, sorted_indices = torch_npu.npu_moe_token_permute(tokens[:32], indices)
    lin = torch.nn.Linear(64, 64)
    lin_npu = torch.nn.Linear(64, 64).npu()
    an, bn, xn = a.npu(), b.npu(), x.npu()
    tn, sn, pn = tokens.npu(), sorted_indices.npu(), probs.npu()
    ops = torch.ops.npu

    def train(layer: torch.nn.Module, inp: torch.Tensor) -> None:
        layer(inp).sum().backward()

    rows: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("aten.add (64x64 fp32)", lambda: a + b, lambda: an + bn),
        ("aten.mm (64x64 fp32)", lambda: a @ b, lambda: an @ bn),
        ("npu_swiglu (64x128 bf16)", lambda: ops.npu_swiglu(x), lambda: ops.npu_swiglu(xn)),
        ("npu_moe_token_unpermute (64x32 bf16, top-2)",
         lambda: ops.npu_moe_token_unpermute(tokens, sorted_indices, probs),
         lambda: ops.npu_moe_token_unpermute(tn, sn, pn)),
        ("nn.Linear(64, 64) forward + backward", lambda: train(lin, a),
         lambda: train(lin_npu, an)),
    ]
    print(f"{'op':<46} {'cpu us':>9} {'npu us':>9} {'ratio':>7}")
    for name, on_cpu, on_npu in rows:
        c, n = best_us(on_cpu, number, repeat), best_us(on_npu, number, repeat)
        print(f"{name:<46} {c:9.1f} {n:9.1f} {n / c:6.1f}x")

    import opcontracts
    import opcontracts.patch as patch
    from opcontracts._lang import modes as _modes

    patch.apply()
    guarded = torch_npu.npu_swiglu
    g = best_us(lambda: guarded(xn), number, repeat)
    print(f"{'guarded npu_swiglu on npu tensors':<46} {'':>9} {g:9.1f}")
    plain = best_us(lambda: _modes._process_state.default, number * 10, repeat)
    with opcontracts.mode("strict"):
        launcher = _modes._global_state
        resolved = best_us(lambda: launcher.default, number * 10, repeat)
    print(f"mode lookup on a contextless thread: {plain * 1000:.0f} ns plain, "
          f"{resolved * 1000:.0f} ns while a mode() context is active elsewhere")
    patch.unpatch()
    emulation.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
