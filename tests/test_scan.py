"""``opcontracts scan``: call sites found through the ways real code reaches a fused op, and
whether a contract guards each on the stacks judged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opcontracts._tools.scan import scan, sites_in_source


def _sites(src: str, **kw: object) -> list[tuple[int, str]]:
    return sites_in_source(textwrap.dedent(src), **kw)  # type: ignore[arg-type]


def test_every_form_of_reaching_an_op_is_one_site_each() -> None:
    found = _sites("""
        import torch
        import torch_npu as tnpu
        from torch_npu import npu_gelu as gelu
        from torch.ops import npu
        ops = torch.ops.npu
        def f(x):
            tnpu.npu_moe_token_unpermute(x, x, x)
            gelu(x)
            torch.ops.npu.npu_rms_norm.default(x, x)
            npu.npu_swiglu(x)
            ops.npu_grouped_matmul([x], [x])
            getattr(tnpu, "npu_format_cast")(x, 2)
            torch.ops.atb._npu_paged_attention(x)
            fn = tnpu.npu_rotary_mul
            fn(x, x, x)
    """)
    assert found == [(8, "torch_npu.npu_moe_token_unpermute"), (9, "torch_npu.npu_gelu"),
                     (10, "torch_npu.npu_rms_norm"), (11, "torch_npu.npu_swiglu"),
                     (12, "torch_npu.npu_grouped_matmul"), (13, "torch_npu.npu_format_cast"),
                     (14, "torch.ops.atb._npu_paged_attention"), (16, "torch_npu.npu_rotary_mul")]


def test_what_is_not_a_fused_op_is_not_counted() -> None:
    found = _sites("""
        import torch, torch_npu
        torch_npu.npu.set_device(0)          # the device module, not an op
        torch.npu.synchronize()
        torch.nn.functional.gelu(torch.ones(1))
        x = torch_npu                        # a reference, no call
        def npu_swiglu(x): return x          # a local function of that name
        npu_swiglu(1)
    """)
    assert found == []


def test_mindspeed_wrappers_absolute_and_relative(tmp_path: Path) -> None:
    pkg = tmp_path / "mindspeed" / "core"
    pkg.mkdir(parents=True)
    (tmp_path / "mindspeed" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "moe.py").write_text(textwrap.dedent("""
        from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
        from ..ops import gmm
        from mindspeed.ops.gmm import check_optional_tensor
        def f(t, i, p, x, w):
            check_optional_tensor(x)                 # a helper: not an op
            gmm.npu_gmm(x, w, group_list=None)
            return npu_moe_token_unpermute(t, i, p)
    """))
    res = scan([tmp_path])
    ops = sorted((s.op, s.status) for s in res.sites)
    assert ops == [("mindspeed.ops.gmm.npu_gmm", "guarded"),
                   ("mindspeed.ops.npu_moe_token_unpermute.npu_moe_token_unpermute", "guarded")]


def test_a_check_named_like_an_op_is_listed_apart_not_counted(tmp_path: Path) -> None:
    """MindSpeed's npu_gmm_param_verification checks arguments in Python and launches no
    kernel: no contract could guard anything there, so it is neither a site nor unguarded."""
    pkg = tmp_path / "mindspeed" / "ops"
    pkg.mkdir(parents=True)
    (tmp_path / "mindspeed" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "quant_gmm.py").write_text(textwrap.dedent("""
        from mindspeed.ops import gmm
        def f(x, w):
            gmm.npu_gmm_param_verification(x, w, bias=None, group_list=None)
            return gmm.npu_gmm(x, w)
    """))
    res = scan([tmp_path])
    assert [(s.op, s.status) for s in res.sites] == [("mindspeed.ops.gmm.npu_gmm", "guarded")]
    assert [(s.file, s.line, s.op) for s in res.not_ops] == [
        (str(Path("mindspeed/ops/quant_gmm.py")), 4,
         "mindspeed.ops.gmm.npu_gmm_param_verification")]
    out = _cli(".", cwd=tmp_path)
    assert "1 fused-op call site(s) in 3 file(s); 1 guarded (100%)" in out.stdout
    assert "named like an op, not one" in out.stdout and "launches none" in out.stdout
    data = json.loads(_cli(".", "--json", cwd=tmp_path).stdout)
    assert data["totals"]["sites"] == 1
    assert [d["op"] for d in data["not_ops"]] == ["mindspeed.ops.gmm.npu_gmm_param_verification"]


def test_guarded_depends_on_the_stacks_judged(tmp_path: Path) -> None:
    # permute/unpermute are absent before torch_npu 2.7.1: their contracts name later releases
    (tmp_path / "m.py").write_text("import torch_npu\ntorch_npu.npu_moe_token_unpermute(1, 2)\n"
                                   "torch_npu.npu_nms_v4(1)\n")
    here = scan([tmp_path])
    assert [s.status for s in here.sites] == ["guarded", "unknown"]
    old = scan([tmp_path], targets=["torch_npu=2.5.1"])
    assert old.sites[0].status == "excluded"
    both = scan([tmp_path], targets=["torch_npu=2.5.1", "torch_npu=2.13.0"])
    assert both.sites[0].status == "partly"
    assert both.judged_on == ["target (torch_npu 2.5.1)", "target (torch_npu 2.13.0)"]


def test_tests_and_excluded_folders_are_left_out_when_asked(tmp_path: Path) -> None:
    for rel in ("src/a.py", "tests/test_a.py", "src/legacy/b.py"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("import torch_npu\ntorch_npu.npu_swiglu(1)\n")
    assert len(scan([tmp_path]).sites) == 3
    assert [s.file for s in scan([tmp_path], skip_tests=True, exclude=["src/legacy"]).sites] == \
        ["src/a.py"]


def test_a_file_that_does_not_parse_is_named_and_the_rest_scanned(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("def (:\n")
    (tmp_path / "bin.py").write_bytes(b"\xff\xfe torch_npu")
    (tmp_path / "ok.py").write_text("import torch_npu\ntorch_npu.npu_swiglu(1)\n")
    res = scan([tmp_path])
    assert len(res.sites) == 1
    assert sorted(Path(f).name for f, _ in res.unreadable) == ["bad.py", "bin.py"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opcontracts", "scan", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_cli_text_json_and_exit_codes(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import torch_npu\ntorch_npu.npu_swiglu(1)\n"
                                   "torch_npu.npu_nms_v4(1)\n")
    out = _cli(".", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "2 fused-op call site(s) in 1 file(s); 1 guarded (50%), 1 not" in out.stdout
    assert "torch_npu.npu_nms_v4" in out.stdout and "no contract: m.py:3" in out.stdout
    assert _cli(".", "--fail-unguarded", cwd=tmp_path).returncode == 1
    data = json.loads(_cli(".", "--json", cwd=tmp_path).stdout)
    assert data["totals"] == {"sites": 2, "guarded": 1, "unguarded": 1}
    assert data["ops"]["torch_npu.npu_nms_v4"] == {"sites": 1, "status": "unknown"}
    missing = _cli("nowhere", cwd=tmp_path)
    assert missing.returncode == 2 and "nowhere" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_scan_imports_no_torch() -> None:
    code = ("import sys, opcontracts._tools.scan as s; s.scan([s.__file__]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("form", ["x = torch_npu.npu_swiglu\nx(1)", "torch_npu.npu_swiglu(1)"])
def test_a_name_bound_after_its_first_use_still_resolves(form: str) -> None:
    src = f"def f():\n    {form.replace(chr(10), chr(10) + '    ')}\nimport torch_npu\n"
    assert [op for _, op in sites_in_source(src)] == ["torch_npu.npu_swiglu"]
