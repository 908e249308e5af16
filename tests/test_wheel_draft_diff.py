"""``opcontracts wheel draft`` and ``diff`` from the committed digest: every draft of 2.14.0
loads as a contract file, at least ~100 ops are drafted completely, every rule carries its doc
line; diff shows what a ``when`` table must follow (unpermute's probs)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from opcontracts.cli import main
from opcontracts.spec import load_contracts
from opcontracts.wheel import diff, digest, draft


@pytest.fixture(scope="module")
def drafts_2140() -> list[draft.Draft]:
    d = digest.load()
    out, _ = draft.draft_release(draft.releases(d), d.release("2.14.0"))
    return out


def test_every_draft_of_2140_loads_and_most_are_complete(drafts_2140: list[draft.Draft],
                                                         tmp_path: Path) -> None:
    assert len(drafts_2140) == len(digest.load().release("2.14.0").docs) - 3  # 3 blocks: no op
    paths = draft.write(drafts_2140, tmp_path)
    loaded = load_contracts(tmp_path)  # every file parses and validates
    assert {c.op for c in loaded} == {dr.op for dr in drafts_2140} and len(paths) == len(loaded)
    complete = [dr for dr in drafts_2140 if dr.status == "complete"]
    strict = [dr for dr in complete if dr.tensors and not dr.reserved]
    assert len(strict) >= 100  # a doc dtype for every tensor argument
    assert draft.summary_line(drafts_2140).startswith(f"{len(drafts_2140)} op(s) drafted: "
                                                      f"{len(complete)} completely")


def test_a_draft_carries_its_doc_lines(drafts_2140: list[draft.Draft]) -> None:
    dq = next(dr for dr in drafts_2140 if dr.op == "npu_dynamic_quant")
    text = dq.text
    assert 'signature = ["input", "smooth_scales", "group_index", "dst_type"' in text
    block = text.split("[contract.args.smooth_scales]")[1].split("\n\n")[0]
    assert 'dtype = ["fp16", "bf16"]' in block and 'same_dtype_as = "input"' in block
    assert "optional = true" in block
    before = text.split("[contract.args.smooth_scales]")[0].rsplit("\n\n", 1)[1]
    assert before.startswith("# doc: smooth_scales: Tensor类型") and "数据类型支持" in before
    # an undocumented argument is a TODO, not a guess
    gmm = next(dr for dr in drafts_2140 if dr.op == "npu_grouped_matmul")
    assert "# TODO: per-chip or per-scenario statements" in gmm.text
    assert gmm.status == "complete" and gmm.reserved  # offset & co.: "只支持传入None"


def test_when_of_a_draft_names_the_releases_with_the_same_doc(drafts_2140: list[draft.Draft]
                                                              ) -> None:
    unpermute = next(dr for dr in drafts_2140 if dr.op == "npu_moe_token_unpermute")
    assert ('when = {torch_npu = ["==2.7.1.post11", "==2.9.0.post9", "==2.10.0.post7", '
            '"==2.11.0.post3", ">=2.12.0.post3"]}') in unpermute.text


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def test_cli_draft_skips_contracted_ops(tmp_path: Path) -> None:
    rc, out = _cli("wheel", "draft", "2.14.0", "--op", "npu_moe_*", "-o", str(tmp_path))
    assert rc == 0
    written = sorted(p.name for p in tmp_path.glob("*.toml"))
    assert "npu_moe_token_unpermute.toml" not in written  # a shipped contract exists
    assert "npu_moe_gating_top_k.toml" not in written  # shipped since issue 15
    assert "npu_moe_update_expert.toml" in written  # documented, no contract
    assert "op(s) drafted:" in out and "completely" in out and "not at all" in out
    load_contracts(tmp_path)


def test_diff_follows_unpermute_probs() -> None:
    d = digest.load()
    for old, new, was, now in [("2.7.1", "2.7.1.post11", "bf16", "bf16/fp16/fp32"),
                               ("2.7.1", "2.13.0", "bf16", "bf16/fp16/fp32"),
                               ("2.7.1.post11", "2.9.1", "bf16/fp16/fp32", "bf16")]:
        res = diff.diff(d.release(old), d.release(new), "npu_moe_token_unpermute")
        [ch] = res.changed
        assert f"probs: doc dtypes {was} -> {now}" in ch.changes
    res = diff.diff(d.release("2.5.1"), d.release("2.5.1.post1"))
    assert {"npu_moe_token_permute", "npu_moe_token_unpermute"} <= set(res.added)
    same = diff.diff(d.release("2.13.0"), d.release("2.14.0"), "npu_moe_*")
    assert same.empty


def test_cli_diff_text_and_json() -> None:
    rc, out = _cli("wheel", "diff", "2.7.1", "2.7.1.post11", "--op", "npu_moe_token_unpermute")
    assert rc == 0 and "probs: doc dtypes bf16 -> bf16/fp16/fp32" in out
    rc, out = _cli("wheel", "diff", "2.7.1", "2.13.0", "--json", "-", "--op", "npu_moe_token_*")
    data = json.loads(out)
    ops = {c["op"]: c["changes"] for c in data["changed"]}
    assert "sorted_indices: doc dtypes int64 -> int32" in ops["npu_moe_token_unpermute"]
