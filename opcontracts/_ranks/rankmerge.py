"""One end-of-run summary for a whole ``torchrun`` job: every rank hands rank 0 what it saw.

``opcontracts run`` under torchrun used to print N copies of its summary, interleaved.  Now each
rank puts its part (violations, what was checked, the sentinel's and the compare's findings) in
a key-value store and rank 0 prints one merged summary.  A collective at exit would hang the job
when a rank died, so this uses the store of the job instead, with a bound:

* the default process group's store while the script's process group is still up;
* otherwise, under torchrun's agent-hosted store (``TORCHELASTIC_USE_AGENT_STORE=True``, the
  default of ``torchrun``), a client of that store at ``MASTER_ADDR:MASTER_PORT``: it outlives
  the workers' process groups.

The other ranks write and leave at once; rank 0 waits at most ``timeout`` seconds
(``OPCONTRACTS_MERGE_TIMEOUT``, default 15) and merges what arrived, naming the ranks that did
not report.  Without a reachable store (a job without torchrun and without a process group at
exit) ``exchange`` returns None and each rank reports for itself.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

__all__ = ["exchange", "timeout"]

_KEY = "opcontracts/run-summary"


def timeout() -> float:
    raw = os.environ.get("OPCONTRACTS_MERGE_TIMEOUT", "").strip()
    try:
        return max(float(raw), 0.0) if raw else 15.0
    except ValueError:
        return 15.0


def _store(world: int) -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not dist.is_available():
        return None
    if dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a backend without a store: fall through
            pass
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and host and port.isdigit():
        try:
            return dist.TCPStore(host, int(port), world, is_master=False,
                                 timeout=timedelta(seconds=10))
        except Exception:  # noqa: BLE001 - the agent is gone: each rank reports itself
            return None
    return None


def _prefix() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_KEY}/{run}/{restart}/"


def exchange(payload: dict[str, Any], rank: int, world: int) -> list[dict[str, Any]] | None:
    """Hand ``payload`` to rank 0.  On rank 0: every rank's payload that arrived within the
    timeout (its own first), each with its ``rank``; on the others: ``[]``.  None when no store
    can be reached (then nothing was exchanged)."""
    store = _store(world)
    if store is None:
        return None
    prefix = _prefix()
    try:
        store.set(prefix + str(rank), json.dumps({**payload, "rank": rank}))
    except Exception:  # noqa: BLE001 - the store went away: report for ourselves
        return None
    if rank != 0:
        return []
    keys = [prefix + str(r) for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout()))
    except Exception:  # noqa: BLE001 - some rank did not report in time: merge the rest
        pass
    out = []
    for k in keys:
        try:
            if store.check([k]):
                out.append(json.loads(store.get(k)))
        except Exception:  # noqa: BLE001 - one unreadable part must not lose the others
            continue
    return out
