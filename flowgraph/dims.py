"""Symbolic dimensions in jaxtyping's dim-string grammar.

A dim string is a space-separated list of axes, as jaxtyping writes them:

    "B T"       two named axes
    "B T-1"     arithmetic: + - * // and parentheses, no spaces inside one axis
    "Bp*N"      the batch after grouped sampling
    "P+T"       a prompt and its response, concatenated
    "3"         a fixed size
    "_"         any size, not checked
    "#B"        B, or 1 (broadcastable)
    "..." "*b"  any number of leading axes (variadic)

Each axis expression is normalised to a polynomial with integer coefficients over
the dim symbols (`Poly`), so `Bp*N` and `N*Bp` are the same and `T` and `T-1` are
provably different. Floor division that is not exact stays an opaque symbol.

Notation: B sequences, Bp prompts, N samples per prompt (B = Bp*N), P prompt
length, T response length, V vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeAlias

from flowgraph.errors import DimError

CANONICAL_DIMS: tuple[str, ...] = ("B", "Bp", "N", "P", "T", "V")
"""The dims every graph shares; `B` is derived as `Bp*N`."""

Monomial: TypeAlias = tuple[tuple[str, int], ...]
"""Sorted (symbol, power) pairs; `()` is the constant monomial."""


@dataclass(frozen=True, slots=True)
class Poly:
    """A polynomial with integer coefficients over dim symbols, in normal form."""

    terms: tuple[tuple[Monomial, int], ...]
    """Sorted (monomial, coefficient) pairs, no zero coefficients."""

    @staticmethod
    def const(value: int) -> Poly:
        return Poly((((), value),) if value else ())

    @staticmethod
    def sym(name: str) -> Poly:
        return Poly(((((name, 1),), 1),))

    @staticmethod
    def _from(acc: dict[Monomial, int]) -> Poly:
        return Poly(tuple(sorted((m, c) for m, c in acc.items() if c)))

    def __add__(self, other: Poly) -> Poly:
        acc = dict(self.terms)
        for m, c in other.terms:
            acc[m] = acc.get(m, 0) + c
        return Poly._from(acc)

    def __neg__(self) -> Poly:
        return Poly(tuple((m, -c) for m, c in self.terms))

    def __sub__(self, other: Poly) -> Poly:
        return self + (-other)

    def __mul__(self, other: Poly) -> Poly:
        acc: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                m = _mono_mul(m1, m2)
                acc[m] = acc.get(m, 0) + c1 * c2
        return Poly._from(acc)

    def floordiv(self, other: Poly) -> Poly:
        """Exact division by a constant, numeric division, or an opaque symbol."""
        if other.is_const() and other.const_value() == 0:
            raise DimError(f"division by zero in dim expression `{self}//{other}`")
        if self.is_const() and other.is_const():
            return Poly.const(self.const_value() // other.const_value())
        if other.is_const() and all(c % other.const_value() == 0 for _, c in self.terms):
            d = other.const_value()
            return Poly(tuple((m, c // d) for m, c in self.terms))
        return Poly.sym(f"({self})//({other})")

    def is_const(self) -> bool:
        return all(not m for m, _ in self.terms)

    def const_value(self) -> int:
        return sum(c for m, c in self.terms if not m)

    def symbols(self) -> frozenset[str]:
        return frozenset(s for m, _ in self.terms for s, _ in m)

    def subs(self, values: dict[str, Poly]) -> Poly:
        """Replace symbols by polynomials (one pass; callers resolve chains first)."""
        if not self.symbols() & values.keys():
            return self
        out = Poly.const(0)
        for m, c in self.terms:
            term = Poly.const(c)
            for s, p in m:
                base = values.get(s, Poly.sym(s))
                for _ in range(p):
                    term = term * base
            out = out + term
        return out

    def linear_in(self, name: str) -> tuple[int, Poly] | None:
        """(a, rest) with self == a*name + rest when `name` occurs only linearly."""
        coeff = 0
        rest: dict[Monomial, int] = {}
        for m, c in self.terms:
            powers = dict(m)
            if name not in powers:
                rest[m] = c
            elif powers[name] == 1 and len(m) == 1:
                coeff = c
            else:
                return None
        return (coeff, Poly._from(rest)) if coeff else None

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts: list[str] = []
        # Highest degree first reads naturally: `Bp*N`, `T-1`, `P+T`.
        for m, c in sorted(self.terms, key=lambda t: (-len(t[0]), t[0])):
            body = "*".join(s if p == 1 else "*".join([s] * p) for s, p in m)
            mag = abs(c)
            text = body if body and mag == 1 else (f"{mag}*{body}" if body else str(mag))
            parts.append(("-" if c < 0 else "+") + text)
        out = "".join(parts)
        return out[1:] if out.startswith("+") else out


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    acc = dict(a)
    for s, p in b:
        acc[s] = acc.get(s, 0) + p
    return tuple(sorted(acc.items()))


# --- parsing ---------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*()]))")
_QUALIFIED = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_.]*)|(//|[-+*()]))")
"""As `_TOKEN`, with the checker's qualified node-local names (`gen.n`)."""


class _Parser:
    """Precedence-climbing parser for one axis expression."""

    def __init__(self, text: str, token: re.Pattern[str] = _TOKEN) -> None:
        self.text = text
        self.tokens = self._lex(text, token)
        self.i = 0

    def _lex(self, text: str, token: re.Pattern[str]) -> list[str]:
        out: list[str] = []
        pos = 0
        while pos < len(text):
            m = token.match(text, pos)
            if not m or m.end() == pos:
                raise DimError(f"unexpected character {text[pos]!r} in dim `{text}`")
            out.append(m.group(0).strip())
            pos = m.end()
        return out

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise DimError(f"dim `{self.text}` ends too early")
        self.i += 1
        return tok

    def parse(self) -> Poly:
        value = self.expr()
        if self.peek() is not None:
            raise DimError(f"unexpected `{self.peek()}` in dim `{self.text}`")
        return value

    def expr(self) -> Poly:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Poly:
        value = self.atom()
        while self.peek() in ("*", "//"):
            op = self.take()
            rhs = self.atom()
            value = value * rhs if op == "*" else value.floordiv(rhs)
        return value

    def atom(self) -> Poly:
        tok = self.take()
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise DimError(f"missing `)` in dim `{self.text}`")
            return value
        if tok == "-":
            return -self.atom()
        if tok.isdigit():
            return Poly.const(int(tok))
        if tok[0].isalpha() or tok[0] == "_":
            return Poly.sym(tok)
        raise DimError(f"unexpected `{tok}` in dim `{self.text}`")


@lru_cache(maxsize=4096)
def parse_expr(text: str) -> Poly:
    """Parse one axis expression such as `T-1` or `Bp*N` into a `Poly`.

    Cached: contracts and kinds' dim defaults write the same few expressions.
    """
    if len(text) > 200:
        raise DimError(f"dim expression is {len(text)} characters long; the limit is 200")
    return _Parser(text).parse()


# --- axes and shapes -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Axis:
    """One axis of a shape."""

    size: Poly | None
    """The size, or None for `_` (any size) and for a variadic axis."""
    variadic: bool = False
    """`...` or `*name`: any number of axes, only as the first axis."""
    broadcast: bool = False
    """`#name`: the size, or 1."""
    text: str = ""
    """As written, for messages."""

    def __str__(self) -> str:
        return self.text or (str(self.size) if self.size is not None else "_")


@dataclass(frozen=True, slots=True)
class Shape:
    """A parsed dim string."""

    axes: tuple[Axis, ...]
    text: str
    """The dim string as written (`"B T-1"`)."""

    @staticmethod
    def parse(text: str) -> Shape:
        return _parse_shape(text)

    @property
    def variadic(self) -> bool:
        return bool(self.axes) and self.axes[0].variadic

    def fixed_axes(self) -> tuple[Axis, ...]:
        return self.axes[1:] if self.variadic else self.axes

    def symbols(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for a in self.axes:
            if a.size is not None:
                out |= a.size.symbols()
        return out

    def __str__(self) -> str:
        inner = ", ".join(str(a) for a in self.axes)
        return f"({inner},)" if len(self.axes) == 1 else f"({inner})"


def _parse_axis(tok: str, first: bool) -> Axis:
    if tok == "..." or tok.startswith("*"):
        if not first:
            raise DimError(f"variadic axis `{tok}` must come first")
        return Axis(None, variadic=True, text=tok)
    if tok == "_":
        return Axis(None, text=tok)
    if tok.startswith("#"):
        return Axis(parse_expr(tok[1:]), broadcast=True, text=tok)
    return Axis(parse_expr(tok), text=tok)


def _parse_shape(text: str) -> Shape:
    if not isinstance(text, str):
        raise DimError(f"a dim string must be a string such as \"B T\", got {text!r}")
    tokens = text.split()
    axes = tuple(_parse_axis(tok, i == 0) for i, tok in enumerate(tokens))
    return Shape(axes, text)


def parse_resolved(text: str) -> tuple[Poly | None, ...]:
    """The inverse of `resolved_text`: a port's resolved axes as the plan writes them."""
    return tuple(None if t == "_" else _Parser(t, _QUALIFIED).parse() for t in text.split())


def resolved_text(values: tuple[Poly | None, ...]) -> str:
    """A port's resolved axes in global terms, one word each (`Bp*N T`, `_` for any)."""
    return " ".join("_" if v is None else str(v).replace(" ", "") for v in values)


def format_dims(values: tuple[Poly | None, ...]) -> str:
    """`(B, T-1)` for messages; None prints as `_`."""
    inner = ", ".join("_" if v is None else str(v) for v in values)
    return f"({inner},)" if len(values) == 1 else f"({inner})"
