"""``opcontracts scan``: call sites found through the ways real code reaches a fused op, and
whether a contract guards each on the stacks judged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opcontracts._tools.scan import defined_ops, scan, sites_in_source


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


def test_ops_the_code_defines_itself_are_found() -> None:
    """dlinfer's graph placeholders live in torch.ops.atb but are its own ops (custom_op)."""
    found = defined_ops(textwrap.dedent("""
        import torch
        from torch.library import Library, custom_op
        @torch._custom_op.impl.custom_op("atb::linear")
        def linear(a, b): ...
        @custom_op("npu::my_rope", mutates_args=())
        def rope(x): ...
        torch.library.define("atb::inplace_div(Tensor x, Tensor y) -> Tensor")
        lib = Library("atb", "FRAGMENT")
        lib.define("allreduce(Tensor x, str op) -> Tensor")
        torch.library.custom_op("mylib::other", mutates_args=())   # not a scanned namespace
        torch.ops.atb._npu_paged_attention(1)                       # a call, not a definition
    """))
    assert found == {"torch.ops.atb.linear", "torch.ops.npu.my_rope",
                     "torch.ops.atb.inplace_div", "torch.ops.atb.allreduce"}


def test_calls_of_the_code_s_own_ops_are_not_counted(tmp_path: Path) -> None:
    """A definition in one file of a folder scanned covers the calls in the others; another
    folder scanned alongside is not affected."""
    own = tmp_path / "dlinfer"
    own.mkdir()
    (own / "ext_ops.py").write_text('import torch\n'
                                    '@torch._custom_op.impl.custom_op("atb::linear")\n'
                                    'def linear(a, b): ...\n')
    (own / "patterns.py").write_text("import torch\n"
                                     "torch.ops.atb.linear.default(1, 2)\n"
                                     "torch.ops.atb._npu_paged_attention(1)\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "m.py").write_text("import torch\ntorch.ops.atb.linear(1, 2)\n")
    res = scan([own, other])
    assert [(s.file, s.op) for s in res.sites] == [
        ("dlinfer/patterns.py", "torch.ops.atb._npu_paged_attention"),
        ("other/m.py", "torch.ops.atb.linear")]
    assert [(s.file, s.line, s.op) for s in res.defined_here] == [
        ("dlinfer/patterns.py", 2, "torch.ops.atb.linear")]
    out = _cli(str(own), cwd=tmp_path)
    assert "1 fused-op call site(s) in 2 file(s)" in out.stdout
    assert ("not counted: 1 call(s) of ops the code defines itself (torch.library): "
            "torch.ops.atb.linear (1)") in out.stdout
    data = json.loads(_cli(str(own), "--json", cwd=tmp_path).stdout)
    assert data["defined_here"] == [{"file": "patterns.py", "line": 2, "op": "torch.ops.atb.linear"}]


def test_torch_npu_names_of_atb_ops_are_the_atb_ops(tmp_path: Path) -> None:
    """vllm-ascend calls torch_npu._npu_paged_attention: torch_npu binds ATB's op under that
    name, so the contract on torch.ops.atb._npu_paged_attention guards it."""
    (tmp_path / "m.py").write_text("import torch_npu\n"
                                   "torch_npu._npu_paged_attention(query=1)\n"
                                   "torch_npu._npu_flash_attention_unpad(query=1)\n"
                                   "torch_npu._npu_dropout(1, 0.1)\n"
                                   "torch_npu._npu_no_such_op(1)\n")
    res = scan([tmp_path])
    assert [(s.op, s.status) for s in res.sites] == [
        ("torch_npu._npu_paged_attention", "guarded"),
        ("torch_npu._npu_flash_attention_unpad", "guarded"),
        ("torch_npu._npu_dropout", "guarded"), ("torch_npu._npu_no_such_op", "unknown")]


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
