"""The contract model and contract files, including every malformed-file message."""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import opcontracts
from opcontracts import Arg, Contract, ContractFileError, load_contracts
from opcontracts._lang.dtypes import parse_dtype

GOOD = """
[[contract]]
op = "my_unpermute"
targets = ["mypkg.ops.unpermute"]
source = "mypkg 1.0, docs/unpermute.md"

[contract.args.tokens]
dtype = ["bf16", "fp16"]
shape = "N*K H"

[contract.args.probs]
dtype = "torch.bfloat16"
shape = "N K"
optional = true
"""


@pytest.mark.parametrize("name, dt", [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("fp32", torch.float32), ("float", torch.float32), ("half", torch.float16),
    ("int32", torch.int32), ("long", torch.int64), ("bool", torch.bool), (torch.int8, torch.int8),
])
def test_dtype_names(name, dt):
    assert parse_dtype(name) is dt


def test_arg_normalises_dtypes_and_is_frozen():
    a = Arg(["bf16", torch.float16], "N K")
    assert a.dtype == ("bfloat16", "float16")
    assert a.shape == ("N K",)
    with pytest.raises(ValidationError):
        a.dtype = ("float32",)  # type: ignore[misc]


def test_contract_positional_and_relations():
    c = Contract("op", {"a": Arg("bf16"), "b": Arg(same_dtype_as="a")})
    assert c.op == "op" and set(c.args) == {"a", "b"}
    with pytest.raises(ValueError, match="not an argument"):
        Contract("op", {"b": Arg(same_dtype_as="zzz")})


def test_load_file_and_folder(tmp_path: Path):
    (tmp_path / "a.toml").write_text(GOOD)
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.toml").write_text(GOOD.replace("my_unpermute", "other_op"))
    cs = load_contracts(tmp_path)
    assert [c.op for c in cs] == ["my_unpermute", "other_op"]
    assert cs[0].file == str(tmp_path / "a.toml")
    assert cs[0].targets == ("mypkg.ops.unpermute",)
    assert cs[0].args["probs"].optional


MALFORMED = [
    ('[[contract]]\nop = "x"\n[contract.args.a]\ndtype = "bf17"\n', "x", "args.a.dtype", "unknown dtype 'bf17'"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\nshape = "N**2"\n', "x", "args.a.shape", "only integers"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\ncolour = "red"\n', "x", "args.a.colour", "unknown field"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\nsame_dtype_as = "b"\n', "x", "args.a.same_dtype_as", "not an argument"),
    ('[[contract]]\n[contract.args.a]\ndtype = "bf16"\n', "#0", "op", "missing required field"),
    ('[[contract]]\nop = "x"\n', "x", "args", "missing required field"),
    ('[[contract]]\nop = "x"\ntargets = ["not a path"]\n[contract.args.a]\ndtype="bf16"\n', "x", "targets", "dotted path"),
    ('[[contract]]\nop = "x"\nwhen = {cann = "newest"}\n[contract.args.a]\ndtype="bf16"\n', "x", "when.cann", "not a version specifier"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\nrank = -1\n', "x", "args.a.rank", "non-negative"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\nshape = ["N K", "A B"]\n', "x", "args.a.shape", "differ in rank"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\ndtype_value = true\n', "x", "args.a.dtype_value", "needs dtype"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\ndtype_value = true\ndtype = "bf16"\nshape = "N"\n', "x", "args.a.dtype_value", "no tensor rules"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\ndtype_of = "t"\n', "x", "args.a.dtype_of", "needs the contract's rules_of"),
]


@pytest.mark.parametrize("text, contract, field, fragment", MALFORMED)
def test_malformed_files_name_file_contract_field(tmp_path: Path, text, contract, field, fragment):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ContractFileError) as ei:
        load_contracts(f)
    e = ei.value
    assert e.file == str(f)
    assert e.contract == contract
    assert e.field == field
    assert fragment in str(e)
    assert str(f) in str(e)


def test_invalid_toml_and_missing_file(tmp_path: Path):
    f = tmp_path / "broken.toml"
    f.write_text("[[contract]\n")
    with pytest.raises(ContractFileError, match="invalid TOML") as ei:
        load_contracts(f)
    assert ei.value.file == str(f)
    with pytest.raises(ContractFileError, match="no such file"):
        load_contracts(tmp_path / "nope.toml")


def test_unknown_top_level_key(tmp_path: Path):
    f = tmp_path / "k.toml"
    f.write_text('[[contracts]]\nop = "x"\n')
    with pytest.raises(ContractFileError, match="unknown top-level key"):
        load_contracts(f)


def test_contract_arg_not_in_signature_is_clear():
    c = Contract("x", {"nope": Arg("bf16")})
    with pytest.raises(ContractFileError, match="'nope'.*takes \\(a, b\\)"):
        opcontracts.enforce(c)(lambda a, b: None)


def test_wrapper_without_optional_or_scalar_arguments_of_the_op():
    c = Contract("x", {"a": Arg("bf16"), "probs": Arg("bf16", optional=True),
                       "padded_mode": Arg(allowed=[False])})

    @opcontracts.enforce(c)
    def wrapper(a):  # passes padded_mode=False and no probs itself
        return a

    with opcontracts.mode("strict"):
        wrapper(torch.ones(1, dtype=torch.bfloat16))
        with pytest.raises(opcontracts.ContractViolation):
            wrapper(torch.ones(1))
    with pytest.raises(ContractFileError, match="'a'"):
        opcontracts.enforce(c)(lambda probs: None)


# ---------------------------------------------------------------- issue 13: bad input, clear errors
def _contract(arg_lines: str, top: str = "") -> str:
    return f'[[contract]]\nop = "x"\n{top}[contract.args.a]\n{arg_lines}\n'


WRONG_TYPES = [
    (_contract("shape = 5"), "args.a.shape", "got 5"),
    (_contract("rank = 2.5"), "args.a.rank", "got float 2.5"),
    (_contract('rank = "two"'), "args.a.rank", "got str 'two'"),
    (_contract('dtype = "bf16"', "targets = 3\n"), "targets", "got int 3"),
    (_contract('dtype = "bf16"\nsame_dtype_except = true'), "args.a.same_dtype_except", "got bool True"),
    (_contract("dtype = 1979-05-27"), "args.a.dtype", "date"),
    (_contract("shape = 1979-05-27T07:32:00"), "args.a.shape", "1979"),
    (_contract("allowed = [1979-05-27]"), "args.a.allowed", "date"),
    (_contract('shape = "N//0"'), "args.a.shape", "divides by zero"),
    (_contract('shape = "0*D"'), "args.a.shape", "multiplies by zero"),
    (_contract('shape = "' + "+".join(["N"] * 1500) + '"'), "args.a.shape", "at most"),
    (_contract('shape = "' + " + ".join(["N"] * 1500) + '"'), "args.a.shape", "at most 64"),
    (_contract('list = "yes"'), "args.a.list", "valid boolean, got str 'yes'"),
    (_contract("list = true\nmax_len = -1"), "args.a.max_len", "greater than or equal to 1"),
    (_contract("numel_lt = -3"), "args.a.numel_lt", "greater than or equal to 1"),
    (_contract("optional = 1"), "args.a.optional", "valid boolean"),
    (_contract('shape = "N"\ndims = {N = {le = true}}'), "args.a.dims.N.le", "valid integer"),
    (_contract('dtype = "bf16"', "same_device = \"no\"\n"), "same_device", "valid boolean"),
    (_contract('dtype = {a = 1}'), "args.a.dtype", "expected a dtype name"),
    (_contract('colour = "red"'), "args.a.colour", "Arg fields:"),
    (_contract('shpe = "N"'), "args.a.shpe", "did you mean 'shape'"),
]


@pytest.mark.parametrize("text, field, fragment", WRONG_TYPES,
                         ids=[f"{f}:{frag[:20]}" for _, f, frag in WRONG_TYPES])
def test_wrong_types_in_any_field_name_file_contract_field(tmp_path: Path, text, field, fragment):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ContractFileError) as ei:
        load_contracts(f)
    e = ei.value
    assert (e.file, e.contract, e.field) == (str(f), "x", field)
    assert fragment in str(e) and str(f) in str(e)
    assert "pydantic.dev" not in str(e)


def test_deep_nesting_is_a_contract_file_error(tmp_path: Path):
    for text in (_contract("dtype = " + "[" * 5000 + "]" * 5000),
                 _contract("values = " + "{a = " * 3000 + "1" + "}" * 3000),
                 _contract("allowed = " + "[" * 100 + "1" + "]" * 100)):
        f = tmp_path / "deep.toml"
        f.write_text(text)
        with pytest.raises(ContractFileError) as ei:
            load_contracts(f)
        assert ei.value.file == str(f)


def test_every_problem_of_a_file_is_listed(tmp_path: Path):
    f = tmp_path / "bad.toml"
    f.write_text('[[contract]]\nop = "x"\n[contract.args.a]\ndtype = "bf17"\nrank = "two"\n'
                 '[contract.args.b]\nshape = "N (K"\n'
                 '[[contract]]\nop = "y"\ntargets = 3\n[contract.args.c]\nlist = "yes"\n')
    with pytest.raises(ContractFileError) as ei:
        load_contracts(f)
    e = ei.value
    got = {(p.contract, p.field) for p in e.problems}
    assert got == {("x", "args.a.dtype"), ("x", "args.a.rank"), ("x", "args.b.shape"),
                   ("y", "targets"), ("y", "args.c.list")}
    assert str(e).startswith(f"{f}: 5 problems:")
    for p in e.problems:
        assert f"contract {p.contract}, field {p.field}: {p.message}" in str(e)
    assert "more problem" not in str(e)


def test_many_problems_are_capped_in_the_message(tmp_path: Path):
    f = tmp_path / "many.toml"
    f.write_text("".join(f'[[contract]]\nop = "op{i}"\n[contract.args.a]\ndtype = "bf17"\n'
                         for i in range(80)))
    with pytest.raises(ContractFileError) as ei:
        load_contracts(f)
    assert len(ei.value.problems) == 80
    text = str(ei.value)
    assert "op49, field" in text and "op50, field" not in text
    assert "30 more not shown" in text


def test_a_folder_lists_the_problems_of_every_file(tmp_path: Path):
    (tmp_path / "a.toml").write_text(_contract('dtype = "bf17"'))
    (tmp_path / "b.toml").write_text(GOOD)
    (tmp_path / "c.toml").write_bytes(b"\xff\xfe junk")
    with pytest.raises(ContractFileError) as ei:
        load_contracts(tmp_path)
    assert [p.file for p in ei.value.problems] == [str(tmp_path / "a.toml"), str(tmp_path / "c.toml")]
    assert "2 problems in 2 files" in str(ei.value)


@pytest.mark.parametrize("name, fragment", [
    ("from", "Python keyword"), ("lambda", "Python keyword"), ("None", "Python keyword"),
    ("_oc_x", "reserved"), ('"a b"', "not a Python identifier"), ('"1x"', "not a Python identifier"),
])
def test_argument_names_no_callable_can_take_are_rejected(tmp_path: Path, name, fragment):
    f = tmp_path / "names.toml"
    f.write_text(f'[[contract]]\nop = "x"\n[contract.args.{name}]\ndtype = "bf16"\n')
    with pytest.raises(ContractFileError, match=fragment) as ei:
        load_contracts(f)
    assert ei.value.field == f"args.{name.strip(chr(34))}"
    with pytest.raises(ContractFileError, match=fragment):
        Contract("x", {name.strip('"'): Arg("bf16")})


def test_signature_names_are_checked_and_unique():
    with pytest.raises(ContractFileError, match="names 'a' twice") as ei:
        Contract("x", {"a": Arg("bf16")}, signature=["a", "b", "a"])
    assert ei.value.field == "signature[2]"
    with pytest.raises(ContractFileError, match="keyword") as ei:
        Contract("x", {"a": Arg("bf16")}, signature=["a", "from"])
    assert ei.value.field == "signature[1]"


def test_python_objects_raise_the_projects_error_with_field_and_known_names():
    with pytest.raises(ContractFileError) as ei:
        Arg("bf17")
    e = ei.value
    assert isinstance(e, ValueError) and e.field == "dtype"
    assert str(e).startswith("Arg, field dtype: unknown dtype 'bf17'; known names: ") and "bf16" in str(e)
    assert "pydantic" not in str(e)
    with pytest.raises(ContractFileError, match="cannot parse dimension '\\(K'") as ei:
        Arg(shape="N (K")
    assert ei.value.field == "shape"
    with pytest.raises(ContractFileError) as ei:
        Contract("x", {"a": {"dtype": "bf17"}, "b": Arg(same_shape_as="zz")}, targets=3)
    assert {(p.contract, p.field) for p in ei.value.problems} == {("x", "args.a.dtype"), ("x", "targets")}
    assert "pydantic" not in str(ei.value)
    with pytest.raises(ContractFileError, match="'zz', which is not an argument") as ei:
        Contract("x", {"b": Arg(same_shape_as="zz")})
    assert ei.value.field == "args.b.same_shape_as"
    # model_validate too (the registry builds merged contracts with it)
    with pytest.raises(ContractFileError, match="Arg, field shape: a shape must be a string"):
        Arg.model_validate({"shape": 5})
    with pytest.raises(ContractFileError) as ei:
        Contract.model_validate({"op": "x", "args": {"a": {"rank": "two"}}})
    assert (ei.value.contract, ei.value.field) == ("x", "args.a.rank")


@pytest.mark.parametrize("kwargs, field", [
    ({"max_len": -1, "list": True}, "max_len"), ({"numel_lt": -3}, "numel_lt"),
    ({"list": "yes"}, "list"), ({"max_len": 4}, "max_len"), ({"dims": {"K": {"le": 4}}}, "dims.K"),
    ({"shape": "K", "dims": {"K": {"ge": 8, "le": 4}}}, "dims.K"),
    ({"same_dtype_except": {"bf16": "fp32"}}, "same_dtype_except"), ({"rank": "two"}, "rank"),
])
def test_silently_accepted_values_are_errors(kwargs, field):
    with pytest.raises(ContractFileError) as ei:
        Arg(**kwargs)
    assert ei.value.field == field


def test_dimension_names_may_hold_underscores_and_the_generated_code_works():
    c = Contract("u", {"x": Arg("fp32", "n_tokens hidden_2"), "y": Arg("fp32", "n_tokens*2")})

    @opcontracts.enforce(c)
    def f(x, y):
        return x

    with opcontracts.mode("strict"):
        f(torch.ones(3, 4), torch.ones(6))
        with pytest.raises(opcontracts.ContractViolation, match="n_tokens=3"):
            f(torch.ones(3, 4), torch.ones(5))
    with pytest.raises(ContractFileError, match="a letter followed by letters, digits or '_'"):
        Arg(shape="_n")
    with pytest.raises(ContractFileError, match="not a Python keyword"):
        Arg(shape="N lambda")


def test_repr_shows_only_the_fields_that_are_set():
    import inspect
    from typing import Annotated

    a = Arg(["bf16", "fp16"], "... H", optional=True)
    assert repr(a) == "Arg(dtype=('bfloat16', 'float16'), shape=('... H',), optional=True)"
    assert repr(Arg()) == "Arg()"
    assert eval(repr(a), {"Arg": Arg}) == a
    c = Contract("x", {"a": Arg("bf16")}, targets=["m.f"])
    assert repr(c) == "Contract(op='x', args={'a': Arg(dtype=('bfloat16',))}, targets=('m.f',))"

    @opcontracts.enforce
    def norm(x: Annotated[torch.Tensor, Arg("bf16", "N H")]) -> torch.Tensor:
        return x

    assert "None" not in str(inspect.signature(norm))
    assert "Arg(dtype=('bfloat16',), shape=('N H',))" in str(inspect.signature(norm))


def test_contract_file_error_pickles_with_every_problem(tmp_path: Path):
    import pickle

    f = tmp_path / "bad.toml"
    f.write_text(_contract('dtype = "bf17"\nrank = "two"'))
    with pytest.raises(ContractFileError) as ei:
        load_contracts(f)
    back = pickle.loads(pickle.dumps(ei.value))  # pytest-xdist, multiprocessing
    assert back.problems == ei.value.problems and str(back) == str(ei.value)
    assert (back.file, back.contract, back.field) == (str(f), "x", "args.a.dtype")
