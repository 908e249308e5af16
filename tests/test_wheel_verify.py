"""``opcontracts wheel verify`` against the committed digest, offline: every shipped contract
is clean on the eight releases of issue 14 (and on every release of the digest), and each kind
of finding is detected on contracts written to have it."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from opcontracts._engine.registry import shipped_contracts_dir
from opcontracts.cli import main
from opcontracts.spec import When, contracts_from_toml, load_contracts
from opcontracts.wheel import digest, verify

EIGHT = ["2.5.1", "2.7.1", "2.7.1.post11", "2.9.0.post9", "2.12.0", "2.12.0.post3", "2.13.0",
         "2.14.0"]
# the packs whose ops the wheel's schema files do not hold (MindSpeed's, fla_npu's, ATB's)
NOT_WHEEL = ("mindspeed.", "fla_npu.", "atb.")
SHIPPED = load_contracts(shipped_contracts_dir())


def _kinds(results: list[verify.ContractResult], *, failing: bool | None = None) -> list[str]:
    return [f.kind for r in results for g in r.groups for f in g.findings
            if failing is None or f.fails == failing]


@pytest.mark.parametrize("versions", [EIGHT, None], ids=["eight", "all"])
def test_shipped_contracts_verify_clean(versions: list[str] | None) -> None:
    results = verify.verify(SHIPPED, digest.load(), versions)
    failing = [(r.op, r.when, f.kind, f.arg, v) for r in results for g in r.groups
               for f in g.findings if f.fails for v in g.versions]
    assert failing == []
    s = verify.summary(results, len(versions or digest.load().versions))
    assert (s["false_alarms"], s["unmarked_a"], s["missing"], s["schema"], s["meta"]) == \
        (0, 0, 0, 0, 0)
    # every torch_npu op of the packs (15 before issue 15)
    assert s["ops_verified"] == len({c.op for c in SHIPPED if not c.op.startswith(NOT_WHEEL)})
    # every torch_npu contract is checked against at least one release
    assert all(r.groups for r in results if r.skipped is None)


def test_mindspeed_contracts_are_skipped_not_failed() -> None:
    results = verify.verify(SHIPPED, digest.load(), EIGHT)
    skipped = {r.op for r in results if r.skipped}
    assert skipped == {c.op for c in SHIPPED if c.op.startswith(NOT_WHEEL)}
    assert all("not a torch_npu op" in (r.skipped or "") for r in results if r.skipped)


def test_releases_with_identical_docs_are_one_group() -> None:
    """The CANN-keyed table (issue 23: op-plugin hands the op to aclnn) speaks for every release
    that has the op; the releases are grouped by the doc they bundle."""
    [wide] = [r for r in verify.verify(SHIPPED, digest.load(), EIGHT, "npu_moe_token_unpermute")
              if r.when == "torch_npu >=2.5.1.post1, cann >=8.0.0"]
    assert [g.versions for g in wide.groups] == [
        ["2.7.1"], ["2.7.1.post11", "2.9.0.post9", "2.12.0.post3", "2.13.0", "2.14.0"],
        ["2.12.0"]]
    assert wide.not_covered == ["2.5.1"]


def test_the_old_when_tables_had_false_alarms_on_the_post_releases() -> None:
    """The contracts as they were: bf16-only for ``torch_npu < 2.13`` rejects calls that
    2.7.1.post11, 2.9.0.post9 and 2.12.0.post3 document (a false alarm in strict mode)."""
    [c] = contracts_from_toml("""
[[contract]]
op = "npu_moe_token_unpermute"
targets = ["torch_npu.npu_moe_token_unpermute", "torch.ops.npu.npu_moe_token_unpermute"]
when = {torch_npu = "<2.13"}
[contract.args.permuted_tokens]
dtype = "bf16"
[contract.args.probs]
dtype = "bf16"
optional = true
""")
    [r] = verify.verify([c], digest.load(), EIGHT)
    bad = {(f.kind, f.arg, v) for g in r.groups for f in g.findings for v in g.versions}
    for v in ("2.7.1.post11", "2.9.0.post9", "2.12.0.post3"):
        assert ("c", "probs", v) in bad and ("c", "permuted_tokens", v) in bad
    assert not any(v in ("2.7.1", "2.12.0") for k, _, v in bad if k == "c")
    assert ("missing-op", None, "2.5.1") in bad
    assert r.fails
    # the same rule with a CANN condition is not decided by the version alone: (b), not (c)
    [r2] = verify.verify([c.model_copy(update={"when": When(torch_npu="<2.13", cann="<8.0.0")})],
                         digest.load(), ["2.12.0.post3"])
    assert {f.kind for g in r2.groups for f in g.findings} == {"b"} and not r2.fails


BAD = """
[[contract]]
op = "npu_moe_token_unpermute"
targets = ["torch_npu.npu_moe_token_unpermute", "torch.ops.npu.npu_moe_token_unpermute"]
signature = ["sorted_indices", "permuted_tokens", "probs", "padded_mode", "restore_shape", "no_such_arg"]
when = {torch_npu = ">=2.13"}

[contract.args.permuted_tokens]
dtype = ["bf16", "fp64"]
rank = [2, 3]

[contract.args.sorted_indices]
dtype = "int64"
doc_conflict = "deliberately int64 (a test)"

[contract.args.probs]
dtype = "bf16"

[contract.args.no_such_arg]
dtype = "bf16"

[[contract]]
op = "npu_no_such_op"
[contract.args.x]
dtype = "bf16"

[[contract]]
op = "npu_grouped_matmul"
targets = ["torch_npu.npu_grouped_matmul"]
[contract.args.x]
dtype = "bf16"
"""


def test_each_kind_of_finding_is_detected() -> None:
    unpermute, missing, gmm = contracts_from_toml(BAD, "bad.toml")
    [r] = verify.verify([unpermute], digest.load(), ["2.14.0"])
    found = {(f.kind, f.arg): f for g in r.groups for f in g.findings}
    assert found[("a", "permuted_tokens")].fails          # fp64: not in the doc
    assert "fp64" in found[("a", "permuted_tokens")].text
    assert found[("meta-rank", "permuted_tokens")].fails  # rank 3: the meta kernel wants 2
    assert found[("c", "probs")].fails                    # fp16/fp32 documented, forbidden
    assert found[("optional", "probs")].fails             # Tensor? in the schema
    assert found[("missing-arg", "no_such_arg")].fails
    assert found[("order", None)].fails
    a, c = found[("a", "sorted_indices")], found[("c", "sorted_indices")]
    assert a.marked and c.marked and not a.fails and not c.fails  # doc_conflict marks them
    [m] = verify.verify([missing], digest.load(), ["2.14.0"])
    assert _kinds([m]) == ["missing-op"]
    [g] = verify.verify([gmm], digest.load(), ["2.14.0"])
    assert ("list", "x") in {(f.kind, f.arg) for grp in g.groups for f in grp.findings}


def test_version_only() -> None:
    assert verify.version_only(None)
    assert verify.version_only(When(torch_npu="<2.13"))
    assert verify.version_only(When(torch_npu="<2.13", cann=">=0"))  # holds for every CANN
    assert not verify.version_only(When(torch_npu="<2.13", cann="<8.0.0"))
    assert not verify.version_only(When(soc=["Ascend910B"]))


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_verify_exit_status_table_and_json(tmp_path: Path) -> None:
    rc, out, _ = _cli("wheel", "verify", "--versions", ",".join(EIGHT), "--verbose")
    assert rc == 0 and "all contracts pass" in out
    assert "ok  torch_npu 2.7.1.post11, 2.9.0.post9, 2.12.0.post3, 2.13.0, 2.14.0 (docs " in out
    rc, out, _ = _cli("wheel", "verify", "--versions", "2.14.0", "--json", "-", "--op",
                      "npu_moe_token_permute")
    data = json.loads(out)
    assert rc == 0 and data["summary"]["false_alarms"] == 0
    assert {c["when"] for c in data["contracts"]} >= {"torch_npu >=2.5.1.post1, cann <8.0.0"}
    user = tmp_path / "mine.toml"
    user.write_text(BAD, encoding="utf-8")
    rc, out, _ = _cli("wheel", "verify", "--no-shipped", "--contracts", str(user),
                      "--versions", "2.14.0")
    assert rc == 1 and "! (a) permuted_tokens: allows fp64" in out
    assert "~ (a) sorted_indices" in out and "[doc_conflict: deliberately int64 (a test)]" in out
    assert "3 contract(s) fail" in out
    rc, _, err = _cli("wheel", "verify", "--versions", "9.9.9")
    assert rc == 2 and "not in the digest" in err
    rc, _, err = _cli("wheel", "verify", str(tmp_path / "nowhere"))
    assert rc == 2 and "no such file" in err
