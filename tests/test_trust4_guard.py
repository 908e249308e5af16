"""The guard under hostile calls: it never raises for its own reasons, keys what it remembers on
the user's call site and call form, and judges what a user contract or setting cannot widen.
Each test failed on the code before its fix."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts import (
    Arg,
    Contract,
    ContractConditionalWarning,
    ContractFixWarning,
    ContractViolation,
    ContractWarning,
    reference,
)


def _unpermute_args(probs_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    n, k, h = 4, 2, 8
    tokens = torch.randn(n * k, h, dtype=torch.bfloat16)
    idx = torch.randperm(n * k).to(torch.int32)
    return tokens, idx, torch.rand(n, k).to(probs_dtype)


@pytest.fixture
def cann_unknown(npu: Any) -> Any:
    """The emulation with CANN and the chip unknown, whatever it reports: the incident's
    fp32 probs are then conditional (rejected before CANN 8.0.0 only)."""
    opcontracts.set_versions(cann="unknown", soc="unknown")
    return npu


def _stub_guard(op: str) -> tuple[Callable[..., Any], list[Any]]:
    """``enforce(op)`` over a stub with the reference's signature: the guard the patch makes,
    over a kernel that only records that it was reached."""
    ref = reference.get(op)
    assert ref is not None
    reached: list[Any] = []

    def kernel(*args: Any, **kwargs: Any) -> str:
        reached.append((args, kwargs))
        return "ran"

    kernel.__signature__ = inspect.signature(ref.forward)  # type: ignore[attr-defined]
    return opcontracts.enforce(op)(kernel), reached


# --------------------------------------------------------------------------- the guard crashes
def test_a_conditional_call_in_two_forms_at_one_line_runs_both(cann_unknown: Any) -> None:
    """``same() takes 2 positional arguments but 3 were given``: the check learnt for the
    keyword form was called with the positional one."""
    npu = cann_unknown
    tok, idx, p32 = _unpermute_args(torch.float32)
    calls = [lambda: npu.npu_moe_token_unpermute(tok, idx, probs=p32),
             lambda: npu.npu_moe_token_unpermute(tok, idx, p32)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for call in calls * 2:
            out = call()  # one line, two forms
    assert isinstance(out, torch.Tensor)
    assert any(w.category is ContractConditionalWarning for w in seen)


def test_gating_top_k_in_every_form_with_versions_unknown() -> None:
    """``same() got an unexpected keyword argument 'x'``."""
    guard, reached = _stub_guard("npu_moe_gating_top_k")
    ref = reference.get("npu_moe_gating_top_k")
    assert ref is not None and ref.example is not None
    args, kwargs = ref.example(torch.Generator().manual_seed(0))
    forms = [(args, kwargs), ((), dict(kwargs, x=args[0], k=args[1])), ((args[0],), dict(kwargs, k=args[1]))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContractConditionalWarning)
        for mode in ("warn", "strict", "fix"):
            opcontracts.set_mode(mode)
            for a, k in forms * 2:
                assert guard(*a, **k) == "ran"
    assert len(reached) == 18


def test_three_violating_lines_through_a_packet_are_three_sites(npu: Any) -> None:
    """A call through a guarded ``torch.ops.npu`` packet was keyed on the packet's
    ``__call__``: three lines gave one warning and "3 violations at 1 site"."""
    x = torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        torch.ops.npu.npu_swiglu(x)
        torch.ops.npu.npu_swiglu(x)
        torch.ops.npu.npu_swiglu(x)
    lines = {w.lineno for w in seen if w.category is ContractWarning}
    assert len(lines) == 3
    rep = opcontracts.report()
    assert len(rep.records) == 3 and rep.total == 3
    assert len({r.call_site for r in rep.records}) == 3


def test_fix_mode_through_a_packet_repairs_and_records_each_line(npu: Any) -> None:
    opcontracts.set_mode("fix")
    x = torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        a = torch.ops.npu.npu_swiglu(x)
        b = torch.ops.npu.npu_swiglu(x)
    assert a.dtype != torch.float64 and b.dtype != torch.float64
    assert len({w.lineno for w in seen if w.category is ContractFixWarning}) == 2
    assert len(opcontracts.report().records) == 2


def test_conditional_calls_through_a_packet_warn_at_each_line(cann_unknown: Any) -> None:
    tok, idx, p32 = _unpermute_args(torch.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        torch.ops.npu.npu_moe_token_unpermute(tok, idx, p32)
        torch.ops.npu.npu_moe_token_unpermute(tok, idx, p32)
    assert len({w.lineno for w in seen if w.category is ContractConditionalWarning}) == 2


def test_fix_mode_repairs_fusion_attention_v2_with_a_recast_query(npu: Any) -> None:
    """fp32 query: the planner cast key, value and query_rope to fp32, then query_rope back to
    bf16 (its own rule), round after round, and raised "could not repair the call"."""
    opcontracts.set_mode("fix")
    ref = reference.get("npu_fusion_attention_v2")
    assert ref is not None and ref.example is not None
    args, kwargs = ref.example(torch.Generator().manual_seed(0))
    query = args[0].float()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = npu.npu_fusion_attention_v2(query, *args[1:], **kwargs)
    assert out[0].dtype == torch.bfloat16
    assert query.dtype == torch.float32  # the user's tensor untouched
    fixed = [str(w.message) for w in seen if w.category is ContractFixWarning]
    assert fixed and "fixed argument 'query'" in fixed[0]


def test_fix_mode_whose_casts_conflict_says_so_and_raises_as_unrepairable() -> None:
    """A contract no cast can satisfy (y must be bf16 and match x, which must be fp32): fix
    mode reports the violation with what it could not do, as for any call it cannot repair;
    before, its own loop ended in a RuntimeError."""
    c = Contract("conflicting_op", {"x": Arg(dtype=["fp32"]),
                                    "y": Arg(dtype=["bf16"], same_dtype_as="x")})

    @opcontracts.enforce(c)
    def op(x: torch.Tensor, y: torch.Tensor) -> str:
        return "ran"

    opcontracts.set_mode("fix")
    with pytest.raises(ContractViolation) as info:
        op(torch.ones(2), torch.ones(2, dtype=torch.bfloat16))
    assert "fix mode did not cast: the casts it would make conflict" in str(info.value)
    assert not isinstance(info.value, RuntimeError)


# --------------------------------------------------------------------------- item 8
def test_an_expression_dividing_by_an_empty_size_is_not_judged() -> None:
    """``N//G`` with G = 0 raised ZeroDivisionError out of the guard, in warn mode too."""
    c = Contract("grouped_op", {"x": Arg(shape=["N G"]), "y": Arg(shape=["N//G"]),
                                "k": Arg(ge=0, lt="N//G", optional=True)})

    @opcontracts.enforce(c)
    def op(x: torch.Tensor, y: torch.Tensor, k: int = 0) -> str:
        return "ran"

    for mode in ("warn", "strict", "fix"):
        opcontracts.set_mode(mode)
        assert op(torch.ones(4, 0), torch.ones(3)) == "ran"
        assert op(torch.ones(4, 0), torch.ones(3), k=5) == "ran"
    opcontracts.set_mode("strict")
    assert op(torch.ones(4, 2), torch.ones(2), k=1) == "ran"
    with pytest.raises(ContractViolation, match="'y'"):
        op(torch.ones(4, 2), torch.ones(3))


@pytest.mark.parametrize("name", ["my_op\u00b2", "my_\uff4fp", "mine.funci\u00f3n"])
def test_op_names_outside_ascii_work(name: str) -> None:
    """"²" is alphanumeric but no identifier; a fullwidth "ｏ" is an identifier Python reads as
    "o": the checker's generated name broke at compile, or could not be found after it."""
    c = Contract(name, {"x": Arg(dtype=["fp32"])})

    @opcontracts.enforce(c)
    def op(x: torch.Tensor) -> str:
        return "ran"

    assert op(torch.ones(2)) == "ran"
    opcontracts.set_mode("strict")
    with pytest.raises(ContractViolation, match=name):
        op(torch.ones(2, dtype=torch.float64))


# --------------------------------------------------------------------------- item 5: NaN bounds
@pytest.mark.parametrize("bound", [{"ge": 0}, {"le": 4}, {"lt": 4}, {"lt": "N"}, {"ge": "N"}])
def test_a_nan_scalar_satisfies_no_bound(bound: dict[str, Any]) -> None:
    c = Contract("bounded_op", {"x": Arg(shape=["N"]), "k": Arg(**bound)})

    @opcontracts.enforce(c)
    def op(x: torch.Tensor, k: float) -> str:
        return "ran"

    opcontracts.set_mode("strict")
    for k in (float("nan"), torch.tensor(float("nan"))):
        with pytest.raises(ContractViolation, match="'k'"):
            op(torch.ones(4), k)
    with pytest.raises(ContractViolation, match="'k'"):
        opcontracts.check(c, torch.ones(4), float("nan"))


# --------------------------------------------------------------------------- item 5: settings
def test_two_values_of_one_field_are_two_stacks_both_judged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``cann=8.0.RC3,cann=9.1.0`` kept the last value only: the 8.0.RC3 stack, which rejects
    fp32 probs, was never judged."""
    from opcontracts._lang import targets

    monkeypatch.setenv(targets.VAR, "torch_npu=2.13.0,soc=Ascend910B3,cann=8.0.RC3,cann=9.1.0")
    found, _ = targets.declared()
    assert [t.as_dict() for t in found] == [
        {"torch_npu": "2.13.0", "cann": "8.0.RC3", "soc": "Ascend910B3"},
        {"torch_npu": "2.13.0", "cann": "9.1.0", "soc": "Ascend910B3"}]
    opcontracts.set_targets()  # read the variable again
    with pytest.raises(ContractViolation, match="cann 8.0.RC3"):
        opcontracts.check("npu_moe_token_unpermute", *_unpermute_args(torch.float32))
    opcontracts.check("npu_moe_token_unpermute", *_unpermute_args(torch.bfloat16))
    monkeypatch.setenv(targets.VAR, "cann=8.0.RC3,name=a2,name=a5")
    with pytest.raises(opcontracts.SettingError, match="a target has one name"):
        targets.declared()


def test_a_typo_in_the_pyproject_table_is_a_setting_error(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from opcontracts._lang import targets

    monkeypatch.delenv(targets.VAR, raising=False)
    f = tmp_path / "pyproject.toml"
    f.write_text('[tool.opcontracts]\ntarget = [{cann = "8.0.RC3"}]\n', encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(opcontracts.SettingError) as err:
        targets.declared()
    text = str(err.value)
    assert str(f) in text and "'target'" in text and "did you mean 'targets'" in text


def test_a_pyproject_that_is_not_utf8_is_a_setting_error(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from opcontracts._lang import targets

    monkeypatch.delenv(targets.VAR, raising=False)
    f = tmp_path / "pyproject.toml"
    f.write_bytes('# caf\u00e9\n[tool.opcontracts]\ntargets = [{cann = "8.0.RC3"}]\n'
                  .encode("latin-1"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(opcontracts.SettingError) as err:
        targets.declared()
    assert str(f) in str(err.value) and "UTF-8" in str(err.value)


# --------------------------------------------------------------------------- a user file widens
def test_a_verdict_resolved_before_torch_npu_was_imported_is_refreshed() -> None:
    """``opcontracts run`` with a user's file: the patch resolves the file's ops when the
    emulation's install applies it again, before the script imports ``torch_npu``.  torch_npu
    was unknown then, and that resolution was kept after it became known, so a call rejected on
    the known stack was only "conditional"."""
    import sys

    import opcontracts.patch as patch
    from opcontracts import emulation

    was = patch.is_applied()
    patch.unpatch()
    opcontracts.set_versions(cann="8.0.RC3", soc="Ascend910B3")
    try:  # a user's contract for the op (as OPCONTRACTS_CONTRACTS loads one)
        opcontracts.register(Contract("npu_fusion_attention_v2", {"head_num": Arg(ge=1)},
                                      source="golden"))
        emulation.install()
        patch.apply()  # resolves the ops now, torch_npu not imported yet
        assert "torch_npu" not in sys.modules
        import torch_npu

        ref = reference.get("npu_fusion_attention_v2")
        assert ref is not None and ref.example is not None
        args, kwargs = ref.example(torch.Generator().manual_seed(0))
        opcontracts.set_mode("strict")
        with pytest.raises(ContractViolation, match="'query'"):  # int64: no torch_npu takes it
            torch_npu.npu_fusion_attention_v2(args[0].long(), *args[1:], **kwargs)
    finally:
        patch.unpatch()
        emulation.uninstall()
        opcontracts.set_versions(torch_npu=None, cann=None, mindspeed=None, soc=None)
        if was:
            patch.apply()


def test_a_user_contract_on_releases_no_shipped_one_covers_opens_no_door() -> None:
    """CANN 8.0.RC3 pinned, torch_npu unknown: the shipped contracts reject fp32 probs on every
    torch_npu release they cover.  A user's narrowing contract that applies everywhere made
    the releases they do not cover a reading that "accepts", and the rejection conditional."""
    opcontracts.set_versions(cann="8.0.RC3", soc="Ascend910B3", torch_npu=None)
    try:
        with pytest.raises(ContractViolation, match="probs"):
            opcontracts.check("npu_moe_token_unpermute", *_unpermute_args(torch.float32))
        opcontracts.register(Contract("npu_moe_token_unpermute",
                                      {"probs": Arg(rank=2, optional=True)},
                                      when={"torch": ">=0"}, source="our MoE layer: K = 2"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ContractConditionalWarning)
            with pytest.raises(ContractViolation, match="probs"):
                opcontracts.check("npu_moe_token_unpermute", *_unpermute_args(torch.float32))
            opcontracts.check("npu_moe_token_unpermute", *_unpermute_args(torch.bfloat16))
            # the user's own rule still holds
            tok, idx, p = _unpermute_args(torch.bfloat16)
            with pytest.raises(ContractViolation, match="probs"):
                opcontracts.check("npu_moe_token_unpermute", tok, idx, p.reshape(-1))
    finally:
        opcontracts.set_versions(torch_npu=None, cann=None, mindspeed=None, soc=None)


def test_a_digest_whose_release_is_no_version_is_a_clear_error(tmp_path: Any,
                                                               capsys: Any) -> None:
    """``wheel verify --digest`` and ``wheel diff`` ended in an InvalidVersion traceback."""
    import json

    from opcontracts.cli import main as cli_main
    from opcontracts.wheel import digest

    data = digest.loads(digest.default_path().read_bytes())
    first = sorted(data["versions"])[0]
    data["versions"]["garbage"] = data["versions"].pop(first)
    bad = tmp_path / "digest.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    for argv in (["wheel", "verify", "--digest", str(bad)],
                 ["wheel", "diff", f"{bad}@2.14.0", str(bad)]):
        try:
            rc = cli_main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 2
        out, err = capsys.readouterr()
        assert rc == 2, (argv, out, err)
        assert "Traceback" not in err
        assert str(bad) in err and "field 'versions'" in err and "'garbage'" in err


# --------------------------------------------------------------------------- item 17
def test_the_conditional_warning_says_in_its_first_line_what_decides_and_how(
        cann_unknown: Any) -> None:
    """The newcomer's first experiment printed nine lines of combinations such as "soc
    Ascend950 and cann <8.0.0": only CANN decides whether fp32 probs are wrong."""
    tok, idx, p32 = _unpermute_args(torch.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cann_unknown.npu_moe_token_unpermute(tok, idx, p32)
    [w] = [w for w in seen if w.category is ContractConditionalWarning]
    head, *details = str(w.message).splitlines()
    assert head == ("npu_moe_token_unpermute: argument 'probs' has dtype float32 (shape (4, 2)): "
                    "rejected only where cann <8.0.0, and cann is unknown here: conditional "
                    "until a target decides (OPCONTRACTS_TARGETS=\"cann=X\")")
    assert any(d.startswith("  rejected:  cann <8.0.0 (") and d.endswith("expected bfloat16")
               for d in details)
    assert "  accepted:  cann >=8.0.0" in details
    assert len(details) <= 6 and not any("Ascend950" in d for d in details)
