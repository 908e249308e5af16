"""The ``layer`` field: which layer's check decides a rule (spec validation, merges, ``list``,
the ``source:`` line of a violation)."""

from __future__ import annotations

import pickle

import pytest
import torch

import opcontracts
from opcontracts._engine import registry as _registry
from opcontracts.errors import ContractFileError
from opcontracts.spec import LAYERS, contracts_from_toml

TOML = '''
[[contract]]
op = "layer_op"
layer = "cann"
source = "CANN 8.0 aclnn docs"
[contract.args.x]
dtype = "bf16"
[contract.args.i]
dtype = "int64"
layer = "torch_npu"
'''


def test_layers_are_validated_with_file_and_field() -> None:
    bad = TOML.replace('layer = "cann"', 'layer = "CANN8"').replace('layer = "torch_npu"', "layer = 3")
    with pytest.raises(ContractFileError) as err:
        contracts_from_toml(bad, "l.toml")
    text = str(err.value)
    assert "l.toml" in text and "field layer:" in text and "field args.i.layer:" in text
    assert "'cann'" in text and "'CANN8'" in text
    assert set(LAYERS) == {"torch_npu", "cann", "mindspeed", "meta"}


def test_violation_names_the_layer_of_the_broken_rule() -> None:
    c = contracts_from_toml(TOML, "l.toml")[0]
    with pytest.raises(opcontracts.ContractViolation) as err:
        opcontracts.check(c, torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    assert err.value.layer == "cann"
    assert "source:    CANN 8.0 aclnn docs (layer cann: " in str(err.value)
    with pytest.raises(opcontracts.ContractViolation) as err:
        opcontracts.check(c, torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32))
    assert err.value.layer == "torch_npu"  # the argument's own layer wins over the contract's
    assert pickle.loads(pickle.dumps(err.value)).layer == "torch_npu"


def test_merge_keeps_each_rules_layer() -> None:
    a = contracts_from_toml(TOML, "a.toml")[0]
    b = a.model_copy(update={"layer": "torch_npu", "source": "torch_npu 2.13 glue"})
    merged = _registry.merge_contracts([a, b])
    assert merged.layer is None  # two layers: the contract names neither
    assert merged.args["i"].layer == "torch_npu"  # both say torch_npu for i
    x = merged.args["x"]
    assert x.layer is None and "(layer cann)" in (x.source or "") and "(layer torch_npu)" in (x.source or "")


def test_list_shows_the_layer(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from opcontracts import cli

    f = tmp_path / "l.toml"
    f.write_text(TOML)
    assert cli.main(["list", "--contracts", str(f), "layer_op"]) == 0
    out = capsys.readouterr().out
    assert "layer:   cann" in out and "int64, layer torch_npu" in out
