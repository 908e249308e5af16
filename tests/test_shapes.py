import pytest

from opcontracts._shapes import eval_dim, parse_shape


def test_parse_kinds():
    s = parse_shape("... N*K H _ 8")
    assert [d.kind for d in s.dims] == ["ellipsis", "expr", "name", "any", "int"]
    assert s.has_ellipsis and s.fixed_rank == 4
    assert s.names == ("N", "K", "H")


def test_expression_evaluation():
    d = parse_shape("N*K+1").dims[0]
    assert eval_dim(d, {"N": 3, "K": 2}) == 7
    assert eval_dim(d, {"N": 3}) is None
    assert eval_dim(parse_shape("H//2").dims[0], {"H": 9}) == 4


def test_constant_expression_is_int():
    d = parse_shape("2*64").dims[0]
    assert d.kind == "int" and d.value == 128


def test_solvable_multiple():
    d = parse_shape("2*D").dims[0]
    assert d.solve == ("D", 2)


@pytest.mark.parametrize("bad, fragment", [
    ("N**2", "only integers"),
    ("f(N)", "only integers"),
    ("... N ...", "at most one"),
    ("N ...", "must come first"),
    ("N/2", "only integers"),
    ("N)", "cannot parse"),
])
def test_rejects_bad_shapes(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_shape(bad)
