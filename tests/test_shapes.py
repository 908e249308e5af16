import pytest

from opcontracts._lang.shapes import eval_dim, parse_shape


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


UNSOLVABLE = [
    ("N//0", "divides by zero"),
    ("N//(2-2)", "divides by zero"),
    ("4//0", "divides by zero"),
    ("0*D", "multiplies by zero"),
    ("D*(1-1)", "multiplies by zero"),
    ("2-5", "cannot be negative"),
    ("None", "not a Python keyword"),
    ("N*lambda", "cannot parse"),
    ("_N", "a letter followed by letters, digits or '_'"),
    ("n__tokens*Ñ", "a letter followed by letters, digits or '_'"),
    ("²", "cannot parse"),
    ("+".join(["N"] * 1500), "at most 128"),
    ("+".join(["N"] * 40), "39 operators (at most 32)"),
    (" ".join(["N"] * 65), "65 dimensions (at most 64)"),
]


@pytest.mark.parametrize("bad, fragment", UNSOLVABLE, ids=[b[:24] for b, _ in UNSOLVABLE])
def test_rejects_unsolvable_and_oversized_shapes(bad, fragment):
    # each of these crashed at load time (RecursionError) or at the first call
    # (ZeroDivisionError, a SyntaxError in the generated code) before
    with pytest.raises(ValueError, match=fragment.replace("(", "\\(").replace(")", "\\)")):
        parse_shape(bad)


def test_names_may_hold_underscores_and_digits():
    s = parse_shape("n_tokens hidden2 n_tokens*k_top")
    assert s.names == ("n_tokens", "hidden2", "k_top")
    assert eval_dim(s.dims[2], {"n_tokens": 3, "k_top": 2}) == 6
    assert parse_shape("_").dims[0].kind == "any"
