"""The readers of the wheel tools, on small inputs written like the real files: the schema yaml's
``custom`` section, ``_op_plugin_docs.py`` (Chinese docstrings), ``_meta_registrations.py`` and
``custom_ops.py``.  Everything is read with ``ast`` / text, never executed."""

from __future__ import annotations

from opcontracts.wheel._bindings import parse_bindings
from opcontracts.wheel._docs import doc_blocks, parse_block, parse_docs
from opcontracts.wheel._meta import parse_meta
from opcontracts.wheel._schema import custom_funcs, default_schemas, parse_func

YAML = """\
autograd:
- func: not_custom(Tensor self) -> Tensor
backend: NPU
custom:
- device_check: NoCheck
  func: npu_a(Tensor self, Tensor? other=None, *, int[] size=[1, 2], str mode="a,b") -> Tensor
- func: npu_a.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)
  impl_ns: op_api
- func: 'npu_q(Tensor[] x, Tensor?[] y, int? k=None) -> (Tensor, Tensor)'
quant:
- func: dequantize.self(Tensor self) -> Tensor
"""


def test_custom_section_only_and_quoted_values() -> None:
    funcs = custom_funcs(YAML)
    assert [f.split("(")[0] for f in funcs] == ["npu_a", "npu_a.out", "npu_q"]
    ops = default_schemas(funcs)
    assert set(ops) == {"npu_a", "npu_q"} and ops["npu_a"].overload == ""


def test_schema_arguments() -> None:
    s = parse_func('npu_a(Tensor self, Tensor? other=None, *, int[] size=[1, 2], '
                   'str mode="a,b") -> Tensor')
    assert s.names == ("self", "other", "size", "mode")
    self_, other, size, mode = s.params
    assert self_.is_tensor and not self_.nullable and not self_.kw_only
    assert other.nullable and other.default == "None"
    assert size.kw_only and size.is_list and not size.is_tensor and size.default == "[1, 2]"
    assert mode.default == '"a,b"'  # a comma inside quotes is not a separator
    out = parse_func("npu_a.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)")
    assert out.overload == "out" and out.param("out").type == "Tensor"  # alias annotation gone
    q = parse_func("npu_q(Tensor[] x, Tensor?[] y, int? k=None) -> (Tensor, Tensor)")
    assert q.params[0].is_list and q.params[0].is_tensor and q.returns == "(Tensor, Tensor)"


DOCS = '''
import torch_npu

_add_torch_npu_docstr(
    "npu_toy",
    """
torch_npu.npu_toy(x, gamma=None) -> Tensor
参数说明
x (Tensor) - 数据类型支持bfloat16。
"""
)

_add_torch_npu_docstr(
    "npu_toy",
    """
接口原型：
torch_npu.npu_toy(x, gamma=None) -> Tensor

参数说明：
x：Tensor类型，必选输入，2维Tensor，数据类型支持float16、bfloat16、float32，Ascend 950PR上数据类型额外支持int8。当x数据类型为int8时，gamma必须为None。
gamma：Tensor类型，可选输入，数据类型需要和x保持一致，shape为(H,)。
weight\\\\_scale (Tensor) - 1D float32张量。
输出说明：
out：数据类型支持int64。
"""
)

_add_torch_npu_docstr(
    "npu_chips",
    """
参数说明
- **input**（`Tensor`）：必选参数，支持的数据类型如下:
Atlas A2 训练系列产品/Atlas 800I A2 推理产品: torch.float16、torch.bfloat16.
Atlas 推理系列产品: torch.float16.
- **r1**（`Tensor`）：必选参数，数据类型为`int32`。
- **r2**（`Tensor`）：可选参数，预留参数，当前仅支持传入None。
"""
)
'''


def _docs() -> dict:
    schemas = default_schemas([
        "npu_toy(Tensor x, Tensor? gamma=None, Tensor? weight_scale=None) -> Tensor",
        "npu_chips(Tensor self, Tensor r1, Tensor? r2=None) -> Tensor",
    ])
    return parse_docs(DOCS, schemas)


def test_later_block_wins_and_counts_blocks() -> None:
    blocks = doc_blocks(DOCS)
    assert blocks["npu_toy"][1] == 2 and "float32" in blocks["npu_toy"][0]
    toy = _docs()["npu_toy"]
    assert toy.blocks == 2


def test_dtype_statements_chips_conditions_and_couplings() -> None:
    toy = _docs()["npu_toy"]
    x = toy.args["x"]
    assert x.dtypes == ("float16", "bfloat16", "float32", "int8")
    conds = {s.dtypes: s.condition for s in x.statements}
    assert conds[("float16", "bfloat16", "float32")] is None
    assert "Ascend 950PR" in (conds[("int8",)] or "")  # a chip-only widening, kept apart
    assert x.rank == (2,)
    g = toy.args["gamma"]  # "same dtype as x": x's set, and the coupling
    assert g.same_as == "x" and g.dtypes == x.dtypes
    ws = toy.args["weight_scale"]  # Markdown escape, "1D float32张量"
    assert ws.dtypes == ("float32",) and ws.rank == (1,)
    assert "out" not in toy.args  # the output section is not read as arguments


def test_doc_names_align_with_schema_names_by_position() -> None:
    chips = _docs()["npu_chips"]
    assert set(chips.args) == {"self", "r1", "r2"}
    s = chips.args["self"]
    assert s.doc_name == "input" and s.dtypes == ("float16", "bfloat16")
    assert all(st.condition and "Atlas" in st.condition for st in s.statements)
    assert chips.args["r1"].dtypes == ("int32",)
    r2 = chips.args["r2"]
    assert r2.dtypes is None and r2.reserved and "reserved" in (r2.why or "")


def test_a_condition_clause_is_not_a_statement() -> None:
    doc = parse_block("npu_c", """
参数说明
a：Tensor类型，数据类型支持int8、bool，int8时取值支持0、1。当a的数据类型为int8时，支持float16输出。
""", parse_func("npu_c(Tensor a) -> Tensor"))
    assert doc.args["a"].dtypes == ("int8", "bool")


def test_undocumented_argument_says_why() -> None:
    doc = parse_block("npu_u", "参数说明\nx (Tensor) - 输入张量。\n",
                      parse_func("npu_u(Tensor x, Tensor y) -> Tensor"))
    assert doc.args["x"].dtypes is None and "no dtype statement" in (doc.args["x"].why or "")
    assert "y" not in doc.args


META = '''
import torch
from torch.library import Library, impl
m = Library("npu", "IMPL", "Meta")
other = Library("aten", "IMPL", "Meta")

@impl(m, "npu_toy")
def npu_toy_meta(inp, g=None, flag=False):
    d = inp.dim()
    torch._check(d == 2 or d == 3, lambda: "rank")
    if g is not None:
        torch._check(g.dim() in (1, 2), lambda: "g")
        torch._check(g.dtype == torch.float32, lambda: "g dtype")
    if flag:
        torch._check(inp.dim() == 3, lambda: "only with flag")
    out = torch.empty_like(inp)
    return out, torch.empty([1], dtype=torch.int32, device="meta"), inp.new_empty((2,))

@impl(other, "add")
def not_npu(x):
    return x
'''


def test_meta_kernel_ranks_dtypes_and_outputs() -> None:
    k = parse_meta(META)
    assert set(k) == {"npu_toy"}
    toy = k["npu_toy"]
    assert toy.params == ("inp", "g", "flag") and toy.checks == 4
    assert toy.ranks == {"inp": (2, 3), "g": (1, 2)}  # `g is not None`: holds whenever given
    assert toy.cond_ranks == {"inp": (3,)}            # under `if flag:`: some calls only
    assert toy.dtypes == {"g": ("float32",)}
    assert toy.outputs == ["same as inp", "int32", "same as inp"]


def test_bindings() -> None:
    src = ("import torch\nimport torch_npu\n"
           "torch_npu.npu_a = torch.ops.npu.npu_a\n"
           "torch_npu.npu_b = torch.ops.npu.npu_other\n"
           "torch_npu.x.y = torch.ops.npu.npu_c\n"
           "something = torch.ops.aten.add\n")
    assert parse_bindings(src) == {"npu_a": "npu_a", "npu_b": "npu_other"}
