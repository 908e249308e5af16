"""Make the msprobe dumps under tests/data/msprobe/ with mindstudio-probe itself.

How to refresh them (msprobe is not a dependency of opcontracts: use a scratch venv)::

    python -m venv --system-site-packages /tmp/msprobe-venv
    /tmp/msprobe-venv/bin/pip install mindstudio-probe==26.2.0
    /tmp/msprobe-venv/bin/pip install -e . --no-deps          # this checkout's opcontracts
    /tmp/msprobe-venv/bin/python tests/data/msprobe/make_dumps.py

(``... make_dumps.py stats_wrong`` refreshes one, ``--out DIR`` writes elsewhere.)  It writes four dumps
next to itself, of a tiny MoE layer (``npu_rms_norm``, a router in fp32, the fused permute /
unpermute, two experts in bf16, plain PyTorch around them), one training step each unless said,
on two ranks (two processes, a gloo process group on the CPU), as msprobe writes them
(``DUMP/step{N}/rank{R}/dump.json``, ``stack.json``, ``construct.json``):

* ``stats_wrong``: statistics mode, two steps, the incident's call: the router's fp32 ``probs``
  handed to MindSpeed's fused unpermute (``MindSpeed.npu_moe_token_unpermute.0.forward``;
  MindSpeed's kernel takes bf16 only);
* ``stats_clean``: the same with the one-line fix (``probs.to(torch.bfloat16)``);
* ``tensor_wrong``: the wrong call in tensor mode.  msprobe also writes every tensor as a
  ``.pt`` file under ``dump_tensor_data/``; those are left out (opcontracts reads only the
  json files; the ``data_name`` entries still name them);
* ``stats_npu``: the wrong call through torch_npu's own ops, called directly as MindSpeed's
  FSDP expert parallel does (``NPU.npu_moe_token_unpermute.0.forward``): whether fp32 probs are
  wrong there depends on the CANN version.

The emulated kernels' backward is Python, so msprobe also records the ``Tensor.*`` calls inside
it (on a device the backward is C++ and they do not appear); they are ``Tensor.*`` entries like
any other, which check-dump counts and skips.

The opcontracts CPU emulation (``opcontracts.emulation.install("incident")``) is installed
BEFORE msprobe is imported: msprobe decides at import whether it is on an NPU (``import
torch_npu`` succeeds: the stand-in module), and then wraps torch_npu's ops (dumped as
``NPU.<op>.<n>.<forward|backward>``) and MindSpeed's (``MindSpeed.*``) as on a real machine.
The patch (``opcontracts.patch``) is not applied: the dumps are what a job without opcontracts
records.  The model file is this one; stack.json frames point at its lines.

About 7 s per dump on two cores.  The dumps are deterministic (seeded); the absolute paths
msprobe writes (``dump_data_dir``, this checkout's files in ``stack.json``) are made relative
to the repository root.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENS, HIDDEN, EXPERTS, TOPK = 4, 8, 2, 2


def _model(torch, nn, flavor: str, cast_probs: bool):  # type: ignore[no-untyped-def]
    """The user's model: RMSNorm (torch_npu), a router in fp32, the fused permute / unpermute
    (MindSpeed's, or torch_npu's called directly as MindSpeed's FSDP expert parallel does),
    experts in bf16.  The ops are looked up at each call, as msprobe needs: it wraps the
    module attributes at ``start()``, so a name bound by ``from ... import`` before is not seen."""
    import mindspeed.ops.npu_moe_token_permute as ms_permute
    import mindspeed.ops.npu_moe_token_unpermute as ms_unpermute
    import torch_npu

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16))
            self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
            self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False)
                                         for _ in range(EXPERTS))

        def forward(self, tokens):  # type: ignore[no-untyped-def]
            x = torch_npu.npu_rms_norm(tokens, self.norm, epsilon=1e-6)[0]
            logits = self.router(x.float())
            probs, indices = torch.topk(torch.softmax(logits, dim=-1), TOPK, dim=-1)
            if flavor == "mindspeed":
                permuted, sorted_indices = ms_permute.npu_moe_token_permute(x, indices)
            else:
                permuted, sorted_indices = torch_npu.npu_moe_token_permute(x, indices)
            counts = torch.bincount(indices.reshape(-1), minlength=EXPERTS).tolist()
            out = torch.cat([e(c) for e, c in zip(self.experts, permuted.split(counts))])
            if cast_probs:
                probs = probs.to(torch.bfloat16)  # the fix
            if flavor == "mindspeed":  # the incident: fp32 probs
                return ms_unpermute.npu_moe_token_unpermute(out, sorted_indices, probs)
            return torch_npu.npu_moe_token_unpermute(out, sorted_indices, probs)

    model = MoE()
    model.experts.to(torch.bfloat16)
    return model


def _rank(rank: int, world: int, port: int, task: str, flavor: str, wrong: bool, steps: int,
          out: str) -> None:
    from opcontracts import emulation

    emulation.install("incident")  # before msprobe: it then takes its NPU path
    import torch
    import torch.distributed as dist
    from msprobe.pytorch import PrecisionDebugger
    from torch import nn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _model(torch, nn, flavor, not wrong)
    config = {"task": task, "dump_path": out, "rank": [], "step": [], "level": "L1",
              task: {"scope": [], "list": [], "data_mode": ["all"]}}
    cfg = Path(out) / f"config.rank{rank}.json"
    cfg.write_text(json.dumps(config))
    debugger = PrecisionDebugger(config_path=str(cfg))
    torch.manual_seed(1 + rank)
    for _ in range(steps):
        tokens = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16).requires_grad_()
        debugger.start(model=model)
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        debugger.stop()
        debugger.step()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make(name: str, task: str, flavor: str, wrong: bool, steps: int, out: Path = HERE) -> Path:
    """One dump: run the two ranks in a temporary folder, copy its ``step*`` folders to
    ``out/name`` (tensor files dropped, the checkout's absolute path made relative)."""
    import torch.multiprocessing as mp

    dest = out / name
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, _free_port(), task, flavor, wrong, steps, tmp), nprocs=2,
                 join=True)
        shutil.rmtree(dest, ignore_errors=True)
        for step in sorted(Path(tmp).glob("step*")):
            shutil.copytree(step, dest / step.name,
                            ignore=lambda d, names: [n for n in names if n.endswith((".pt", ".npy"))])
        root = str(HERE.parents[2]) + os.sep
        for path in [*dest.glob("step*/rank*/dump.json"), *dest.glob("step*/rank*/stack.json")]:
            path.write_text(path.read_text().replace(tmp, str(dest)).replace(root, ""))
    return dest


DUMPS = {  # name: (task, flavor, wrong call, steps)
    "stats_wrong": ("statistics", "mindspeed", True, 2),
    "stats_clean": ("statistics", "mindspeed", False, 1),
    "tensor_wrong": ("tensor", "mindspeed", True, 1),
    "stats_npu": ("statistics", "torch_npu", True, 1),
}


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Make the msprobe dumps of tests/data/msprobe/.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"dumps to make (default all: {', '.join(DUMPS)})")
    p.add_argument("--out", type=Path, default=HERE, help="folder to write them in (default: "
                   "next to this script, the committed test data)")
    ns = p.parse_args(argv)
    for name in ns.names:
        if name not in DUMPS:
            p.error(f"no dump {name!r} (choose from {', '.join(DUMPS)})")
    for name in ns.names or list(DUMPS):
        print(name, make(name, *DUMPS[name], out=ns.out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
