"""The contract model and contract files, including every malformed-file message."""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import opcontracts
from opcontracts import Arg, Contract, ContractFileError, load_contracts
from opcontracts._dtypes import parse_dtype

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
    ('[[contract]]\nop = "x"\n[contract.args.a]\nsame_dtype_as = "b"\n', "x", None, "not an argument"),
    ('[[contract]]\n[contract.args.a]\ndtype = "bf16"\n', "#0", "op", "missing required field"),
    ('[[contract]]\nop = "x"\n', "x", "args", "missing required field"),
    ('[[contract]]\nop = "x"\ntargets = ["not a path"]\n[contract.args.a]\ndtype="bf16"\n', "x", "targets", "dotted path"),
    ('[[contract]]\nop = "x"\nwhen = {cann = "newest"}\n[contract.args.a]\ndtype="bf16"\n', "x", "when.cann", "not a version specifier"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\nrank = -1\n', "x", "args.a.rank", "non-negative"),
    ('[[contract]]\nop = "x"\n[contract.args.a]\nshape = ["N K", "A B"]\n', "x", "args.a.shape", "differ in rank"),
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
