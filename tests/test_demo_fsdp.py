"""``opcontracts demo --ranks N --fsdp 1|2`` (issue 17): the incident on several ranks under FSDP.

Three real two-rank jobs, once each for the module (gloo on the CPU; each takes ~5-10 s on a
2-core machine, most of it starting the processes and importing torch in each):

* ``fsdp1``: ``python -m opcontracts demo --ranks 2 --fsdp 1 --json``: the demo starts its own
  processes (torch's elastic launcher);
* ``fsdp2``: ``torchrun --standalone --nproc-per-node 2 -m opcontracts demo --ranks 2 --fsdp 2
  --json``: the processes are torchrun's, the demo must not spawn;
* ``tensor_checks``: ``torchrun ... tests/_fsdp_tensor_checks.py``: guards, the signature memo
  and fix mode on FSDP1's flat parameters and FSDP2's DTensors, and their gradients.

Each is bounded (``timeout``) and retried once if it died of a port clash.  The rendezvous is on
``localhost:0`` (the OS hands out a free port as the store binds it), so a clash should not
happen at all; the retry is for the ports gloo and the agent open themselves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from opcontracts import cli
from opcontracts._observers import modpath
from opcontracts._tools import demo_dist
from opcontracts.nan import NanEvent

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available")

TIMEOUT_S = 240
HERE = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OPCONTRACTS_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env


def _job(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a multi-process command, bounded; once more if it died of a port clash."""
    for attempt in (1, 2):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        print(f"{' '.join(cmd[1:6])} ...: {time.perf_counter() - t0:.1f} s, exit "
              f"{proc.returncode}")
        if proc.returncode == 0 or attempt == 2 or not demo_dist._port_clash(
                proc.stdout + proc.stderr):
            return proc
    raise AssertionError("unreachable")


def _demo_job(tmp: Path, cmd: list[str]) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp / "demo.json"
    proc = _job([*cmd, "--json", str(out)], tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    return _demo_job(tmp_path_factory.mktemp("fsdp1"),
                     [sys.executable, "-m", "opcontracts", "demo", "--ranks", "2", "--fsdp", "1"])


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    return _demo_job(tmp_path_factory.mktemp("fsdp2"),
                     [*TORCHRUN, "-m", "opcontracts", "demo", "--ranks", "2", "--fsdp", "2"])


def _by_name(scenarios: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in scenarios}


def _assert_story(data: dict[str, Any], fsdp: int) -> None:
    """Every rank's four outcomes, as the story says."""
    assert data["ok"] is True and data["ranks"] == 2 and data["fsdp"] == fsdp
    assert data["backend"] == "gloo" and data["profile"] == "incident"
    assert data["ranks_ok"] == {n: [0, 1] for n in ("reference", "unguarded", "strict", "fix")}
    losses = []
    for rank, scenarios in enumerate(data["per_rank"]):
        sc = _by_name(scenarios)
        ref, ung, strict, fix = sc["reference"], sc["unguarded"], sc["strict"], sc["fix"]
        assert all(s["ok"] for s in scenarios), rank
        assert ref["nonfinite"] is False and ref["max_abs_diff"] == 0.0
        # the incident on every rank: the forward agrees with the reference, the gradients NaN
        assert ung["loss"] == pytest.approx(ref["loss"], rel=1e-3)
        assert ung["nonfinite"] is True and ung["grad_norm"] == "nan"
        assert strict["raised"] == "ContractViolation"
        assert strict["violation"]["arg"] == "probs"
        assert "npu_moe_token_unpermute" in strict["violation"]["op"]
        assert f"[rank {rank}]" in strict["error"]
        assert fix["nonfinite"] is False and fix["loss"] == pytest.approx(ref["loss"], rel=1e-2)
        assert 0 < fix["rel_err"] < 0.1
        assert fix["fixes"] and "'probs'" in fix["fixes"][0]
        # fix mode's cast is autograd-tracked: every router's fp32 probs get finite gradients
        assert fix["probs_grads"] == ["finite"] * 3
        losses.append(ref["loss"])
    assert losses[0] != losses[1]  # each rank its own data shard
    # gradient numbers are the whole model's (summed over the shards): the same on each rank
    assert (data["per_rank"][0][0]["grad_norm"] == data["per_rank"][1][0]["grad_norm"]
            == data["scenarios"][0]["grad_norm"])


def _assert_paths(data: dict[str, Any], raw: str) -> None:
    """The sentinel's first culprit, named as the job names the module and without wrappers."""
    nan = data["nan"]["unguarded"]
    first = nan["first"]
    assert "npu_moe_token_unpermute" in first["op"] and first["direction"] == "backward"
    assert first["module_type"] == "MoELayer"
    assert first["call_site"].startswith("moe_block.py:")
    m = re.fullmatch(raw, first["module"])
    assert m, first["module"]
    assert first["module_clean"] == f"layers.{m.group(1)}.mlp"
    assert nan["seen_by"] == [0, 1]
    for group in nan["firsts"]:
        assert re.fullmatch(r"layers\.\d\.mlp", group["event"]["module_clean"])
        assert re.fullmatch(raw, group["event"]["module"])
    assert data["nan"]["fix"]["first"] is None and data["nan"]["fix"]["clean"] == [0, 1]
    # the golden compare (contracts off) names the unpermute backward too, on every rank
    cmp = data["compare"]
    assert cmp["checked"] > 0 and cmp["ranks"] == [0, 1]
    assert cmp["first"]["rank"] == 0 and cmp["first"]["direction"] == "backward"
    assert "npu_moe_token_unpermute" in cmp["first"]["op"]
    assert sorted(cmp["per_rank"]) == ["0", "1"]
    for e in cmp["per_rank"].values():
        m = re.fullmatch(raw, e["module"])
        assert m and e["module_clean"] == f"layers.{m.group(1)}.mlp"


def _assert_report(data: dict[str, Any]) -> None:
    """The violations of both ranks, merged by ``opcontracts.report(gather=True)``."""
    recs = {r["mode"]: r for r in data["report"]["records"]}
    assert set(recs) == {"strict", "fix"}
    for r in recs.values():
        assert "npu_moe_token_unpermute" in r["op"] and r["arg"] == "probs"
        assert r["rule"] == "dtype" and r["ranks"] == [0, 1]
        assert r["call_site"].startswith("moe_block.py:")
    assert recs["strict"]["count"] == 2  # one raise per rank
    assert recs["fix"]["count"] == recs["fix"]["fixed"] == 6  # three MoE layers, two ranks


@needs_gloo
def test_fsdp1_self_launched(fsdp1: tuple[subprocess.CompletedProcess[str], dict[str, Any]]
                             ) -> None:
    proc, data = fsdp1
    _assert_story(data, 1)
    _assert_paths(data, r"_fsdp_wrapped_module\.module\.layers\.(\d)\._fsdp_wrapped_module\.mlp")
    _assert_report(data)
    out = proc.stdout
    assert "starting 2 process(es)" in out and "launcher: 2 process(es)" in out
    assert out.count("all four outcomes as described on every rank") == 1  # rank 0 only
    assert out.count("[1/4] reference") == 1
    assert "module path in the job" in out and "unwrapped: layers." in out
    assert "contract violations, every rank" in out
    assert "golden compare (opcontracts.compare, contracts off)" in out


@needs_gloo
def test_fsdp2_under_torchrun(fsdp2: tuple[subprocess.CompletedProcess[str], dict[str, Any]]
                              ) -> None:
    proc, data = fsdp2
    _assert_story(data, 2)
    # FSDP2 renames nothing: the path is the model's own under Megatron's wrapper (.module)
    _assert_paths(data, r"module\.layers\.(\d)\.mlp")
    _assert_report(data)
    out = proc.stdout
    assert "starting 2 process(es)" not in out  # torchrun's processes: nothing spawned
    assert out.count("all four outcomes as described on every rank") == 1
    assert "_fsdp_wrapped_module" not in out


@needs_gloo
def test_fsdp1_and_fsdp2_compute_the_same_step(
        fsdp1: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
        fsdp2: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    a, b = fsdp1[1], fsdp2[1]
    for ra, rb in zip(a["per_rank"], b["per_rank"]):
        for sa, sb in zip(ra, rb):
            if isinstance(sa["loss"], float):
                assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-6)
    assert a["scenarios"][0]["grad_norm"] == pytest.approx(b["scenarios"][0]["grad_norm"],
                                                           rel=1e-4)


@needs_gloo
def test_guards_memo_and_fix_on_fsdp_tensors(tmp_path: Path) -> None:
    out = tmp_path / "checks"
    proc = _job([*TORCHRUN, str(HERE / "_fsdp_tensor_checks.py"), str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        data = json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
        for fsdp in ("fsdp1", "fsdp2"):
            c = data[fsdp]
            where = f"rank {rank}, {fsdp}"
            # in forward (FSDP1: views of the flat parameter; FSDP2: the unsharded Parameter)
            assert c["forward_weight_type"] == ("Tensor" if fsdp == "fsdp1" else "Parameter")
            assert c["fix_warned"] and c["fix_grads_equal"] and c["fix_grads_nonzero"], where
            assert c["param_dtypes_after_fix"] == ["torch.bfloat16"], where  # never in place
            assert c["strict_forward"] == ["w", "dtype"], where
            assert c["memo_forward"] == [1, 1], where  # learnt once, then answered by the memo
            assert c["memo_forward_then_violation"] == ["t", "dtype"], where
            # outside forward: the sharded parameter and its gradient
            assert c["param_conforming"] == [None, None], where
            assert c["param_then_violation"] == ["t", "dtype"], where
            assert c["param_wrong_dtype"] == ["t", "dtype"], where
            assert c["grad_conforming"] is None and c["grad_wrong_dtype"] == ["t", "dtype"]
        f1, f2 = data["fsdp1"], data["fsdp2"]
        assert f1["param_type"] == "Parameter (flat)" and len(f1["param_shape"]) == 1
        assert f1["memo_param"] == 1  # a flat parameter is an nn.Parameter: memoised
        assert f1["grad_type"] == "Tensor"
        # a DTensor shows the guard its global shape; the memo leaves tensor subclasses alone
        assert f2["param_type"] == "DTensor"
        assert f2["param_shape"] == [8, 16] and f2["param_local_shape"] == [4, 16]
        assert f2["memo_param"] == 0
        assert f2["grad_type"] == "DTensor"
        assert f2["dtensor_fix_grad_equal"] and f2["dtensor_fix_grad_type"] == "DTensor"


# --------------------------------------------------------------------------- no processes
@pytest.mark.parametrize(("path", "clean"), [
    ("_fsdp_wrapped_module.module.gpt.transformer.model.layers.2._fsdp_wrapped_module.mlp.moe",
     "gpt.transformer.model.layers.2.mlp.moe"),  # the incident's report
    ("_fsdp_wrapped_module.module.layers.1._fsdp_wrapped_module.mlp", "layers.1.mlp"),
    ("layers.0._checkpoint_wrapped_module.mlp", "layers.0.mlp"),
    ("_orig_mod.layers.3.mlp", "layers.3.mlp"),
    ("layers.2.mlp", "layers.2.mlp"),  # FSDP2: nothing to take out
    ("_fsdp_wrapped_module", ""),       # the root
    ("", ""),
    (None, None),
    ("MoEModel > MoELayer", "MoEModel > MoELayer"),  # not registered under the root
])
def test_module_paths_without_wrappers(path: str | None, clean: str | None) -> None:
    assert modpath.clean(path) == clean


def _event(module: str | None) -> NanEvent:
    return NanEvent("npu_moe_token_unpermute_grad", "backward", "output", "output[0]", "bfloat16",
                    (256, 64), 64, 3, "moe_block.py:107 in forward", module, "MoELayer",
                    "npu_moe_token_unpermute")


def test_sentinel_event_names_both_paths() -> None:
    raw = "_fsdp_wrapped_module.module.layers.2._fsdp_wrapped_module.mlp"
    ev = _event(raw)
    assert ev.module_clean == "layers.2.mlp" and ev.to_dict()["module_clean"] == "layers.2.mlp"
    msg = ev.message()
    assert f"module:    {raw} (MoELayer)" in msg
    assert "unwrapped: layers.2.mlp" in msg
    plain = _event("layers.2.mlp")  # nothing to take out: no second line
    assert plain.module_clean == "layers.2.mlp" and "unwrapped" not in plain.message()


def test_bad_options(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["demo", "--fsdp", "2"]) == 2
    assert "give --ranks N too" in capsys.readouterr().err
    assert cli.main(["demo", "--ranks", "0"]) == 2
    assert "--ranks must be between 1 and" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["demo", "--ranks", "3"]) == 2  # under torchrun: the job's size decides
    assert "one rank of a job of 2" in capsys.readouterr().err


def test_launch_retries_once_on_a_port_clash(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.launcher.api as api

    calls: list[str] = []

    def fake(errors: list[BaseException | None]) -> Any:
        class Launch:
            def __init__(self, config: Any, entrypoint: Any) -> None:
                calls.append(config.run_id)
                assert config.rdzv_endpoint == "localhost:0" and config.max_restarts == 0

            def __call__(self, *args: Any) -> dict[int, Any]:
                err = errors.pop(0)
                if err is not None:
                    raise err
                return {0: 0, 1: 0}

        return Launch

    monkeypatch.setattr(api, "elastic_launch", fake(
        [RuntimeError("The server socket has failed to listen: Address already in use"), None]))
    assert demo_dist.launch(2, print) == {0: 0, 1: 0}
    assert len(calls) == 2 and calls[0] != calls[1]  # a new rendezvous the second time

    calls.clear()
    monkeypatch.setattr(api, "elastic_launch", fake([RuntimeError("something else"), None]))
    with pytest.raises(demo_dist.LaunchError, match="something else"):
        demo_dist.launch(2, print)
    assert len(calls) == 1  # no retry for other failures
