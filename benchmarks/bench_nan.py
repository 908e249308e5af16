"""Cost of the NaN sentinel (``opcontracts.nan``) per guarded call, and on a training step.

    python benchmarks/bench_nan.py [--quick]

Off, the sentinel costs nothing: nothing of it is installed (the guards are the patch's own
objects again, checked here).  On, per guarded call it leaves each floating tensor argument's
and output's ``aminmax`` on the device (read once, at the end: ``benchmarks/bench_accelerator.py``
counts the host reads), keeps the call site as code + line, reads the ``nn.Module`` path off
the frames, and, with grad enabled, adds a probe node and one shared pre-hook per output node.

Rows, best-of-N ns per call on small CPU tensors (shared machines are noisy: the best run is
the least disturbed one):

* a patched op (``x * w``, a (64, 64) fp32 tensor) in strict mode, sentinel off / on, without
  and with grad;
* the forward + backward of three such calls in a row, sentinel off / on;
* an ``nn.Linear(64, 64)`` module call, sentinel off / on (no module hooks any more: ~0 added);
* the demo's training step (``opcontracts demo``'s unguarded run: 3 MoE layers), off / on.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch
from _guarded_scale import guarded_scale


def best_ns(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """The best of ``repeat`` runs: other load on a shared machine only ever adds time."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    ns = p.parse_args(argv)
    number, repeat = (100, 5) if ns.quick else (1000, 9)

    import opcontracts
    import opcontracts.patch as patch
    from opcontracts.nan import NanSentinel

    op = guarded_scale("bench_nan_ops")
    mod, guard, x, w, xg, wg, chain = op.mod, op.mod.scale, op.x, op.w, op.xg, op.wg, op.chain
    lin = torch.nn.Linear(64, 64)

    def rows_for(tag: str) -> dict[str, float]:
        r: dict[str, float] = {}
        with opcontracts.mode("strict"):
            with torch.no_grad():
                r[f"guarded op, no grad, {tag}"] = best_ns(lambda: mod.scale(x, w), number,
                                                              repeat)
            r[f"guarded op, grad (forward), {tag}"] = best_ns(lambda: mod.scale(xg, wg),
                                                                number, repeat)
            r[f"3 guarded ops, forward + backward, {tag}"] = best_ns(chain, number // 4 or 1,
                                                                       repeat)
        r[f"nn.Linear(64, 64) call, {tag}"] = best_ns(lambda: lin(x), number, repeat)
        return r

    rows = rows_for("sentinel off")
    with NanSentinel():
        assert mod.scale is not guard
        rows.update(rows_for("sentinel on"))
    assert mod.scale is guard, "disable did not restore the guard"
    rows.update(demo_step(max(3, repeat // 2)))
    patch.unpatch()
    op.close()

    print(f"{'row':48s} {'best ns':>12s}")
    for name, v in rows.items():
        print(f"{name:48s} {v:12.0f}")
    print()
    for what in ("guarded op, no grad", "guarded op, grad (forward)",
                 "3 guarded ops, forward + backward", "nn.Linear(64, 64) call"):
        d = rows[f"{what}, sentinel on"] - rows[f"{what}, sentinel off"]
        print(f"sentinel on, {what}: +{d / 1000:.1f} us")
    a, b = rows["demo step, sentinel off"], rows["demo step, sentinel on"]
    print(f"demo training step: {a / 1e6:.1f} ms -> {b / 1e6:.1f} ms (x{b / a:.2f})")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, opcontracts {opcontracts.__version__}")
    return 0


def demo_step(repeat: int) -> dict[str, float]:
    """The demo's unguarded training step, without and with the sentinel."""
    import opcontracts
    from opcontracts._tools import demo
    from opcontracts.nan import NanSentinel

    out: dict[str, float] = {}
    with demo._environment() as model_mod:
        batch = demo._batch(0)

        def step() -> None:
            with opcontracts.mode("off"):
                demo._train_step(model_mod, 0, batch, fused=True)

        step()  # warm up
        out["demo step, sentinel off"] = best_ns(step, 1, repeat)
        with NanSentinel():
            out["demo step, sentinel on"] = best_ns(step, 1, repeat)
    return out


if __name__ == "__main__":
    sys.exit(main())
