"""A Qwen2-MoE from a small config trains 3 steps; prints the losses as JSON.

argv: DEVICE (npu|cpu) WAY (loop|trainer|accelerate) EXPERTS (default|eager)
      AUTOCAST (none|bf16) CHECKPOINT (none|reentrant|nonreentrant)"""
import json
import sys

import torch

device, way, experts, autocast, ckpt = sys.argv[1:6]
if device == "npu":
    import torch_npu  # noqa: F401
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM  # noqa: E402  # after torch_npu, as on an NPU

torch.manual_seed(0)
kwargs = {} if experts == "default" else {"experts_implementation": experts}
config = Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=64, max_position_embeddings=64,
                        output_router_logits=True, use_cache=False, **kwargs)
attn = "flash_attention_2" if device == "npu" else "sdpa"
model = Qwen2MoeForCausalLM._from_config(config, attn_implementation=attn)
if ckpt != "none":
    model.gradient_checkpointing_enable({"use_reentrant": ckpt == "reentrant"})
gen = torch.Generator().manual_seed(1)
batches = [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(3)]
amp = dict(device_type=device, dtype=torch.bfloat16, enabled=autocast == "bf16")
losses = []

if way == "loop":
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for ids in batches:
        ids = ids.to(device)
        with torch.autocast(**amp):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
elif way == "accelerate":
    from accelerate import Accelerator
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)      # built before prepare()
    acc = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if autocast == "bf16" else "no")
    model, opt = acc.prepare(model, opt)
    assert acc.device.type == device, acc.device
    model.train()
    for ids in batches:
        ids = ids.to(acc.device)
        with acc.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
else:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Batches(torch.utils.data.Dataset):
        def __len__(self): return 6
        def __getitem__(self, i):
            ids = batches[i // 2][i % 2]
            return {"input_ids": ids, "labels": ids}

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = TrainingArguments(output_dir="/tmp/hf_moe_out", per_device_train_batch_size=2,
                             max_steps=3, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=device == "cpu", bf16=autocast == "bf16",
                             lr_scheduler_type="constant", optim="adamw_torch",
                             dataloader_num_workers=0, seed=0, data_seed=0, disable_tqdm=True,
                             gradient_checkpointing=ckpt != "none",
                             gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    trainer = Trainer(model=model, args=args, train_dataset=Batches(), callbacks=[Keep()])
    assert trainer.args.device.type == device, trainer.args.device
    trainer.train()
print("LOSSES " + json.dumps(losses))
