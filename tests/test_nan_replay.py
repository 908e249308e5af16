"""The always-on NaN sentinel: the step checked at ``optimizer.step()``, a bad step skipped and
replayed under the watch (``opcontracts.nan_step``), or the watch armed when the step's
function is not known; what it costs, counted (host reads, dispatcher ops, hooks), never timed.

The incident's step (the demo's MoE model, fused unpermute handed fp32 probs, contracts off)
is the bad step; its conforming twin (the fix applied) the good one.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts._observers import layer
from opcontracts._observers.replay import live_scopes
from opcontracts._tools import demo
from opcontracts.nan import NanSentinel, nan_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _host_reads import HostReads  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def moe() -> Iterator[types.ModuleType]:
    with demo._environment() as mod, opcontracts.mode("off"):
        yield mod


class Job:
    """The demo's model, an SGD optimizer and a batch; ``bad`` hands fp32 probs to the
    bf16-only unpermute (NaN gradients), else the fix is applied."""

    def __init__(self, mod: types.ModuleType, layers: int = 2, bad: bool = True) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = mod.MoEModel(vocab=demo.VOCAB, layers=layers).to(BF16)
        self.model.set_fused(True, cast_probs=not bad)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self.batch = demo._batch(0)

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(ids, targets)
        loss.backward()
        self.opt.step()
        return loss

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _key(e: Any) -> tuple[Any, ...]:
    assert e is not None
    return (e.op, e.direction, e.kind, e.arg, e.module, e.call_site, e.dtype, e.shape)


def _watch_first(mod: types.ModuleType, layers: int = 2) -> Any:
    """What the per-call watch names on the bad step."""
    job = Job(mod, layers)
    with NanSentinel() as w:
        job.model(*job.batch).backward()
    return w.result().first


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn()


# --------------------------------------------------------------------------- replay
@pytest.mark.parametrize("layers", [2, 6])
def test_a_bad_step_is_skipped_and_its_replay_names_the_watchs_culprit(
        moe: types.ModuleType, layers: int) -> None:
    watch = _watch_first(moe, layers)
    job = Job(moe, layers)
    before = job.params()
    step = nan_step(job.step)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        with NanSentinel(always_on=True) as s:
            step(*job.batch)
    # skipped as AMP skips: the parameters are those the bad step started from
    assert all(torch.equal(a, b) for a, b in zip(before, job.model.parameters()))
    assert s.steps == 1 and s.first_bad_step == 1
    r = s.result()
    (f,) = r.findings
    assert (f.step, f.how, f.reproduced, f.skipped) == (1, "replay", True, True)
    assert _key(f.culprit) == _key(watch) == _key(r.first)
    assert "npu_moe_token_unpermute" in f.culprit.op and f.culprit.direction == "backward"
    assert f.culprit.counted  # the replay keeps the tensors: NaN and inf counted
    assert f.nonfinite_count > 0 and f.replay_s is not None
    text = r.summary()
    assert "the step was skipped" in text and "the NaN reproduced" in text
    assert "replayed under the watch (same inputs, RNG states restored" in text
    # one warning, at the user's line, with the culprit
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "npu_moe_token_unpermute" in msgs[0]
    assert layer.attached() == []  # the watch is off again


def test_a_nan_injected_once_is_reported_as_not_reproduced(moe: types.ModuleType) -> None:
    job = Job(moe, bad=False)
    calls = []

    @nan_step
    def step(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        job.opt.zero_grad(set_to_none=True)
        loss = job.model(ids, targets)
        loss.backward()
        calls.append(1)
        if len(calls) == 1:  # a one-off: a flipped bit, a race
            next(job.model.parameters()).grad[0, 0] = float("nan")
        job.opt.step()
        return loss

    before = job.params()
    with NanSentinel(always_on=True, on_nan="record") as s:
        step(*job.batch)
    assert len(calls) == 2  # the step and its replay
    assert all(torch.equal(a, b) for a, b in zip(before, job.model.parameters()))
    (f,) = s.findings
    assert (f.how, f.reproduced, f.culprit) == ("replay", False, None)
    assert "did NOT reproduce" in s.result().summary()
    # the next steps train: finite, applied
    with NanSentinel(always_on=True, on_nan="record") as s2:
        step(*job.batch)
    assert s2.first_bad_step is None and s2.steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, job.model.parameters()))


def test_the_replay_restores_the_rng_and_the_job_keeps_its_own(moe: types.ModuleType) -> None:
    job = Job(moe, bad=False)
    drawn: list[torch.Tensor] = []

    @nan_step
    def step(ids: torch.Tensor, targets: torch.Tensor) -> None:
        noise = torch.rand(3)
        drawn.append(noise)
        job.opt.zero_grad(set_to_none=True)
        loss = job.model(ids, targets) * noise.sum() * float("nan")  # every step bad
        loss.backward()
        job.opt.step()

    torch.manual_seed(7)
    with NanSentinel(always_on=True, on_nan="record"):
        step(*job.batch)
        after = torch.rand(3)
    torch.manual_seed(7)
    expected = torch.rand(3)
    assert torch.equal(drawn[0], expected) and torch.equal(drawn[1], expected)  # replayed alike
    assert torch.equal(after, torch.rand(3))  # the job's stream as if no replay had run


class _Backend(types.SimpleNamespace):
    """A stand-in accelerator module: its generators' states, and whether it is available
    and initialised."""

    def __init__(self, available: bool, initialised: bool) -> None:
        super().__init__(asked=0, states=[torch.tensor([1, 2], dtype=torch.uint8)])
        self._available, self._initialised = available, initialised

    def is_available(self) -> bool:
        self.asked += 1
        return self._available

    def is_initialized(self) -> bool:
        return self._initialised

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        self.states = list(states)


def test_the_rng_capture_follows_device_modules_that_appear_and_skips_unusable_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opcontracts._observers import replay

    before = {id(m) for m in replay.RngStates().devices}
    # torch_npu (or the emulation) installed after the job started: ``torch.npu`` appears
    npu = _Backend(available=True, initialised=True)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    states = replay.RngStates()
    assert [m for m, _ in states.devices if m is npu] == [npu]
    npu.states = [torch.tensor([9, 9], dtype=torch.uint8)]
    states.restore()
    assert npu.states[0].tolist() == [1, 2]  # the state it had at the capture
    # a backend this process cannot use is asked whether it is available once, not per step
    xpu = _Backend(available=False, initialised=True)
    monkeypatch.setattr(torch, "xpu", xpu)
    for _ in range(3):
        assert all(m is not xpu for m, _ in replay.RngStates().devices)
    assert xpu.asked == 1
    monkeypatch.undo()
    assert {id(m) for m in replay.RngStates().devices} == before


def test_inputs_kept_for_a_replay_are_released_when_the_step_ends_well(
        moe: types.ModuleType) -> None:
    job = Job(moe, bad=False)
    step = nan_step(job.step)
    refs = []
    with NanSentinel(always_on=True, on_nan="record") as s:
        for i in range(5):
            ids, targets = (t.clone() for t in job.batch)
            refs.append(weakref.ref(ids))
            seen: list[int] = []

            def spy(*_: Any, seen: list[int] = seen) -> None:
                seen.append(live_scopes())

            h = torch.optim.Optimizer.register_step_pre_hook(job.opt, spy)  # type: ignore[arg-type]
            step(ids, targets)
            h.remove()
            assert seen == [1]  # held while the step runs
            del ids, targets
            gc.collect()
            assert live_scopes() == 0 and refs[i]() is None  # released when it ended well
    assert s.steps == 5 and s.first_bad_step is None


# --------------------------------------------------------------------------- not known
def test_without_the_step_function_the_watch_arms_and_names_the_recurrence(
        moe: types.ModuleType) -> None:
    watch = _watch_first(moe)
    job = Job(moe)
    with NanSentinel(always_on=True, on_nan="record") as s:
        job.step(*job.batch)  # bad: skipped, the watch armed
        assert layer.attached() == [s]
        (f,) = s.findings
        assert (f.how, f.reproduced) == ("recurrence", None)
        assert "armed from step 2" in s.result().summary()
        job.step(*job.batch)  # the NaN recurs: named, the watch off again
        assert layer.attached() == []
        job.step(*job.batch)
    assert (f.reproduced, f.at_step) == (True, 2)
    assert _key(f.culprit) == _key(watch)
    r = s.result()
    assert r.bad_steps == [1, 2, 3] and len(r.findings) == 1
    assert "named the culprit when the NaN recurred at step 2" in r.summary()


def test_an_armed_watch_that_sees_no_recurrence_is_disarmed(moe: types.ModuleType) -> None:
    job = Job(moe, bad=False)
    w = next(job.model.parameters())
    with NanSentinel(always_on=True, on_nan="record", arm_steps=2) as s:
        job.opt.zero_grad()
        job.model(*job.batch).backward()
        w.grad[0, 0] = float("inf")
        job.opt.step()
        for _ in range(2):
            job.step(*job.batch)
    (f,) = s.findings
    assert (f.how, f.reproduced, f.culprit) == ("recurrence", False, None)
    assert layer.attached() == []
    assert "saw no NaN recur in 2 step(s)" in s.result().summary()


def test_watch_first_names_a_first_step_nan_without_an_optimizer(moe: types.ModuleType) -> None:
    """``run --nan-check``: a script of one forward and backward, no optimizer step."""
    watch = _watch_first(moe)
    job = Job(moe)
    with NanSentinel(always_on=True, on_nan="record", watch_first=True) as s:
        job.model(*job.batch).backward()
    r = s.result()
    assert _key(r.first) == _key(watch) and r.steps == 0


# --------------------------------------------------------------------------- cost, counted
def _counted(job: Job, kind: str) -> tuple[int, int, int]:
    """(host reads, dispatcher ops, global optimizer hooks + node hooks) of one good step."""
    import bench_accelerator
    from torch.optim import optimizer as optim_mod

    step = job.step
    ctx: Any = NanSentinel(always_on=True, on_nan="record") if kind != "bare" else None
    if ctx is not None:
        ctx.enable()
        if kind == "replay":
            step = nan_step(job.step)
    try:
        step(*job.batch)  # warm
        with HostReads() as reads:
            step(*job.batch)
        with bench_accelerator.OpCount() as ops:
            step(*job.batch)
        hooks = len(optim_mod._global_optimizer_pre_hooks) + len(
            optim_mod._global_optimizer_post_hooks)
        attached = len(layer.attached())
    finally:
        if ctx is not None:
            ctx.disable()
    return reads.total, ops.ops, hooks + attached


@pytest.mark.parametrize("kind", ["always-on", "replay"])
def test_a_good_step_costs_one_read_and_a_fixed_number_of_ops(moe: types.ModuleType,
                                                              kind: str) -> None:
    added = {}
    for layers in (2, 6):
        job = Job(moe, layers, bad=False)
        bare = _counted(job, "bare")
        on = _counted(job, kind)
        added[layers] = (on[0] - bare[0], on[1] - bare[1], on[2] - bare[2])
    # one host read a step, the same few ops on 6 layers (36 guarded calls' worth of tensors
    # more) as on 2: nothing per guarded call; two optimizer hooks, nothing at the layer
    assert added[2] == added[6], added
    reads, ops, hooks = added[2]
    assert reads == 1 and ops <= 3 and hooks == 2, added


def test_a_distributed_step_is_judged_over_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a job the count of non-finite norms is summed over the ranks before the one read:
    a rank whose own gradients are finite skips the step its peer found bad."""
    import torch.distributed as dist

    from opcontracts._observers import stepcheck

    def peer_is_bad(t: torch.Tensor, *a: Any, **k: Any) -> None:
        t.add_(1)  # the other rank's count

    monkeypatch.setattr(dist, "all_reduce", peer_is_bad)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1.0)
    with NanSentinel(always_on=True, on_nan="record", sync=True) as s:
        w.grad = torch.ones(3)
        with HostReads() as reads:
            opt.step()
    assert reads.total == 1
    assert torch.equal(w.detach(), torch.ones(3))  # skipped on this rank too
    (f,) = s.findings
    assert f.nonfinite_count == 0 and f.ranks_bad == 1
    assert stepcheck.screen([], sync=True) == ([], 0)


def test_huge_finite_gradients_are_not_called_non_finite() -> None:
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.0)
    with NanSentinel(always_on=True, on_nan="record") as s:
        w.grad = torch.full((4,), 3e38)  # finite; its 2-norm overflows float32
        opt.step()
    assert s.first_bad_step is None and s.findings == []


def test_the_loss_handed_over_is_checked_with_the_gradients() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    with NanSentinel(always_on=True, on_nan="record") as s:
        loss = (w * 0).sum() + torch.tensor(float("nan")).detach()  # gradients finite
        loss.backward()
        opcontracts.nan.loss(loss)
        opt.step()
    (f,) = s.findings
    assert f.nonfinite == ["the loss (float32)"]
    assert torch.equal(w.detach(), torch.ones(2))


def test_nan_step_without_an_always_on_sentinel_is_the_function() -> None:
    def f(x: int) -> int:
        return x + 1

    g = opcontracts.nan_step(f)
    assert g(1) == 2 and g.__wrapped__ is f  # type: ignore[attr-defined]
    with NanSentinel():  # the watch alone: nothing to replay
        assert g(2) == 3
    assert "nan_step" in opcontracts.__all__


# --------------------------------------------------------------------------- a Trainer
class _Handler:
    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def call(self, event: str, trainer: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(None, trainer.state, None, model=trainer.model,
                               optimizer=trainer.optimizer)


class TrainerLike:
    """The transformers Trainer's inner loop as it calls its callbacks: per update step
    ``on_step_begin``, ``training_step(model, inputs)`` per micro-batch (forward, backward of
    the loss over the accumulation steps), ``optimizer.step()``, ``zero_grad``, ``on_step_end``."""

    def __init__(self, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
                 accumulation: int = 2) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.batches = batches
        self.accumulation = accumulation
        self.callback_handler = _Handler()
        self.state = types.SimpleNamespace(global_step=0)

    def add_callback(self, cb: Any) -> None:
        self.callback_handler.callbacks.append(cb)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]
                      ) -> torch.Tensor:
        loss = model(inputs["input_ids"], inputs["labels"]) / self.accumulation
        loss.backward()
        return loss.detach()

    def train(self) -> None:
        h = self.callback_handler
        h.call("on_train_begin", self)
        self.model.zero_grad()
        for i, inputs in enumerate(self.batches):
            if i % self.accumulation == 0:
                h.call("on_step_begin", self)
            self.training_step(self.model, inputs)
            if (i + 1) % self.accumulation == 0:
                self.optimizer.step()
                self.model.zero_grad()
                self.state.global_step += 1
                h.call("on_step_end", self)
        h.call("on_train_end", self)


def test_the_trainer_callback_replays_the_bad_update_step_on_the_npu_device(
        moe: types.ModuleType) -> None:
    import opcontracts.patch as patch
    from opcontracts import emulation

    emulation.install(demo.PROFILE, mindspeed_line="core_r0.8.0", device=True)
    patch.apply()
    watch = _watch_first(moe)
    job = Job(moe)
    model = job.model.to("npu")
    ids, targets = (t.to("npu") for t in job.batch)
    good = ids.roll(1, 0)  # another batch: four micro-batches, two update steps
    batches = [{"input_ids": x, "labels": targets} for x in (ids, good, ids, good)]
    trainer = TrainerLike(model, batches)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    cb = opcontracts.NanStepCallback(trainer)
    assert trainer.callback_handler.callbacks == [cb]
    _quiet(trainer.train)
    r = cb.result
    assert r is not None and r.steps == 2 and r.bad_steps == [1, 2]
    (f,) = r.findings  # the first localised; the second only counted
    assert (f.how, f.reproduced) == ("replay", True)
    assert _key(f.culprit)[:5] == _key(watch)[:5]  # op, direction, kind, argument, module
    assert f.culprit.call_site == watch.call_site
    # both steps skipped: the parameters are those training started from
    assert all(torch.equal(a, b.detach().cpu()) for a, b in zip(before, model.parameters()))
    assert next(model.parameters()).device.type == "npu"
    assert all(p.grad is None for p in model.parameters())  # nothing left to accumulate into
    assert layer.attached() == [] and opcontracts.nan.active() is None
    assert live_scopes() == 0


def test_the_callback_without_its_trainer_arms_the_watch(moe: types.ModuleType) -> None:
    job = Job(moe)
    batches = [{"input_ids": job.batch[0], "labels": job.batch[1]}] * 4
    trainer = TrainerLike(job.model, batches)
    cb = opcontracts.NanStepCallback()
    trainer.add_callback(cb)  # callbacks=[NanStepCallback()]: the trainer is not known
    _quiet(trainer.train)
    assert cb.result is not None
    (f,) = cb.result.findings
    assert (f.how, f.reproduced, f.at_step) == ("recurrence", True, 2)


# --------------------------------------------------------------------------- the FSDP demo
def _fsdp_demo(tmp: Path, *extra: str) -> dict[str, Any]:
    import json
    import os
    import subprocess

    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "demo.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OPCONTRACTS_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "opcontracts", "demo", "--ranks", "2", "--fsdp", "1", *extra,
           "--json", str(out)]
    for attempt in (1, 2):  # once more if it died of a port clash
        p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
        if p.returncode == 0 or attempt == 2 or "address already in use" not in (
                p.stdout + p.stderr).lower():
            break
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _rank_firsts(data: dict[str, Any]) -> dict[int, tuple[Any, ...]]:
    out = {}
    for rank, scenarios in enumerate(data["per_rank"]):
        first = next(s for s in scenarios if s["name"] == "unguarded")["nan_check"]["first"]
        out[rank] = tuple(first[k] for k in ("op", "direction", "kind", "arg", "module",
                                             "call_site", "dtype"))
    return out


@pytest.mark.skipif(not __import__("torch.distributed").distributed.is_available(),
                    reason="torch.distributed is not available")
def test_fsdp_demo_always_on_replay_names_the_watchs_culprit_at_the_first_bad_step(
        tmp_path: Path) -> None:
    always = _fsdp_demo(tmp_path / "always")  # the ranks' default: always-on
    watch = _fsdp_demo(tmp_path / "watch", "--sentinel", "watch")
    assert always["ok"] and watch["ok"]
    assert _rank_firsts(always) == _rank_firsts(watch)  # every rank, the same first culprit
    nan = always["nan"]["unguarded"]
    assert nan["first"]["rank"] == 0 and "npu_moe_token_unpermute" in nan["first"]["op"]
    assert nan["first"]["module_clean"] == watch["nan"]["unguarded"]["first"]["module_clean"]
    for rank in ("0", "1"):  # at the first bad step, by a replay that reproduced it
        f = nan["always_on"][rank]
        assert (f["step"], f["how"], f["reproduced"], f["skipped"]) == (1, "replay", True, True)
    assert "always_on" not in watch["nan"]["unguarded"] or not watch["nan"]["unguarded"][
        "always_on"]
    assert always["nan"]["fix"]["first"] is None


def test_the_step_checks_warning_points_at_the_users_optimizer_step() -> None:
    import os

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with NanSentinel(always_on=True):
            (w * float("nan")).sum().backward()
            opt.step()
            line = sys._getframe().f_lineno - 1
    got = [(os.path.basename(x.filename), x.lineno) for x in seen
           if issubclass(x.category, RuntimeWarning) and "non-finite" in str(x.message)]
    assert got == [(os.path.basename(__file__), line)]


# --------------------------------------------------------------------------- opt-in: transformers
HF_SCRIPT = '''
import json, sys, torch
import opcontracts
from opcontracts._tools import demo
from transformers import Trainer, TrainingArguments

with demo._environment() as mod, opcontracts.mode("off"):
    torch.manual_seed(0)
    inner = mod.MoEModel(vocab=demo.VOCAB, layers=2).to(torch.bfloat16)  # fp32 probs: NaN

    class Model(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, targets):
            return {"loss": self.m(ids, targets)}

    ids, targets = demo._batch(0)
    data = [{"ids": ids[i], "targets": targets[i]} for i in range(len(ids))] * 2
    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4,
                             max_steps=2, learning_rate=1e-3, save_strategy="no", report_to=[],
                             use_cpu=True, remove_unused_columns=False, disable_tqdm=True,
                             lr_scheduler_type="constant", logging_strategy="no", seed=0)
    trainer = Trainer(model=Model(inner), args=args, train_dataset=data)
    cb = opcontracts.NanStepCallback(trainer)
    before = [p.detach().clone() for p in inner.parameters()]
    trainer.train()
    same = all(torch.equal(a, b) for a, b in zip(before, inner.parameters()))
    print("RESULT " + json.dumps({**cb.result.to_dict(), "unchanged": same}))
'''


@pytest.mark.hf  # opt-in: OPCONTRACTS_HF_TESTS=1 (tests/conftest.py)
def test_a_real_trainer_replays_its_bad_step(tmp_path: Path) -> None:
    import json
    import os
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(HF_SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    assert r["always_on"]["steps"] == 2 and r["always_on"]["bad_steps"] == [1, 2]
    f = r["always_on"]["findings"][0]
    assert (f["step"], f["how"], f["reproduced"]) == (1, "replay", True)
    assert "npu_moe_token_unpermute" in f["culprit"]["op"]
    assert f["culprit"]["direction"] == "backward" and f["culprit"]["module"].endswith("mlp")
    assert r["unchanged"] is True  # both bad steps skipped


# --------------------------------------------------------------------------- run --nan-check
RUN_SCRIPT = '''
"""MoE steps on the CPU emulation; from step 2 on the router's fp32 probs reach the unpermute."""
import torch
from torch import nn

from opcontracts import emulation

emulation.install()

import torch_npu  # noqa: E402


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
        y = torch_npu.npu_moe_token_unpermute(out, sorted_indices, probs.to(probs_dtype))  # UNPERMUTE
        return y.float()


torch.manual_seed(0)
model = MoE()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 16)
for step in range(1, 4):
    loss = model(x, torch.bfloat16 if step == 1 else torch.float32).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_run_nan_check_names_the_recurring_culprit_of_an_unmodified_script(
        tmp_path: Path) -> None:
    import json
    import os
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(RUN_SCRIPT, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), OPCONTRACTS_MODE="off",
               OPCONTRACTS_CANN_VERSION="8.0.RC3")  # the kernel takes bf16 probs only
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "opcontracts", "run", "--nan-check", "--report",
                        str(report), str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    nan = json.loads(report.read_text(encoding="utf-8"))["nan_sentinel"]
    assert nan["always_on"]["steps"] == 3 and nan["always_on"]["bad_steps"] == [2, 3]
    f = nan["always_on"]["findings"][0]
    assert (f["step"], f["how"], f["reproduced"], f["at_step"]) == (2, "recurrence", True, 3)
    assert f["culprit"] == nan["first"]
    assert "npu_moe_token_unpermute" in nan["first"]["op"]
    assert nan["first"]["direction"] == "backward"
    assert "the watch, armed from step 3, named the culprit when the NaN recurred at step 3" \
        in p.stderr


def test_on_nan_raise_raises_at_the_recurrence_and_a_failed_check_only_warns(
        moe: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    from opcontracts._observers import stepcheck
    from opcontracts.nan import NonFiniteError

    job = Job(moe)
    with NanSentinel(always_on=True, on_nan="raise"):
        job.step(*job.batch)  # skipped, armed
        with pytest.raises(NonFiniteError, match="npu_moe_token_unpermute"):
            job.step(*job.batch)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("no foreach kernel here")

    monkeypatch.setattr(stepcheck, "screen", broken)
    good = Job(moe, bad=False)
    before = good.params()
    with NanSentinel(always_on=True), pytest.warns(RuntimeWarning, match="runs unchecked"):
        good.step(*good.batch)  # the job goes on: the step is applied
    assert not all(torch.equal(a, b) for a, b in zip(before, good.model.parameters()))
