"""The distributed machinery of ``opcontracts demo --ranks N``: processes, FSDP, collectives.

What the demo needs to run its training step the way the incident's job ran it (several ranks,
the model sharded per transformer block), and nothing about the story itself (``demo.py``):

* ``launch``: N processes on this machine through torch's elastic launcher
  (``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs), the rendezvous on
  ``localhost:0`` (the OS picks a free port when the store binds it, so no port is guessed and
  none can clash; one retry all the same if the launch dies of "address already in use"), no
  restarts (a failed demo must not run four times), each rank's return value back to the caller;
* ``under_launcher``: whether this process already is a rank (``torchrun``: ``RANK`` and
  ``WORLD_SIZE`` in the environment), so the demo runs in place instead of spawning;
* ``process_group``: the gloo group (CPU), a bounded timeout so that a rank that dies mid-step
  cannot hang the others for the default 30 minutes, one compute thread per rank's share of the
  cores (four ranks with two threads each on two cores ran 3x slower than with one);
* ``shard``: FSDP1 (``FullyShardedDataParallel`` with an auto-wrap policy on the block class,
  ``device_id=cpu``: flat parameters, module paths with ``_fsdp_wrapped_module``) or FSDP2
  (``fully_shard`` per block, then the root: DTensor parameters, names unchanged);
* ``local_grads``, ``all_sum``, ``all_max``, ``all_gather``: this rank's gradient shards and
  the few collectives that make per-rank numbers global.  Gathering objects reuses the
  report's transport (``_ranks.gather._all_gather_payloads``), not a second one.

torch is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["LaunchError", "all_gather", "all_max", "all_sum", "launch", "local_grads",
           "process_group", "shard", "under_launcher"]

TIMEOUT_S = 300.0
"""collectives give up after this long (a rank that died mid-step leaves the others waiting)"""


class LaunchError(RuntimeError):
    """The ranks could not be started, or one of them failed."""


def under_launcher() -> int | None:
    """The world size when this process was started as one rank of a job (``torchrun`` sets
    ``RANK`` and ``WORLD_SIZE``), else None."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isdigit() and world.isdigit() and int(world) >= 1:
        return int(world)
    return None


def _port_clash(text: str) -> bool:
    t = text.lower()
    return "address already in use" in t or "eaddrinuse" in t


def launch(nprocs: int, entrypoint: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nprocs`` new processes, one rank each; their return values
    by rank.  ``entrypoint`` must be importable by name (the processes are spawned, not
    forked: a forked child would inherit this process's threads and locks).  Raises
    ``LaunchError`` when a rank fails, with the first failure's message."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for attempt in (1, 2):
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
            rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # what torchrun --standalone does
            run_id=f"opcontracts-demo-{uuid.uuid4().hex[:12]}",
            max_restarts=0, monitor_interval=0.05, start_method="spawn")
        try:
            return elastic_launch(config, entrypoint)(*args)  # type: ignore[no-any-return]
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            text = str(failure.message or f"exit code {failure.exitcode}")
            if attempt == 1 and _port_clash(text):
                continue
            raise LaunchError(f"rank {rank} failed: {text}") from None
        except (RuntimeError, OSError) as exc:  # the launcher's own store, before any rank ran
            if attempt == 1 and _port_clash(str(exc)):
                continue
            raise LaunchError(f"could not start {nprocs} rank(s): {exc}") from exc
    raise AssertionError("unreachable")  # pragma: no cover


@contextlib.contextmanager
def process_group(timeout_s: float = TIMEOUT_S) -> Iterator[tuple[int, int]]:
    """(rank, world size) inside a gloo process group: the job's own when one is initialized
    (left alone afterwards), else one made from the launcher's environment and destroyed on
    exit.  Without ``OMP_NUM_THREADS`` each rank computes on its share of the cores."""
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")) or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    if dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size()
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    done = False
    try:
        yield dist.get_rank(), dist.get_world_size()
        done = True
    finally:
        # what still holds the group (a sharded model's state, a finished collective's work
        # and its tensors) goes first, while the interpreter is whole, and the ranks leave
        # together: a gloo group torn down at interpreter exit aborted a rank now and then
        # ("terminate called without an active exception") after the job had succeeded
        # (about 1 FSDP2 demo in 10 on a 2-core machine; none in 30 since).  No barrier after
        # a failure: the other ranks may never reach it.
        gc.collect()
        if done:
            dist.barrier()
        dist.destroy_process_group()


FSDP2_NEEDS = "2.6"
"""the first torch whose ``torch.distributed.fsdp`` has the public ``fully_shard`` (FSDP2); the
package itself needs torch 2.4 (``torch.library.register_fake``), and the demo's --fsdp 2 says
so on an older one rather than raising the floor for everyone"""


def fsdp2_missing() -> str | None:
    """Why ``--fsdp 2`` cannot run with this torch, or None."""
    import torch
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "fully_shard"):
        return None
    return (f"--fsdp 2 needs torch >= {FSDP2_NEEDS} (the public "
            f"torch.distributed.fsdp.fully_shard); this is torch {torch.__version__}: use "
            "--fsdp 1 (FullyShardedDataParallel), or a newer torch")


def shard(model: Any, block: type[Any], fsdp: int) -> Any:
    """``model`` sharded with FSDP ``fsdp`` (1 or 2), one unit per ``block`` instance plus the
    root; returns the module to call (FSDP1 wraps, FSDP2 changes the module in place)."""
    import torch

    if fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}),
                                        device_id=torch.device("cpu"))
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for m in [m for m in model.modules() if isinstance(m, block)]:
            fully_shard(m)
        fully_shard(model)
        return model
    raise ValueError(f"fsdp must be 1 or 2, not {fsdp!r}")


def local_grads(model: Any) -> dict[str, Any]:
    """This rank's shard of every parameter's gradient, as fp32 (zeros where none arrived):
    FSDP1's flat parameters hold their shard as a plain tensor, FSDP2's DTensor gradients
    give theirs through ``to_local()``.  Summed over ranks, shards add up to whole-model
    numbers; FSDP1's padding is zero in every run, so it adds nothing."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        g = p.grad
        if g is None:
            out[name] = torch.zeros(local.shape, dtype=torch.float32)
            continue
        if isinstance(g, DTensor):
            g = g.to_local()
        out[name] = g.detach().float()
    return out


def all_sum(values: Sequence[float]) -> list[float]:
    """``values`` summed over the ranks (float64; NaN and inf propagate)."""
    return _all_reduce(values, "sum")


def all_max(values: Sequence[float]) -> list[float]:
    """The largest of each value over the ranks (pass NaN-free values: gloo's max does not
    promise to propagate NaN)."""
    return _all_reduce(values, "max")


def _all_reduce(values: Sequence[float], how: str) -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if how == "sum" else dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def all_gather(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``payload`` (JSON-able data), in rank order, on every rank."""
    import torch.distributed as dist

    from .._ranks.gather import _all_gather_payloads

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [payload]
    return _all_gather_payloads(payload, None, dist.get_world_size())
