"""A transformers ``Trainer`` on the emulated npu device with ``opcontracts.NanStepCallback``:
four update steps, one of whose batches hands the fused unpermute fp32 probs (the op takes bf16
probs only: NaN gradients); prints the callback's result and, per step, whether the parameters
moved, as JSON.  Run unmodified under ``opcontracts run --emulate`` (tests/test_nan_trainer.py).
"""
import json
import sys

import torch
import torch_npu
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments  # after torch_npu

import opcontracts

BAD = 2  # the batch (of 4) whose probs reach the unpermute in fp32


class MoE(nn.Module):
    def __init__(self, hidden=16, experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x, probs_dtype):
        probs, idx = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        tokens, sorted_indices = torch_npu.npu_moe_token_permute(x.to(torch.bfloat16), idx)
        counts = torch.bincount(idx.flatten(), minlength=len(self.experts)).tolist()
        chunks = tokens.float().split(counts)
        out = torch.cat([e(c) for e, c in zip(self.experts, chunks)]).to(torch.bfloat16)
        return torch_npu.npu_moe_token_unpermute(out, sorted_indices, probs.to(probs_dtype))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.mlp = MoE()

    def forward(self, x, bad):
        h = self.proj(x.reshape(-1, 16))
        dtype = torch.float32 if bool(bad.any()) else torch.bfloat16
        return {"loss": self.mlp(h, dtype).float().pow(2).mean()}


class Batches(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(1)
        self.xs = [torch.randn(8, 16, generator=gen) for _ in range(4)]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"x": self.xs[i], "bad": torch.tensor(i == BAD)}


class Moved(TrainerCallback):
    """Per update step: whether it changed the parameters (a skipped step does not)."""

    def __init__(self, model):
        self.model, self.moved, self.before = model, [], None

    def on_step_begin(self, args, state, control, **kw):
        self.before = [p.detach().cpu().clone() for p in self.model.parameters()]

    def on_step_end(self, args, state, control, **kw):
        now = [p.detach().cpu() for p in self.model.parameters()]
        self.moved.append(not all(torch.equal(a, b) for a, b in zip(self.before, now)))


torch.manual_seed(0)
model = Model()
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=1, max_steps=4,
                         learning_rate=1e-2, save_strategy="no", report_to=[],
                         remove_unused_columns=False, disable_tqdm=True, logging_strategy="no",
                         lr_scheduler_type="constant", dataloader_num_workers=0, seed=0)
moved = Moved(model)
trainer = Trainer(model=model, args=args, train_dataset=Batches(), callbacks=[moved])
assert trainer.args.device.type == "npu", trainer.args.device
cb = opcontracts.NanStepCallback(trainer)
trainer.train()
result = cb.result.to_dict()
finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
print("RESULT " + json.dumps({**result, "moved": moved.moved, "finite": finite,
                              "device": next(model.parameters()).device.type}))
