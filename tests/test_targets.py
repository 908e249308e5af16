"""Targets (the stacks a call is judged against) and conditional verdicts (a call only some of
the stacks still possible reject: warned, not raised, not cast)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractConditionalWarning, ContractViolation, When
from opcontracts._engine import registry
from opcontracts._lang import targets
from opcontracts.errors import SettingError

# two readings of one op, as the shipped permute contracts have them: CANN's kernel widened
# the indices to int32 in 8.0.0
NEW = Contract("tgt_op", {"x": Arg(["bf16", "fp32"]), "i": Arg(["int64", "int32"])},
               when=When(cann=">=8.0.0"), source="CANN 8.0.0 aclnn docs", layer="cann")
OLD = Contract("tgt_op", {"x": Arg("bf16"), "i": Arg("int64")},
               when=When(cann="<8.0.0"), source="CANN 8.0.RC3 aclnn docs", layer="cann")


def _target_op(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return x


@pytest.fixture
def op() -> Any:
    registry.register([NEW, OLD])
    with opcontracts.versions(cann="unknown"):
        yield opcontracts.enforce("tgt_op")(_target_op)


X = torch.zeros(4, dtype=torch.bfloat16)
I64, I32, I16 = (torch.zeros(4, dtype=d) for d in (torch.int64, torch.int32, torch.int16))


def _conditional(fn: Any, *args: Any) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [w for w in caught if issubclass(w.category, ContractConditionalWarning)]


# --------------------------------------------------------------------------- conditional
def test_conditional_call_warns_in_strict_instead_of_raising(op: Any) -> None:
    with opcontracts.mode("strict"):
        assert op(X, I64) is X
        shown = _conditional(op, X, I32)
        assert len(shown) == 1
        text = str(shown[0].message)
        assert "argument 'i' has dtype int32" in text
        head, *details = text.splitlines()  # the first line: what decides, how to decide
        assert "rejected only where cann <8.0.0, and cann is unknown here" in head
        assert 'conditional until a target decides (OPCONTRACTS_TARGETS="cann=X")' in head
        assert "  rejected:  cann <8.0.0: expected int64" in details
        assert "  source:    CANN 8.0.RC3 aclnn docs (layer cann" in text
        assert "  accepted:  cann >=8.0.0" in details
        assert "OPCONTRACTS_TARGETS=\"cann=X\"" in text and "OPCONTRACTS_CANN_VERSION" in text
        assert shown[0].filename == __file__  # at the user's line
        assert not opcontracts.report().records  # a conditional call is no violation
        # a call every reading rejects is still a violation, and says why
        with pytest.raises(ContractViolation) as err:
            op(X, I16)
        assert "readings:  cann unknown: rejected on each of the 2 readings" in str(err.value)


def test_the_end_of_run_summary_names_conditional_calls(op: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from opcontracts._engine import conditional

    # the summary covers the whole session (reset() keeps it): start this test's from nothing
    monkeypatch.setattr(conditional, "_seen", {})
    with opcontracts.mode("strict"):
        _conditional(op, X, I32)
    [line] = conditional.summary()
    assert "tgt_op 'i' (cann)" in line and "declare the target" in line


def test_conditional_warns_once_per_site_and_repeats_skip_the_readings(op: Any) -> None:
    from opcontracts._engine import conditional

    with opcontracts.mode("strict"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(5):
            op(X, I32)
    assert len([w for w in caught if w.category is ContractConditionalWarning]) == 1
    [(message, _, _, learnt)] = conditional._sites.values()
    assert learnt  # the call's metadata: repeats need no careful check
    with opcontracts.mode("strict"), pytest.raises(ContractViolation):
        op(X, I16)  # other metadata at the same line: judged again, and rejected everywhere


def test_check_judges_as_a_guard_does(op: Any) -> None:
    assert len(_conditional(opcontracts.check, "tgt_op", X, I32)) == 1  # no raise
    with pytest.raises(ContractViolation, match="rejected on each of the 2 readings"):
        opcontracts.check("tgt_op", X, I16)


def test_fix_mode_does_not_cast_a_conditional_call(op: Any) -> None:
    seen: list[torch.dtype] = []

    def spy(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        seen.append(i.dtype)
        return x

    guarded = opcontracts.enforce("tgt_op")(spy)
    with opcontracts.mode("fix"):
        x32 = torch.zeros(4)  # fp32 x: accepted on CANN >= 8 only
        shown = _conditional(guarded, x32, I64)
        assert shown and seen == [torch.int64]
        assert not opcontracts.report().records


def test_a_declared_target_decides(op: Any) -> None:
    with opcontracts.mode("strict"):
        opcontracts.set_targets(cann="8.0.RC3")
        with pytest.raises(ContractViolation) as err:
            op(X, I32)
        assert "expected int64" in str(err.value)
        assert "source:    CANN 8.0.RC3 aclnn docs (layer cann" in str(err.value)
        opcontracts.set_targets(cann="9.1.0")
        assert not _conditional(op, X, I32)  # accepted, silently
        opcontracts.set_targets()  # back to nothing declared: conditional again
        assert _conditional(op, X, I32)


def test_several_targets_a_call_must_hold_on_every_one(op: Any) -> None:
    prev = opcontracts.set_targets({"cann": "9.1.0", "name": "a3"}, "cann=8.0.RC3,name=a2")
    assert prev == ()
    res = registry.resolution("tgt_op")
    assert res is not None and [r.stack for r in res.readings] == [0, 1]
    with opcontracts.mode("strict"):
        with pytest.raises(ContractViolation) as err:
            op(X, I32)
        assert "readings:  rejected on target 'a2' (cann 8.0.RC3)" in str(err.value)
        assert op(X, I64) is X
    assert opcontracts.set_targets() == ({"cann": "9.1.0", "name": "a3"},
                                         {"cann": "8.0.RC3", "name": "a2"})


def test_the_hot_path_checks_the_strictest_reading() -> None:
    """What a conforming call runs is the strictest merge's checker: nothing per call decides
    between readings."""
    registry.register([NEW, OLD])
    prev = opcontracts.set_versions(cann="unknown")
    try:
        res = registry.resolution("tgt_op")
        assert res is not None and res.split
        assert res.strict.args["i"].dtype == ("int64",)
        assert {r.label for r in res.readings} == {"cann <8.0.0", "cann >=8.0.0"}
        opcontracts.set_versions(cann="8.0.0")
        res = registry.resolution("tgt_op")
        assert res is not None and not res.split and res.strict is NEW
    finally:
        opcontracts.set_versions(**prev)


def test_a_chip_only_rule_is_conditional_when_the_chip_is_unknown() -> None:
    base = Contract("tgt_chip", {"x": Arg(["bf16", "fp32"])})
    chip = Contract("tgt_chip", {"x": Arg("bf16")}, when=When(soc=["Ascend310P"]))
    registry.register([base, chip])
    prev = opcontracts.set_versions(soc="unknown")
    try:
        guarded = opcontracts.enforce("tgt_chip")(lambda x: x)
        with opcontracts.mode("strict"):
            [w] = _conditional(guarded, torch.zeros(2))
            assert "rejected only where soc Ascend310P" in str(w.message)
            opcontracts.set_targets(soc="Ascend310P3")
            with pytest.raises(ContractViolation):
                guarded(torch.zeros(2))
            opcontracts.set_targets(soc="Ascend910B3")
            guarded(torch.zeros(2))
    finally:
        opcontracts.set_versions(**prev)


# --------------------------------------------------------------------------- where targets come from
def test_env_var_format_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(targets.VAR, "cann=8.0.RC3, soc=Ascend910B3; torch_npu=2.7.1.post6,cann=8.5.0,name=llm")
    found, origin = targets.declared()
    assert origin == "$OPCONTRACTS_TARGETS"
    assert [t.as_dict() for t in found] == [{"cann": "8.0.RC3", "soc": "Ascend910B3"},
                                           {"torch_npu": "2.7.1.post6", "cann": "8.5.0", "name": "llm"}]
    for bad, says in [("cann=8.x", "OPCONTRACTS_TARGETS, field cann: '8.x' is not a version"),
                      ("cuda=12", "unknown field 'cuda'"),
                      ("cann=8.0.0; soc", "OPCONTRACTS_TARGETS (target 2 of 2): 'soc' is not name=value")]:
        monkeypatch.setenv(targets.VAR, bad)
        with pytest.raises(SettingError, match="OPCONTRACTS_TARGETS") as err:
            targets.declared()
        assert says in str(err.value)
    monkeypatch.setenv(targets.VAR, "none")
    assert targets.declared() == ((), "$OPCONTRACTS_TARGETS")


def test_a_bad_env_var_stops_the_start_up_not_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(targets.VAR, "cann=eight")
    with pytest.raises(SettingError, match="OPCONTRACTS_TARGETS, field cann"):
        opcontracts.enforce("npu_moe_token_permute")(lambda tokens, indices: tokens)


def test_a_bad_env_var_stops_import_opcontracts_patch() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env[targets.VAR] = "cann=eight"
    proc = subprocess.run([sys.executable, "-c", "import opcontracts.patch"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "opcontracts.errors.SettingError: OPCONTRACTS_TARGETS, field cann: 'eight' is not a "
        "version (try '2.10.0.post4' or '8.0.RC3')")


def test_pyproject_found_from_the_working_directory_upwards(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(targets.VAR, raising=False)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.opcontracts]\n'
        'targets = [{cann = "8.0.RC3", soc = "Ascend910B3"}, {name = "a5", cann = "9.1.0"}]\n')
    deep = tmp_path / "src" / "pkg"
    deep.mkdir(parents=True)
    (tmp_path / "src" / "pyproject.toml").write_text('[project]\nname = "inner, not ours"\n')
    monkeypatch.chdir(deep)
    found, origin = targets.declared()
    assert origin == str(tmp_path / "pyproject.toml")
    assert [t.label for t in found] == ["target (cann 8.0.RC3, soc Ascend910B3)",
                                        "target 'a5' (cann 9.1.0)"]
    # the variable wins over the file, set_targets over both
    monkeypatch.setenv(targets.VAR, "cann=8.5.0")
    assert targets.declared()[1] == "$OPCONTRACTS_TARGETS"
    opcontracts.set_targets(cann="7.0.0")
    assert targets.declared()[1] == "set_targets()"
    opcontracts.set_targets()
    monkeypatch.delenv(targets.VAR)
    (tmp_path / "pyproject.toml").write_text('[tool.opcontracts]\ntargets = [{cann = 8}]\n')
    with pytest.raises(SettingError) as err:
        targets.declared()
    assert str(err.value).startswith(f"{tmp_path / 'pyproject.toml'}, [tool.opcontracts] targets[0], "
                                     "field cann: expected a non-empty string, got int 8")


def test_targets_win_over_detection_and_fill_what_they_name() -> None:
    from opcontracts._lang.versions import Env

    env = Env(torch_npu="2.13.0", cann=None, origins=(("torch_npu", "emulation"),),
              emulated=("torch_npu",))
    [one] = targets.stacks(env, targets.parse_targets_text("torch_npu=2.10.0.post4,cann=9.1.0"))
    assert (one.torch_npu, one.cann, one.emulated) == ("2.10.0.post4", "9.1.0", ())
    assert one.origin("cann") == "$OPCONTRACTS_TARGETS"
    assert targets.stacks(env, ()) == (env,)


def test_judged_stacks_for_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a tool (the msprobe-dump reader) asks: the stacks to judge against, from its own
    flags, else the declared targets, else this environment."""
    monkeypatch.setenv(targets.VAR, "cann=8.0.RC3")
    [(label, env)] = targets.judged()
    assert label == "target (cann 8.0.RC3)" and env.cann == "8.0.RC3"
    [(label, env), _] = targets.judged(["cann=9.1.0,name=a5", "cann=8.5.0"])
    assert label == "target 'a5' (cann 9.1.0)"
    monkeypatch.setenv(targets.VAR, "none")
    [(label, env)] = targets.judged()
    assert label == "this environment"
    registry.register([NEW, OLD])
    res = registry.resolution_on("tgt_op", targets.parse_targets_text("cann=8.0.RC3"))
    assert not res.split and res.strict is OLD


def test_env_command_shows_the_targets_and_where_from(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from opcontracts import cli

    monkeypatch.setenv(targets.VAR, "cann=8.0.RC3,name=a2")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "target 'a2' (cann 8.0.RC3)" in out and "$OPCONTRACTS_TARGETS" in out
    monkeypatch.setenv(targets.VAR, "cann=8.x")
    assert cli.main(["env"]) == 2
    assert "OPCONTRACTS_TARGETS, field cann: '8.x' is not a version" in capsys.readouterr().out


# --------------------------------------------------------------------------- the call
def test_all2allv_dispatch_with_int32_ids_passes_strict_with_no_target(npu: Any) -> None:
    """vllm-ascend's All2AllV expert-parallel dispatch (router ids cast to int32) on the
    emulation, strict mode, CANN unknown and no target: the call is not a violation.  (The
    emulation states its profile's CANN, 8.0.RC3 under the default one, whose kernel takes
    int64 ids: unknown is declared here.)"""
    assert os.environ.get(targets.VAR) is None and targets.declared() == ((), "")
    opcontracts.set_versions(cann="unknown")
    hidden_states = torch.randn(8, 16, dtype=torch.bfloat16)
    topk_ids = torch.randint(0, 4, (8, 2))
    with opcontracts.mode("strict"):
        permuted, sorted_indices = npu.npu_moe_token_permute(
            hidden_states, topk_ids.to(torch.int32), num_out_tokens=topk_ids.numel())
    assert permuted.shape == (16, 16) and sorted_indices.shape == (16,)
    assert not opcontracts.report().records


def test_fix_mode_says_why_it_does_not_cast_integers() -> None:
    c = Contract("tgt_fix", {"i": Arg("int64"), "t": Arg("bf16")})
    guarded = opcontracts.enforce(c)(lambda i, t: i)
    with opcontracts.mode("fix"), pytest.raises(ContractViolation) as err:
        guarded(I32, torch.zeros(2, dtype=torch.bfloat16))
    assert ("(fix mode did not cast: fix mode casts floats only; an integer or bool cast "
            "(int32 -> int64) needs fix = \"cast\" on the argument") in str(err.value)


def test_torch_compile_judges_on_the_readings_too(op: Any) -> None:
    """The trace-time decision (``_engine/traced.py``) treats a conditional call as eager does:
    a warning, and the call traced as it came (fullgraph: no raise at trace time)."""
    compiled = torch.compile(lambda x, i: op(x, i) + 1, backend="eager", fullgraph=True)
    with opcontracts.mode("strict"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(X, I32)
    assert torch.equal(out, X + 1)
    assert any(w.category is ContractConditionalWarning for w in caught)
    with opcontracts.mode("strict"), pytest.raises(Exception, match="rejected on each of the 2 readings|expected int64"):
        torch.compile(lambda x, i: op(x, i) + 1, backend="eager", fullgraph=True)(X, I16)
