"""Dim strings in jaxtyping grammar, normalised to polynomials."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowgraph.dims import Poly, Shape, parse_expr
from flowgraph.errors import DimError


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Bp*N", "N*Bp"),
        ("P+T", "T+P"),
        ("T-1+1", "T"),
        ("2*(T+1)", "2*T+2"),
        ("(Bp*N)//N", "(Bp*N)//N"),
        ("8//2", "4"),
        ("(2*T)//2", "T"),
    ],
)
def test_equal_expressions_normalise_alike(a: str, b: str) -> None:
    assert parse_expr(a) == parse_expr(b)


@pytest.mark.parametrize(("a", "b"), [("T", "T-1"), ("Bp", "Bp*N"), ("P+T", "P*T")])
def test_different_expressions_stay_different(a: str, b: str) -> None:
    assert parse_expr(a) != parse_expr(b)


def test_printing_is_readable() -> None:
    assert str(parse_expr("N*Bp")) == "Bp*N"
    assert str(parse_expr("T-1")) == "T-1"
    assert str(parse_expr("1-T")) == "-T+1"
    assert str(parse_expr("2*T*T")) == "2*T*T"


def test_substitution_and_constant_folding() -> None:
    p = parse_expr("Bp*N+T-1")
    q = p.subs({"Bp": Poly.const(4), "N": Poly.const(2), "T": Poly.const(8)})
    # 4*2 + 8 - 1 = 15
    assert q.is_const() and q.const_value() == 15


def test_linear_solve() -> None:
    coeff, rest = parse_expr("t-1").linear_in("t") or (0, Poly.const(0))
    assert coeff == 1 and rest == Poly.const(-1)
    assert parse_expr("t*t").linear_in("t") is None


def test_shape_parsing() -> None:
    s = Shape.parse("... b #T _ 3")
    assert s.variadic
    fixed = s.fixed_axes()
    assert [str(a) for a in fixed] == ["b", "#T", "_", "3"]
    assert fixed[1].broadcast and fixed[2].size is None
    assert Shape.parse("").axes == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("T--", "ends too early"),
        ("T$", "unexpected character"),
        ("b ...", "must come first"),
        ("(T))", "unexpected `\\)`"),
        ("T//0", "division by zero"),
        ("x" * 300, "limit is 200"),
    ],
)
def test_bad_dim_strings_raise_dim_error(text: str, message: str) -> None:
    with pytest.raises(DimError, match=message):
        Shape.parse(text)


@given(st.integers(-50, 50), st.integers(-50, 50), st.integers(1, 20))
def test_poly_arithmetic_matches_integers(a: int, b: int, c: int) -> None:
    env = {"x": Poly.const(a), "y": Poly.const(b)}
    expr = parse_expr(f"(x+y)*{c}-x*y")
    assert expr.subs(env).const_value() == (a + b) * c - a * b
