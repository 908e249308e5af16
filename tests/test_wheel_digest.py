"""The digest: reading wheels (zip, folder, unpacked tree), building, saving deterministically,
loading, comparing, the library API (``op_schemas``), and the opt-in test against the real wheels.

The opt-in test runs only with ``OPCONTRACTS_WHEELS=DIR`` (a folder of downloaded torch_npu
wheels): it rebuilds the digest from them and asserts it equals the committed one (restricted
to the versions found).  Without it, it is skipped with a message saying how to run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from opcontracts.wheel import _source, digest

EIGHT = ["2.5.1", "2.7.1", "2.7.1.post11", "2.9.0.post9", "2.12.0", "2.12.0.post3", "2.13.0",
         "2.14.0"]
POST_WITH_213_DOCS = ["2.7.1.post11", "2.9.0.post9", "2.10.0.post7", "2.11.0.post3",
                      "2.12.0.post3", "2.13.0", "2.14.0"]

SCHEMA = """\
backend: NPU
custom:
- func: npu_toy(Tensor x, Tensor? gamma=None, *, bool flag=False) -> Tensor
  impl_ns: op_api
- func: npu_toy.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)
{extra}supported:
- add
"""
DOCS = '''
_add_torch_npu_docstr(
    "npu_toy",
    """
参数说明
x：Tensor类型，2维Tensor，数据类型支持{dtypes}。
gamma：Tensor类型，可选输入，数据类型与x一致。
"""
)
'''
META = '''
from torch.library import Library, impl
m = Library("npu", "IMPL", "Meta")

@impl(m, "npu_toy")
def npu_toy_meta(x, gamma=None, flag=False):
    torch._check(x.dim() == 2, lambda: "2-D")
    return torch.empty_like(x, dtype=torch.float32)
'''
BINDINGS = "import torch\nimport torch_npu\ntorch_npu.npu_toy = torch.ops.npu.npu_toy\n"
# torchgen's layout: the _WIN32 twin without TORCH_API, one member a line, a list member
FUNCTIONS_H = """\
#ifdef _WIN32
struct NpuToyBackward0 : public TraceableFunction {
  TORCH_API NpuToyBackward0() = default;
#else
struct TORCH_API NpuToyBackward0 : public TraceableFunction {
#endif
  using TraceableFunction::TraceableFunction;
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return "NpuToyBackward0"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    gamma_.reset_data();
    result_.reset_data();
  }
  bool flag;
  SavedVariable gamma_;
  at::ScalarType x_scalar_type;
  SavedVariable result_;

};
struct TORCH_API NpuOtherBackward0 : public TraceableFunction {
  std::vector<SavedVariable> weights_;
  bool weights_released_ = false;
  SavedVariable nowhere_;
};
"""


def make_wheel(folder: Path, version: str, *, dtypes: str = "float16、bfloat16",
               extra: str = "", nodes: bool = True) -> Path:
    """A tiny torch_npu wheel with the five files the tools read (and METADATA); ``nodes``:
    with the autograd header (the only file a wheel may lack)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"torch_npu-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"torch_npu-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n"
                   "Requires-Dist: torch==2.13.0.*\nRequires-Dist: numpy\n")
        z.writestr(_source.PATHS["schema"], SCHEMA.format(extra=extra))
        z.writestr(_source.PATHS["docs"], DOCS.replace("{dtypes}", dtypes))
        z.writestr(_source.PATHS["meta"], META)
        z.writestr(_source.PATHS["bindings"], BINDINGS)
        if nodes:
            z.writestr(_source.PATHS["autograd"], FUNCTIONS_H)
    return path


def test_read_a_wheel_a_folder_and_an_unpacked_tree(tmp_path: Path) -> None:
    w = make_wheel(tmp_path / "w", "9.1.0")
    make_wheel(tmp_path / "w", "9.0.0.post2")
    one = _source.read_one(w)
    assert one.version == "9.1.0" and one.torch == "2.13.0" and set(one.files) == set(_source.PATHS)
    assert [x.version for x in _source.read_wheels([tmp_path / "w"])] == ["9.0.0.post2", "9.1.0"]
    tree = tmp_path / "tree"
    with zipfile.ZipFile(w) as z:
        z.extractall(tree)
    assert _source.read_one(tree).files == one.files


def test_unreadable_inputs_name_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "torch_npu-1.0-x.whl"
    bad.write_text("not a zip")
    with pytest.raises(_source.WheelReadError, match="not a readable wheel"):
        _source.read_one(bad)
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("x/METADATA", "Version: 1\n")
    with pytest.raises(_source.WheelReadError, match="not a torch_npu wheel"):
        _source.read_one(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(_source.WheelReadError, match="no torch_npu-.*pip download"):
        _source.read_wheels([tmp_path / "empty"])
    with pytest.raises(_source.WheelReadError, match="no such file"):
        _source.read_wheels([tmp_path / "missing"])
    with pytest.raises(digest.DigestError, match="not a digest"):
        digest.loads(b"garbage", "x.json.gz")


def test_build_is_deterministic_content_addressed_and_restrictable(tmp_path: Path) -> None:
    make_wheel(tmp_path, "9.0.0")
    make_wheel(tmp_path, "9.0.0.post1")  # byte-identical files: one group
    make_wheel(tmp_path, "9.1.0", dtypes="float32", extra="- func: npu_new(Tensor a) -> Tensor\n")
    wheels = _source.read_wheels([tmp_path])
    data = digest.build(wheels)
    assert digest.dumps(data) == digest.dumps(digest.build(wheels))  # same bytes, no timestamp
    d = digest.Digest(data)
    groups = d.groups("docs")
    assert sorted(groups.values()) == [["9.0.0", "9.0.0.post1"], ["9.1.0"]]
    r = d.release("9.1.0")
    assert set(r.schemas) == {"npu_toy", "npu_new"} and r.torch == "2.13.0"
    assert r.docs["npu_toy"].args["x"].dtypes == ("float32",)
    assert r.docs["npu_toy"].args["gamma"].same_as == "x"
    assert r.meta_ranks("npu_toy")[0] == {"x": (2,)}
    assert r.meta_outputs("npu_toy") == ["float32"]
    assert r.bound("npu_toy") and not r.bound("npu_new")
    # a digest of a subset of the wheels equals the full one restricted to them
    sub = digest.build(_source.read_wheels([tmp_path / "torch_npu-9.0.0-cp311-cp311-"
                                            "manylinux_2_28_x86_64.whl"]))
    assert digest.compare(d.restrict(["9.0.0"]), sub) == []
    differences = digest.compare(data, sub)
    assert differences[:2] == ["version 9.0.0.post1 only in the first",
                               "version 9.1.0 only in the first"]
    changed = digest.build(_source.read_wheels([make_wheel(tmp_path / "b", "9.0.0",
                                                           dtypes="int8")]))
    assert "docs" in " ".join(digest.compare(sub, changed))
    path = tmp_path / "d.json.gz"
    size = digest.save(data, path)
    assert size == path.stat().st_size and digest.load(path).versions == d.versions


def test_the_autograd_nodes_say_what_each_derivative_saves(tmp_path: Path) -> None:
    """Functions.h's nodes, by the op's schema: argument names, and output indices
    (``result`` of a one-output op is output 0); an optional file."""
    data = digest.build(_source.read_wheels([make_wheel(tmp_path, "9.0.0"),
                                             make_wheel(tmp_path / "b", "9.1.0", nodes=False)]))
    old, new = digest.Digest(data).release("9.0.0"), digest.Digest(data).release("9.1.0")
    assert old.nodes == {"NpuToyBackward0": ["gamma", "result"],
                         "NpuOtherBackward0": ["weights", "nowhere"]}
    assert old.node_saves("npu_toy") == ("gamma", 0)
    assert old.node_saves("npu_new") is None  # no node of that name
    assert new.nodes == {} and new.node_saves("npu_toy") is None  # no header: nothing known
    assert "autograd" in " ".join(digest.compare(data, digest.build(
        _source.read_wheels([make_wheel(tmp_path / "c", "9.0.0", nodes=False)]))))
    legacy = {k: v for k, v in data.items() if k != "autograd"}  # a digest made before
    assert digest.Digest(digest.loads(digest.dumps(legacy))).release("9.0.0").nodes == {}


def test_the_shipped_digest_has_the_nodes_of_the_emulated_derivatives() -> None:
    """What torch_npu's nodes keep, release by release (``Functions.h`` of each wheel): the
    unpermute node saves the permuted tokens where the public op is a plain op, the internal
    op's second output where it has one; the permute node stops saving its inputs with the
    v2 grad op."""
    d = digest.load()
    assert d.release("2.7.1").node_saves("npu_moe_token_unpermute") == (
        "permuted_tokens", "probs", "sorted_indices")
    assert d.release("2.12.0.post3").node_saves("_npu_moe_token_unpermute") == (
        "probs", "sorted_indices", 1)
    assert d.release("2.12.0.post3").node_saves("npu_moe_token_unpermute") is None
    assert d.release("2.7.1").node_saves("npu_moe_token_permute") == ("indices", "tokens", 1)
    assert d.release("2.14.0").node_saves("npu_moe_token_permute") == (1,)
    assert d.release("2.14.0").node_saves("npu_cross_entropy_loss") == ("target", "weight", 1, 3)
    assert all(d.release(v).nodes for v in d.versions)


def test_the_shipped_digest_covers_the_releases() -> None:
    d = digest.load()
    assert set(EIGHT) <= set(d.versions) and len(d.versions) >= 17
    assert d.versions == sorted(d.versions, key=Version)
    # the 2.13 docs ship byte-identical in these post releases (the reason for the when rework)
    wide = d.release("2.13.0").file_id("docs")
    assert [v for v in d.versions if d.release(v).file_id("docs") == wide] == POST_WITH_213_DOCS
    assert d.release(wide).version == "2.7.1.post11"  # a file id names its first release
    assert digest.default_path().stat().st_size < 200_000
    with pytest.raises(KeyError, match="not in the digest"):
        d.release("2.99.0")


def test_op_schemas_is_a_library_api() -> None:
    ops = digest.op_schemas("2.14.0")
    assert len(ops) == 398
    unpermute = ops["npu_moe_token_unpermute"][0]
    assert unpermute.func.startswith("npu_moe_token_unpermute(Tensor permuted_tokens")
    probs = unpermute.param("probs")
    assert probs is not None and probs.is_tensor and probs.nullable and probs.default == "None"
    gmm = ops["npu_grouped_matmul"][0]
    assert gmm.param("x").is_list and gmm.param("bias").kw_only
    assert "npu_moe_token_unpermute" not in digest.op_schemas("2.5.1")


def test_reading_wheels_and_the_digest_imports_neither_torch_nor_torch_npu(tmp_path: Path
                                                                         ) -> None:
    wheel = make_wheel(tmp_path, "9.0.0")
    code = ("import sys\nfrom opcontracts.wheel import _source, digest\n"
            f"built = digest.Digest(digest.build(_source.read_wheels([{str(wheel)!r}])))\n"
            "assert built.release('9.0.0').docs['npu_toy'].args['x'].dtypes\n"
            "r = digest.load().release('2.14.0')\n"
            "assert r.schema('npu_swiglu') and r.docs['npu_swiglu'].args['self'].dtypes\n"
            "assert r.meta_ranks('npu_moe_token_permute')[0]['tokens'] == (2,)\n"
            "bad = [m for m in ('torch', 'torch_npu', 'pydantic') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


WHEELS = os.environ.get("OPCONTRACTS_WHEELS")


@pytest.mark.skipif(not WHEELS, reason=(
    "opt-in: set OPCONTRACTS_WHEELS=DIR, a folder of torch_npu wheels downloaded with `pip "
    "download --no-deps --only-binary=:all: --python-version 3.11 --platform "
    "manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d DIR torch-npu==VERSION`, to "
    "rebuild the digest from them and compare it with the committed one"))
def test_committed_digest_equals_one_rebuilt_from_the_real_wheels() -> None:
    assert WHEELS is not None
    wheels = _source.read_wheels([WHEELS])
    committed = digest.load()
    versions = [w.version for w in wheels]
    assert set(versions) <= set(committed.versions), "wheels newer than the digest: rebuild it"
    rebuilt = digest.build(wheels)
    assert digest.compare(committed.restrict(versions), rebuilt) == []


def _cli(*argv: str) -> tuple[int, str]:
    import io
    from contextlib import redirect_stdout

    from opcontracts.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


TOY = """
[[contract]]
op = "npu_toy"
targets = ["torch_npu.npu_toy", "torch.ops.npu.npu_toy"]
signature = ["x", "gamma", "flag"]
[contract.args.x]
dtype = ["fp16", "bf16"]
rank = 2
[contract.args.gamma]
same_dtype_as = "x"
optional = true
"""


def test_cli_on_wheel_files(tmp_path: Path) -> None:
    a = make_wheel(tmp_path / "w", "9.0.0")
    b = make_wheel(tmp_path / "w", "9.1.0", dtypes="float32",
                   extra="- func: npu_new(Tensor a) -> Tensor\n")
    out = tmp_path / "d.json.gz"
    rc, text = _cli("wheel", "digest", str(tmp_path / "w"), "-o", str(out))
    assert rc == 0 and "2 release(s), 2 docstring group(s)" in text and out.exists()
    assert _cli("wheel", "digest", str(a), "--check", str(out))[0] == 0
    changed = make_wheel(tmp_path / "other", "9.0.0", dtypes="int8")
    rc, text = _cli("wheel", "digest", str(changed), "--check", str(out))
    assert rc == 1 and "differs" in text
    rc, text = _cli("wheel", "diff", str(a), str(b))
    assert rc == 0 and "ops added (1): npu_new" in text
    assert "x: doc dtypes bf16/fp16 -> fp32" in text
    rc, text = _cli("wheel", "diff", f"{out}@9.0.0", f"{out}@9.1.0")
    assert "x: doc dtypes bf16/fp16 -> fp32" in text
    toy = tmp_path / "toy.toml"
    toy.write_text(TOY, encoding="utf-8")
    rc, text = _cli("wheel", "verify", str(a), "--no-shipped", "--contracts", str(toy))
    assert rc == 0, text
    rc, text = _cli("wheel", "verify", str(b), "--no-shipped", "--contracts", str(toy))
    assert rc == 1 and "! (a) x: allows bf16/fp16" in text and "! (c) x: the doc lists fp32" in text
    rc, text = _cli("wheel", "draft", str(b), "-o", str(tmp_path / "drafts"))
    assert rc == 0 and "1 op(s) drafted: 1 completely" in text
    drafted = (tmp_path / "drafts" / "npu_toy.toml").read_text(encoding="utf-8")
    assert 'dtype = ["fp32"]' in drafted and "# meta kernel: torch._check demands rank 2" in drafted
    assert 'when = {torch_npu = [">=9.1.0"]}' in drafted
