"""Sharding-rule patterns matched in time linear in the name, whatever the pattern.

Plans come from files (plan.json, an archive's plan), and Python's `re` backtracks: a rule such
as `(a+)+b` takes exponential time on a name of thirty `a`s, so a hostile plan could hang any
command that reads it. A pattern is parsed here with the standard library's own regex parser
(`re._parser`: syntax and meaning are exactly Python's) and matched by simulating its Thompson
NFA, which visits each (character, state) pair once.

The subset: literals, `.`, classes (`[a-z0-9_]`, `\\d`, `\\w`, `\\s` and their negations),
groups, alternation, every repeat (`* + ? {m,n}`, greedy, lazy or possessive: for a whole-name
match they mean the same), and `^` / `$`. Refused with PlanError: backreferences, lookarounds,
conditionals, atomic groups, inline flags, patterns over 1000 characters or 10000 states.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Callable
from re import _constants as _c  # type: ignore[attr-defined]  # private: typeshed has no stub
from re import _parser  # type: ignore[attr-defined]  # re.compile's parser, private: no stub
from typing import Any

from ..errors import PlanError

__all__ = ["SafePattern", "compile_pattern"]

MAX_PATTERN = 1000
MAX_STATES = 10_000
_MAX_GROUP_DEPTH = 50

Predicate = Callable[[str], bool]


@dataclasses.dataclass
class _State:
    kind: str  # "char" | "split" | "at_start" | "at_end" | "match"
    test: Predicate | None = None
    out: list[_State] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class SafePattern:
    """A compiled pattern; `fullmatch(name)` equals `re.fullmatch(pattern, name) is not None`."""

    pattern: str
    start: _State

    def fullmatch(self, name: str) -> bool:
        current = _closure([self.start], 0, len(name))
        for i, ch in enumerate(name):
            stepped = [s.out[0] for s in current if s.kind == "char" and s.test(ch)]  # type: ignore[misc]
            if not stepped:
                return False
            current = _closure(stepped, i + 1, len(name))
        return any(s.kind == "match" for s in current)


def compile_pattern(pattern: str) -> SafePattern:
    """Compile `pattern` (PlanError when it is not valid or not in the subset)."""
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
        raise _refuse(pattern, f"is not a string of at most {MAX_PATTERN} characters")
    if _group_depth(pattern) > _MAX_GROUP_DEPTH:
        raise _refuse(pattern, f"nests groups more than {_MAX_GROUP_DEPTH} deep")
    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise _refuse(pattern, f"is not a valid regular expression: {exc}") from None
    if parsed.state.flags & ~(re.UNICODE | _c.SRE_FLAG_UNICODE):
        raise _refuse(pattern, "sets flags ((?i), (?x), ...)")
    builder = _Builder(pattern)
    return SafePattern(pattern, builder.sequence(list(parsed), _State("match")))


def _refuse(pattern: object, why: str) -> PlanError:
    shown = repr(pattern) if len(repr(pattern)) <= 80 else repr(pattern)[:77] + "..."
    return PlanError(
        f"sharding rule pattern {shown} {why}",
        fix="write the rule as a plain regular expression over tensor names, e.g. "
        r"'blocks\.\d+\.mlp\.fc\.weight' (no backreferences, lookarounds or flags)",
    )


def _group_depth(pattern: str) -> int:
    depth = deepest = 0
    escaped = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


class _Builder:
    """Builds the NFA back to front: each item is compiled with the state that follows it."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.count = 0

    def new(
        self, kind: str, test: Predicate | None = None, out: list[_State] | None = None
    ) -> _State:
        self.count += 1
        if self.count > MAX_STATES:
            raise _refuse(self.pattern, f"needs more than {MAX_STATES} states")
        return _State(kind, test, out or [])

    def sequence(self, items: list[tuple[Any, Any]], follow: _State) -> _State:
        for op, arg in reversed(items):
            follow = self.item(op, arg, follow)
        return follow

    def item(self, op: object, arg: Any, follow: _State) -> _State:
        if op in (_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN):
            return self.new("char", _predicate(op, arg), [follow])
        if op is _c.SUBPATTERN:
            _group, add_flags, del_flags, body = arg
            if add_flags or del_flags:
                raise _refuse(self.pattern, "sets flags inside a group")
            return self.sequence(list(body), follow)
        if op is _c.BRANCH:
            return self.new("split", out=[self.sequence(list(b), follow) for b in arg[1]])
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
            low, high, body = arg
            return self.repeat(list(body), low, high, follow)
        if op is _c.AT and arg in (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING):
            return self.new("at_start", out=[follow])
        if op is _c.AT and arg in (_c.AT_END, _c.AT_END_STRING):
            return self.new("at_end", out=[follow])
        raise _refuse(self.pattern, f"uses {str(op).lower()}, which rules do not support")

    def repeat(self, body: list[tuple[Any, Any]], low: int, high: int, follow: _State) -> _State:
        if high == _c.MAXREPEAT:
            loop = self.new("split")
            loop.out = [self.sequence(body, loop), follow]
            tail = loop
        else:  # low copies, then up to high - low optional ones, each able to leave
            tail = follow
            for _ in range(high - low):
                tail = self.new("split", out=[self.sequence(body, tail), follow])
        for _ in range(low):
            tail = self.sequence(body, tail)
        return tail


def _closure(states: list[_State], pos: int, end: int) -> list[_State]:
    """The states reachable from `states` without consuming a character at `pos`."""
    seen: set[int] = set()
    out: list[_State] = []
    stack = list(reversed(states))
    while stack:
        state = stack.pop()
        if id(state) in seen:
            continue
        seen.add(id(state))
        if state.kind == "split":
            stack.extend(reversed(state.out))
        elif state.kind == "at_start":
            if pos == 0:
                stack.append(state.out[0])
        elif state.kind == "at_end":
            if pos == end:
                stack.append(state.out[0])
        else:
            out.append(state)
    return out


def _predicate(op: object, arg: Any) -> Predicate:
    """The character test of a one-character item; `arg` is the parser's operand for `op` (a
    code point, or a class's list of (kind, value) items)."""
    if op is _c.LITERAL:
        return _equals(chr(arg))
    if op is _c.NOT_LITERAL:
        same = _equals(chr(arg))
        return lambda ch: not same(ch)
    if op is _c.ANY:
        return lambda ch: ch != "\n"
    tests: list[Predicate] = []
    negate = False
    for kind, value in arg:
        if kind is _c.NEGATE:
            negate = True
        elif kind is _c.LITERAL:
            tests.append(_equals(chr(value)))
        elif kind is _c.RANGE:
            tests.append(_in_range(*value))
        elif kind is _c.CATEGORY:
            tests.append(_CATEGORIES[value])
        else:
            raise PlanError(f"unsupported class item {kind}", fix="use plain character classes")
    if negate:
        return lambda ch: not any(t(ch) for t in tests)
    return lambda ch: any(t(ch) for t in tests)


def _equals(char: str) -> Predicate:
    return lambda ch: ch == char


def _in_range(lo: int, hi: int) -> Predicate:
    return lambda ch: lo <= ord(ch) <= hi


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _digit(ch: str) -> bool:
    return unicodedata.category(ch) == "Nd"


def _space(ch: str) -> bool:
    return ch.isspace()


_CATEGORIES: dict[object, Predicate] = {
    _c.CATEGORY_DIGIT: _digit,
    _c.CATEGORY_NOT_DIGIT: lambda ch: not _digit(ch),
    _c.CATEGORY_WORD: _word,
    _c.CATEGORY_NOT_WORD: lambda ch: not _word(ch),
    _c.CATEGORY_SPACE: _space,
    _c.CATEGORY_NOT_SPACE: lambda ch: not _space(ch),
}
