"""``opcontracts preflight`` and ``opcontracts.preflight``: a training step on fake tensors.

Small configurations here (the full-size 61-layer demo step is ``benchmarks/bench_preflight.py``);
one test runs a single DeepSeek-V3-sized layer, which takes a few seconds on fake tensors.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts import emulation
from opcontracts._lang import targets as _targets
from opcontracts._tools import preflight_cli, preflight_demo
from opcontracts._tools.preflight import PreflightStop, preflight
from opcontracts._tools.preflight_fake import FakeDevice

A2 = "cann=8.0.RC3,soc=Ascend910B3"
TINY = preflight_demo.Size(hidden=64, heads=4, ffn=32, experts=8, topk=2, layers=2, vocab=100,
                           tokens=16)

ROUTING = '''\
"""A routing step through torch_npu's fused permute / unpermute, sizes from the command line."""
import argparse
import torch
import torch_npu

p = argparse.ArgumentParser()
for name, default in (("tokens", 16), ("hidden", 32), ("experts", 8), ("topk", 2)):
    p.add_argument("--" + name, type=int, default=default)
a = p.parse_args()
x = torch.randn(a.tokens, a.hidden, dtype=torch.bfloat16).npu().requires_grad_()
probs, idx = torch.topk(torch.randn(a.tokens, a.experts, device="npu").softmax(-1), a.topk)
permuted, sorted_idx = torch_npu.npu_moe_token_permute(x, idx)
out = torch_npu.npu_moe_token_unpermute(permuted, sorted_idx, probs.to(torch.bfloat16))
out.float().sum().backward()
'''


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder without a pyproject.toml, no targets in the environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(_targets.VAR, raising=False)
    return tmp_path


def _cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = preflight_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def _script(folder: Path, name: str, body: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------- the API
def test_the_demo_step_collects_every_violation_with_sites_and_peak_memory(workdir: Path) -> None:
    pf = preflight_demo.run_demo(TINY)
    rep = pf.report
    assert not rep.ok and rep.steps == 1
    (v,) = rep.violations
    assert (v.op, v.arg, v.rule, v.call_site) == (
        "mindspeed.npu_moe_token_unpermute", "probs", "dtype", "moe_block.py:107 in forward")
    assert v.count == TINY.layers  # every layer's call, not the first one only
    assert "probs = probs.to(torch.bfloat16)" in v.message
    sites = {s.op: s for s in rep.sites}
    assert sites["mindspeed.npu_moe_token_unpermute"].verdict == "violation"
    assert sites["mindspeed.npu_moe_token_permute"].verdict == "ok"
    assert "probs fp32(16, 2)" in sites["mindspeed.npu_moe_token_unpermute"].tensors
    # parameters, their gradients and AdamW's two moments, in bf16, at the least
    params = sum(p.numel() for p in _tiny_model_params()) * 2
    assert rep.peak_bytes >= 4 * params
    assert "sorted_indices: a permutation" in "\n".join(rep.not_judged)
    text = rep.text()
    assert "call site: moe_block.py:107 in forward" in text and "peak device memory" in text


def _tiny_model_params() -> list[torch.Tensor]:
    from opcontracts._tools import demo

    with demo._environment() as mod:
        model = mod.MoEModel(vocab=TINY.vocab, hidden=TINY.hidden, heads=TINY.heads,
                             ffn=TINY.ffn, experts=TINY.experts, topk=TINY.topk,
                             layers=TINY.layers, grouped=True)
    return list(model.parameters())


def test_the_process_is_put_back_afterwards(workdir: Path) -> None:
    was_installed = emulation.installed()
    opcontracts.set_mode("strict")
    with preflight(A2):
        assert opcontracts.get_mode() == "warn" and preflight.active()
        assert _targets.declared()[1] == "set_targets()"
    assert opcontracts.get_mode() == "strict" and not preflight.active()
    assert _targets.declared()[0] == ()
    assert emulation.installed() == was_installed
    assert not isinstance(torch.ones(2), torch._subclasses.fake_tensor.FakeTensor)


def test_steps_end_the_block_after_that_many_optimizer_steps(workdir: Path) -> None:
    after = []
    with preflight(A2, steps=2) as pf:
        w = torch.nn.Parameter(torch.ones(4, 4, device="npu"))
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(5):
            (w * 2).sum().backward()
            opt.step()
        after.append("not reached")
    assert pf.report.steps == 2 and after == []


def test_fake_device_counts_live_npu_bytes_and_their_peak() -> None:
    was = emulation.installed()
    emulation.install(emulation.current_profile().name if was else "narrow", device=True)
    try:
        _count_live_bytes()
    finally:
        if not was:  # the process as it was: later tests detect no torch_npu stand-in
            emulation.uninstall()


def _count_live_bytes() -> None:
    with FakeDevice() as dev:
        a = torch.empty(1024, 256, device="npu")  # 1 MiB
        b = torch.empty(1024, 256, device="npu", dtype=torch.bfloat16)
        view = a.view(-1)  # shares a's storage: not counted again
        cpu = torch.empty(1 << 20)  # not on the device
        assert dev.live == (1 << 20) + (1 << 19)
        del a, view
        assert dev.live == 1 << 19 and dev.peak == (1 << 20) + (1 << 19)
        model = torch.nn.Linear(64, 64, bias=False, device="npu").to(torch.bfloat16)
    assert isinstance(model.weight, torch._subclasses.fake_tensor.FakeTensor)
    assert model.weight.dtype == torch.bfloat16 and b.numel() and cpu.numel()


# --------------------------------------------------------------------------- full size only
def test_top_k_513_is_caught_at_full_size_and_missed_at_test_size(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(workdir, "route.py", ROUTING)
    code, out = _cli("--targets", A2, script, capsys=capsys)
    assert code == 0, out  # the test sizes: top-2 of 8 experts, nothing to see
    assert "no call violates a contract" in out
    code, out = _cli("--targets", A2, script, "--tokens", "4096", "--hidden", "7168",
                     "--experts", "1024", "--topk", "513", capsys=capsys)
    assert code == 1, out
    assert "npu_moe_token_unpermute: argument 'probs' has shape (4096, 513), expected shape " \
           "(N K) with K <= 512" in out
    assert "route.py:13 in <module>" in out
    assert "permuted_tokens bf16(2101248, 7168)" in out  # 28 GiB that were never allocated


def test_one_deepseek_v3_layer_names_the_incidents_call(workdir: Path) -> None:
    pf = preflight_demo.run_demo(dataclasses.replace(preflight_demo.DEEPSEEK_V3, layers=1))
    (v,) = pf.report.violations
    assert v.call_site == "moe_block.py:107 in forward" and v.arg == "probs"
    assert "dtype float32 (shape (4096, 8))" in v.message and "H=7168" in v.message
    assert pf.report.peak_bytes > 60 * (1 << 30)  # one layer's experts alone: 15 GB of bf16


# --------------------------------------------------------------------------- the command
def test_the_command_writes_json(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(workdir, "route.py", ROUTING)
    code, out = _cli("--json", "r.json", "--targets", A2, script, "--topk", "513",
                     "--experts", "1024", capsys=capsys)
    assert code == 1
    data = json.loads((workdir / "r.json").read_text())
    assert data["ok"] is False
    assert "npu_moe_token_unpermute" in {v["op"] for v in data["violations"]}
    assert {s["op"] for s in data["sites"]} == {"npu_moe_token_permute",
                                                 "npu_moe_token_unpermute"}
    assert data["peak_device_bytes"] > 0
    assert {s["verdict"] for s in data["sites"]} == {"violation"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0", "x.py"], "--steps: expected at least 1"),
    (["--ranks", "two", "x.py"], "--ranks: expected a whole number"),
    (["--bogus", "x.py"], "unknown option '--bogus'"),
    (["--targets"], "--targets needs a value"),
])
def test_usage_errors_exit_2(argv: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(*argv, capsys=capsys)
    assert code == 2 and message in out


def test_a_missing_script_or_a_bad_target_exit_2(workdir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli("nope.py", capsys=capsys)
    assert code == 2 and "can't open file" in out
    script = _script(workdir, "ok.py", "x = 1\n")
    code, out = _cli("--targets", "cann=banana", script, capsys=capsys)
    assert code == 2 and "'banana' is not a version" in out


def test_ranks_runs_rank_0_of_an_expert_parallel_job(workdir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(workdir, "ep.py", '''\
        import torch
        import torch.distributed as dist
        import torch_npu

        dist.init_process_group("hccl")  # the job's own line: joins the fake group
        ep, experts, tokens, topk = dist.get_world_size(), 64, 512, 8
        x = torch.randn(tokens, 256, dtype=torch.bfloat16, device="npu")
        probs, idx = torch.topk(torch.randn(tokens, experts, device="npu").softmax(-1), topk)
        permuted, sorted_idx = torch_npu.npu_moe_token_permute(x, idx)
        split = [tokens * topk // ep] * ep
        received = torch.empty_like(permuted)
        dist.all_to_all_single(received, permuted, split, split)
        print("rank", dist.get_rank(), "of", ep, "experts here", experts // ep,
              "received", tuple(received.shape))
        out = torch_npu.npu_moe_token_unpermute(received, sorted_idx, probs)
    ''')
    code, out = _cli("--ranks", "8", "--targets", A2, script, capsys=capsys)
    assert "rank 0 of 8 experts here 8 received (4096, 256)" in out
    assert "rank 0 of 8 (torch's fake process group)" in out
    assert code == 1 and "argument 'probs' has dtype float32" in out
    assert not torch.distributed.is_initialized()


def test_without_targets_the_report_says_what_it_judged_on(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(workdir, "route.py", ROUTING)
    code, out = _cli(script, capsys=capsys)
    assert "no targets declared" in out


# --------------------------------------------------------------------------- what fakes cannot
READS = {
    "item": ("loss = torch.ones(3, device='npu').sum()\nprint(loss.item())\n", "loss.item()",
             "reads a tensor's value"),
    "tolist": ("c = torch.ones(3, device='npu').tolist()\n", "tolist()", "reads a tensor's value"),
    "branch": ("x = torch.ones(3, device='npu')\nif (x > 0).any():\n    pass\n",
               "if (x > 0).any():", "a tensor in an if"),
    "nonzero": ("x = torch.ones(3, device='npu')\ny = x[x > 0]\n", "y = x[x > 0]",
                "shape depends on values"),
    "format": ("x = torch.ones((), device='npu')\ns = f'{x:.3f}'\n", "f'{x:.3f}'",
               "formats a tensor's value"),
    "numpy": ("a = torch.ones(3, device='npu').cpu().numpy()\n", ".numpy()", ".numpy()"),
}


@pytest.mark.parametrize("case", sorted(READS))
def test_a_value_read_gets_one_message_at_the_users_line(
        case: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body, line, what = READS[case]
    script = _script(workdir, "train.py", "import torch\nimport torch_npu\n" + body)
    code, out = _cli(script, capsys=capsys)
    assert code == 1
    stop = [ln for ln in out.splitlines() if ln.startswith("preflight stopped at")]
    assert stop and stop[-1].startswith(f"preflight stopped at {script}:")
    assert line in stop[-1] and what in stop[-1]
    assert "opcontracts.preflight.active()" in stop[-1]
    assert "Traceback" not in out and "fake_tensor.py" not in out


def test_the_api_raises_preflight_stop_with_the_report() -> None:
    with pytest.raises(PreflightStop) as info:
        with preflight(A2):
            torch.ones(2, device="npu").sum().item()
    assert "test_preflight.py" in str(info.value) and ".item()" in str(info.value)
    assert info.value.report.stopped == str(info.value)


def test_active_gives_preflight_the_value(workdir: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(workdir, "train.py", '''\
        import torch
        import opcontracts
        counts = torch.ones(4, dtype=torch.int64, device="npu") * 2
        sizes = [2, 2, 2, 2] if opcontracts.preflight.active() else counts.tolist()
        parts = torch.ones(8, 16, device="npu").split(sizes)
        if not opcontracts.preflight.active():
            print("loss", parts[0].sum().item())
    ''')
    code, out = _cli(script, capsys=capsys)
    assert code == 0, out


def test_a_checkpoint_loads_as_fake_tensors(workdir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.ones(8, 4)}, workdir / "ckpt.pt")
    script = _script(workdir, "train.py", '''\
        import torch
        w = torch.load("ckpt.pt")["w"].npu()
        assert (torch.ones(2, 4, device="npu") @ w.t()).shape == (2, 8)
    ''')
    code, out = _cli(script, capsys=capsys)
    assert code == 0, out


def test_a_data_loader_gets_one_message(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "rows.csv").write_text("1,2,3,4\n5,6,7,8\n")
    script = _script(workdir, "train.py", '''\
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Rows(Dataset):
            def __init__(self):
                with open("rows.csv") as f:
                    self.rows = [list(map(float, ln.split(","))) for ln in f]
            def __len__(self):
                return len(self.rows)
            def __getitem__(self, i):
                return torch.tensor(self.rows[i])

        for batch in DataLoader(Rows(), batch_size=2):
            y = batch.npu().sum(0)
    ''')
    code, out = _cli(script, capsys=capsys)
    assert code == 1
    stop = [ln for ln in out.splitlines() if ln.startswith("preflight stopped at")]
    assert f"{script}:13: `for batch in DataLoader(Rows(), batch_size=2):`" in stop[-1]
    assert "runs a torch DataLoader" in stop[-1] and "Traceback" not in out


def test_the_scripts_own_error_is_shown_as_python_shows_it(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(workdir, "bad.py", "import torch\nraise ValueError('no such config')\n")
    code, out = _cli(script, capsys=capsys)
    assert code == 1 and "ValueError: no such config" in out and "bad.py\", line 2" in out


@pytest.mark.hf  # opt-in: OPCONTRACTS_HF_TESTS=1 (tests/conftest.py)
def test_a_transformers_moe_model_from_a_full_size_config(workdir: Path) -> None:
    transformers: Any = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(num_hidden_layers=2)  # the 30B-A3B sizes, 2 layers
    with preflight(A2, steps=1) as pf:
        with torch.device("npu"):
            model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        ids = torch.zeros(1, 512, dtype=torch.long, device="npu")
        model(input_ids=ids, labels=ids).loss.backward()
    assert pf.report.stopped is None and not pf.report.violations
    assert (config.hidden_size, config.num_experts) == (2048, 128)
    # 2 layers of 128 experts (3 matrices of 2048 x 768 each) in bf16: over 2 GiB of weights
    assert pf.report.peak_bytes > 2 * (1 << 30)
