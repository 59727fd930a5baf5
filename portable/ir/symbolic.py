"""Size expressions of declared dynamic dims (`s95`, `4*s95`, `s75*s95`, `(s0//2) + 1`).

A `TensorSpec` dim is an int or such an expression, as torch prints a SymInt. Expressions read
from files are parsed here by a small recursive-descent parser over a fixed grammar, never by
`eval` / `sympy.sympify` (both execute code):

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "//" | "%") unary)*
    unary  := "-" unary | atom
    atom   := INT | SYMBOL | "(" expr ")" | FUNC "(" expr ("," expr)* ")"
    FUNC   := Max | Min | Mod | FloorDiv

`SizeExpr.evaluate(bindings)` gives the value for concrete symbol values; `free_symbols` the
names it uses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

if TYPE_CHECKING:
    from torch import SymInt

__all__ = ["MAX_EXPR", "DimBounds", "SizeExpr", "SizeExprError", "parse_size"]

MAX_EXPR = 256  # characters
_TOKEN = re.compile(r" *(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*%(),]))")
# over ints, or SymInts (symbolic evaluation); Max/Min take the list of their arguments
_FUNCS: dict[str, Callable[..., Any]] = {
    "Max": max,
    "Min": min,
    "Mod": lambda a, b: a % b,
    "FloorDiv": lambda a, b: a // b,
}
_BINARY: dict[str, Callable[..., Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
}
_LIMIT = 1 << 62  # any intermediate beyond this is not a tensor size

# a size: an int, or a SymInt when evaluated symbolically (the verifier's fake shapes)
Size = TypeVar("Size", int, "SymInt")


class SizeExprError(ValueError):
    """`text` is not a size expression of the grammar above."""


class DimBounds(TypedDict, total=False):
    """A declared dynamic dim's range, as `metadata["symbolic_dims"][symbol]` holds it: `min`
    (default 0), `max` (None: unbounded) and the input dim it sizes (`"idx.shape[0]"`)."""

    min: int
    max: int | None
    source: str


@dataclasses.dataclass(frozen=True)
class SizeExpr:
    """A parsed size expression: a tree of ("int", n) | ("sym", name) | (op, *children)."""

    text: str
    tree: tuple

    @property
    def free_symbols(self) -> frozenset[str]:
        return frozenset(_symbols(self.tree))

    def evaluate(self, bindings: Mapping[str, Size]) -> Size:
        """The value for `bindings` (symbol -> int, or SymInt for symbolic evaluation);
        SizeExprError on an unbound symbol, a division by zero or a value beyond 2**62."""
        return _evaluate(self.tree, bindings)


def parse_size(text: str) -> SizeExpr:
    """Parse `text` (SizeExprError when it is not in the grammar)."""
    if not isinstance(text, str) or len(text) > MAX_EXPR:
        raise SizeExprError(f"not a size expression of at most {MAX_EXPR} characters")
    tokens = _tokenize(text)
    parser = _Parser(tokens)
    tree = parser.expr()
    if parser.pos != len(tokens):
        raise SizeExprError(f"unexpected {tokens[parser.pos]!r}")
    return SizeExpr(text, tree)


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            if text[pos:].strip(" ") == "":
                break
            raise SizeExprError(f"unexpected character {text[pos]!r}")
        tokens.append(match.group(match.lastindex or 0))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise SizeExprError(f"expected {expected or 'a term'}, got {token!r}")
        self.pos += 1
        return token

    def expr(self) -> tuple:
        tree = self.term()
        while self.peek() in ("+", "-"):
            tree = (self.take(), tree, self.term())
        return tree

    def term(self) -> tuple:
        tree = self.unary()
        while self.peek() in ("*", "//", "%"):
            tree = (self.take(), tree, self.unary())
        return tree

    def unary(self) -> tuple:
        if self.peek() == "-":
            self.take()
            return ("-", ("int", 0), self.unary())
        return self.atom()

    def atom(self) -> tuple:
        token = self.take()
        if token.isdigit():
            return ("int", int(token))
        if token == "(":
            tree = self.expr()
            self.take(")")
            return tree
        if token in _FUNCS and self.peek() == "(":
            self.take("(")
            args = [self.expr()]
            while self.peek() == ",":
                self.take()
                args.append(self.expr())
            self.take(")")
            return (token, *args)
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token):
            return ("sym", token)
        raise SizeExprError(f"unexpected {token!r}")


def _symbols(tree: tuple) -> Iterator[str]:
    if tree[0] == "sym":
        yield tree[1]
    elif tree[0] != "int":
        for child in tree[1:]:
            yield from _symbols(child)


def _evaluate(tree: tuple, bindings: Mapping[str, Size]) -> Size:
    head = tree[0]
    if head == "int":
        value = tree[1]
    elif head == "sym":
        if tree[1] not in bindings:
            raise SizeExprError(f"symbol {tree[1]} has no value")
        value = bindings[tree[1]]
    else:
        args = [_evaluate(child, bindings) for child in tree[1:]]
        if head in ("//", "%", "Mod", "FloorDiv") and args[1] == 0:
            raise SizeExprError("division by zero")
        fn = _BINARY.get(head) or _FUNCS[head]
        value = fn(*args) if head not in ("Max", "Min") else fn(args)
    if abs(value) > _LIMIT:
        raise SizeExprError(f"value {value} is beyond 2**62")
    return value
