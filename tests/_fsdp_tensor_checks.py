"""Guards, the signature memo and fix mode on FSDP's own tensors, one rank of a torchrun job.

Run by ``tests/test_demo_fsdp.py`` as
``torchrun --standalone --nproc-per-node 2 tests/_fsdp_tensor_checks.py OUT_DIR``; each rank
writes what it saw to ``OUT_DIR/rank{R}.json`` and the test asserts it.  Not a test module
itself (pytest collects ``test_*.py`` only).

What a guard can meet under FSDP, with a bf16 model on two ranks:

* in forward, the unsharded weights (FSDP1: plain-tensor views of the flat parameter; FSDP2:
  the unsharded ``nn.Parameter``), passed to a guarded function by a module's forward; the
  output feeds the loss, so fix mode's cast must carry the gradient back into FSDP's sharded
  gradient exactly as the user's own ``.float()`` does;
* outside forward, the sharded parameters (FSDP1: the 1-D ``FlatParameter`` shard; FSDP2: a
  ``DTensor`` whose shape is the global one) and their gradients (FSDP1: a plain tensor;
  FSDP2: a ``DTensor``).

Each check runs a guard twice where the memo could learn (the second call is the one a memo
answers) and then a violating call, which must still be caught.

FSDP1 only: autograd through the ``FlatParameter`` itself outside FSDP's forward is not done
here, with or without a guard: FSDP1 keeps the flat parameter's ``AccumulateGrad`` node, whose
shape is the unsharded one, and torch rejects a sharded-shape gradient into it ("Function
ToCopyBackward0 returned an invalid gradient at index 0 - got [72] but expected shape compatible
with [144]").  That is FSDP1's rule for every use of the flat parameter, not the guard's.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import opcontracts
from opcontracts import Arg, Contract, ContractViolation


def _w32(name: str) -> Any:
    """A guard that wants ``x`` and ``w`` in fp32, ``w`` of shape ``O H`` against ``x``'s H."""

    @opcontracts.enforce(Contract(f"t.{name}", {"x": Arg("fp32", "N H"), "w": Arg("fp32", "O H")},
                                  source="tests/_fsdp_tensor_checks.py"))
    def linear32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    return linear32


def _wants(dtype: str, shape: str, name: str) -> Any:
    @opcontracts.enforce(Contract(f"t.{name}", {"t": Arg(dtype, shape)},
                                  source="tests/_fsdp_tensor_checks.py"))
    def look(t: torch.Tensor) -> torch.Tensor:
        return t

    return look


class Head(nn.Module):
    """A bf16 weight that its forward hands to ``fn`` (a guard), or casts itself (``fn`` None:
    the user's own ``.float()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16) * 0.25)
        self.fn: Any = None
        self.seen: list[str] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.weight  # FSDP's unsharded weight while this module's forward runs
        self.seen.append(type(w).__name__)
        if self.fn is None:
            return h.float() @ w.float().t()
        return self.fn(h.float(), w)  # w bf16: fix mode casts it


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16, bias=False)
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).pow(2).mean()


def _model(fsdp: int) -> Any:
    """Net in bf16, sharded over the ranks: FSDP1 one unit per Linear and Head plus the root,
    FSDP2 ``fully_shard`` on each and the root."""
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    if fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear, Head}),
                                        device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    fully_shard(net.body)
    fully_shard(net.head)
    fully_shard(net)
    return net


def _head(model: Any) -> Head:
    return next(m for m in model.modules() if isinstance(m, Head))


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(model: Any) -> list[torch.Tensor]:
    return [_local(p.grad).detach().float().clone() for p in model.parameters()]


def _raises(fn: Any, *args: Any) -> list[Any] | None:
    """[argument, rule] of the ContractViolation a strict call raises, None if it passes."""
    try:
        with opcontracts.mode("strict"):
            fn(*args)
    except ContractViolation as exc:
        return [exc.arg, exc.rule]
    return None


def _memo_size(guard: Any) -> int:
    return sum(len(v) for v in getattr(guard, "__opcontracts_memo__", {}).values())


def check(fsdp: int, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)

    # in forward, fix mode: the same step with the user's own cast and with fix mode's cast
    ref_model = _model(fsdp)
    ref_model(x).backward()
    ref = _grads(ref_model)
    model = _model(fsdp)
    _head(model).fn = _w32(f"fix{fsdp}")
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).backward()
    got = _grads(model)
    out["forward_weight_type"] = _head(model).seen[-1]
    out["fix_warned"] = any(issubclass(w.category, opcontracts.ContractFixWarning)
                            for w in caught)
    out["fix_grads_equal"] = len(got) == len(ref) and all(
        torch.equal(a, b) for a, b in zip(got, ref))
    out["fix_grads_nonzero"] = all(bool(torch.isfinite(g).all()) for g in got) and all(
        bool(g.abs().sum() > 0) for g in got)
    out["param_dtypes_after_fix"] = sorted({str(p.dtype) for p in model.parameters()})

    # in forward, strict: the bf16 weight is a violation (a fresh model: FSDP's state after an
    # exception inside its forward is not for reuse)
    strict_model = _model(fsdp)
    _head(strict_model).fn = _w32(f"strict{fsdp}")
    out["strict_forward"] = _raises(strict_model, x)

    # in forward, conforming: a bf16 guard learns the weight's metadata on the first forward
    # and answers the second from the memo; an fp32 weight of that shape after that is caught
    look = _wants("bf16", "O H", f"look{fsdp}")
    _head(model).fn = lambda h, w: h @ look(w).float().t()
    with opcontracts.mode("strict"), torch.no_grad():
        model(x)
        learnt = _memo_size(look)
        model(x)
    out["memo_forward"] = [learnt, _memo_size(look)]
    out["memo_forward_then_violation"] = _raises(look, torch.zeros(8, 16))

    # outside forward: a sharded parameter (FSDP1 a flat parameter's shard, FSDP2 a DTensor)
    p = list(ref_model.parameters())[-1]
    out["param_type"] = type(p).__name__ + (" (flat)" if getattr(p, "_is_flat_param", False)
                                            else "")
    out["param_shape"] = list(p.shape)
    out["param_local_shape"] = list(_local(p).shape)
    shape = "N" if p.dim() == 1 else "O H"
    bf16 = _wants("bf16", shape, f"p{fsdp}")
    out["param_conforming"] = [_raises(bf16, p), _raises(bf16, p)]
    out["memo_param"] = _memo_size(bf16)
    out["param_then_violation"] = _raises(bf16, p.detach().float())
    out["param_wrong_dtype"] = _raises(_wants("fp32", shape, f"p32{fsdp}"), p)
    # ... and its gradient (FSDP1 a plain tensor, FSDP2 a DTensor)
    g = p.grad
    out["grad_type"] = type(g).__name__
    out["grad_conforming"] = _raises(_wants("bf16", shape, f"g{fsdp}"), g)
    out["grad_wrong_dtype"] = _raises(_wants("fp32", shape, f"g32{fsdp}"), g)
    if fsdp == 2:  # a DTensor parameter through fix mode outside forward: its own gradient
        fixed = _wants("fp32", "O H", "dfix")
        p.grad = None
        with opcontracts.mode("fix"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (fixed(p) * 3).sum().backward()
        mine = _local(p.grad).float().clone()
        p.grad = None
        (p.float() * 3).sum().backward()
        out["dtensor_fix_grad_equal"] = bool(torch.equal(mine, _local(p.grad).float()))
        out["dtensor_fix_grad_type"] = type(p.grad).__name__
    return out


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = {"rank": rank, "fsdp1": check(1, rank), "fsdp2": check(2, rank)}
    finally:
        dist.destroy_process_group()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
