"""Which int64 values of an HLO module are exact when neuronx-cc computes them in int32.

With `--native-int64=disabled` (and on trn1 always) neuronx-cc computes s64/u64 values in 32
bits. A value is safe when either

- its **range** is provably inside 32 bits: a forward interval analysis over the module
  (`ranges`) from constants, iota (bounded by its static dim), converts from narrower integers,
  compares (pred), clamp / min / max with bounded operands, arithmetic on bounded intervals,
  reductions (sum of n elements <= n x the element bound; max/min keep it), data movement
  (reshape, broadcast, slice, gather, select, ...), and `call`s (parameters take the join of
  the callers' operands); entry parameters are unknown (their whole type range);
- or its only **use** is as an index (`index_only`): it reaches the start indices of gather,
  dynamic-slice, dynamic-update-slice or scatter through select / reshape / broadcast / convert /
  add or subtract of a bounded value / `call` boundaries, or ends in a compare. Every index the
  eager program accepts lies in [-N, N) for a table dim N < 2^31 (torch raises on others;
  `ignore_index`-style sentinels are compared and replaced before use), and for those the
  int32 computation gives the same index. Only an out-of-range index, already a bug, differs.

Anything else (a sum of a large int64 input, an int64 output) stays unproved: the validator
warns about it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator

from .hlo import Computation, HloModule, Instruction

__all__ = ["FITS", "Interval", "IntRanges", "type_range"]


@dataclasses.dataclass(frozen=True)
class Interval:
    """The closed integer interval [lo, hi]."""

    lo: int
    hi: int

    def join(self, other: Interval) -> Interval:
        return Interval(min(self.lo, other.lo), max(self.hi, other.hi))

    def within(self, other: Interval) -> bool:
        return other.lo <= self.lo and self.hi <= other.hi

    @property
    def magnitude(self) -> int:
        return max(abs(self.lo), abs(self.hi))


def type_range(element: str) -> Interval | None:
    """Every value of an integer (or pred) element type; None for floats and others."""
    if element == "pred":
        return Interval(0, 1)
    m = re.fullmatch(r"([su])(\d+)", element)
    if not m:
        return None
    bits = int(m.group(2))
    if m.group(1) == "u":
        return Interval(0, (1 << bits) - 1)
    return Interval(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)


# what a 64-bit element type computed in 32 bits keeps exactly
# (the CLI reference says int64 becomes int32; u64 is held to the same non-negative int32 range)
FITS = {"s64": Interval(-(1 << 31), (1 << 31) - 1), "u64": Interval(0, (1 << 31) - 1)}
_BOUNDED = 1 << 30  # an offset added to an index keeps the index's int32 headroom below this

_MOVE = frozenset(
    """bitcast broadcast copy dynamic-slice gather reshape reverse slice transpose
    all-gather all-to-all collective-permute""".split()
)  # result values are values of operand 0
_INDEX_CHAIN = frozenset(
    "bitcast broadcast copy concatenate convert reshape reverse slice transpose".split()
)  # a result is an index if the operand is one


class IntRanges:
    """Interval and index-use facts about the integer values of one module."""

    def __init__(self, module: HloModule) -> None:
        self.module = module
        self._by_name = {c.name: c.by_name() for c in module.computations}
        self._users: dict[tuple[str, str], list[tuple[Instruction, int]]] = {}
        self._callers: dict[str, list[Instruction]] = {}
        self._regions: set[str] = set()  # reducers, comparators: judged at their caller
        names = {c.name for c in module.computations}
        self._reached = {module.entry.name}
        for ins in module.instructions():
            for text in ins.attrs.values():
                self._reached.update(n for n in re.findall(r"[\w.\-]+", text) if n in names)
            if ins.opcode not in ("call", "while"):
                self._regions.update(ins.called(k) or "" for k in ("to_apply", "select", "scatter"))
            for k, operand in enumerate(ins.operands):
                self._users.setdefault((ins.computation, operand), []).append((ins, k))
            if ins.opcode == "call" and ins.called("to_apply"):
                self._callers.setdefault(ins.called("to_apply") or "", []).append(ins)
        self._values: dict[tuple[str, str], object] = {}
        self._index: dict[tuple[str, str], bool] = {}

    # -- public ---------------------------------------------------------------------------------

    def unproved(self) -> Iterator[Instruction]:
        """Instructions computing an s64/u64 value not proved exact in 32 bits. Parameters and
        tuple plumbing compute nothing; a reducer's or comparator's instructions are judged at
        the reduce (scatter, sort, ...) that applies them, whose result bounds their partial
        results."""
        order = self._dependency_order()
        for ins in order:  # operands (and callers' operands, callee roots) first: shallow
            self.value(ins)
        for ins in reversed(order):  # users first
            self.index_only(ins)
        for ins in self.module.instructions():
            if ins.opcode in ("parameter", "tuple", "get-tuple-element"):
                continue
            if ins.computation in self._regions or ins.computation not in self._reached:
                continue
            wide = [k for k, leaf in enumerate(ins.leaves) if leaf.element in FITS]
            if wide and not all(self._leaf_fits(ins, k) for k in wide) and not self.index_only(ins):
                yield ins

    def interval(self, ins: Instruction) -> Interval | None:
        """The interval of an array-valued integer instruction (None: not an integer array)."""
        value = self.value(ins)
        return value if isinstance(value, Interval) else None

    def value(self, ins: Instruction) -> object:
        """Interval (array), tuple of values (tuple), or None (not an integer)."""
        key = (ins.computation, ins.name)
        if key not in self._values:
            self._values[key] = _default(ins)  # a cycle (none in HLO) sees the type range
            self._values[key] = self._compute(ins)
        return self._values[key]

    def index_only(self, ins: Instruction) -> bool:
        """Every use of `ins` is as an index (see the module docstring)."""
        key = (ins.computation, ins.name)
        if key not in self._index:
            self._index[key] = False  # in progress: a cycle proves nothing
            self._index[key] = self._index_uses(ins)
        return self._index[key]

    def _dependencies(self, ins: Instruction) -> list[Instruction]:
        """What `value(ins)` reads: its operands, a callee's root (call), the callers' operands
        (a called computation's parameter). `index_only` reads the reverse edges."""
        deps = [o for k in range(len(ins.operands)) if (o := self._operand(ins, k)) is not None]
        if ins.opcode == "call":
            comp = self.module.computation(ins.called("to_apply") or "")
            deps += [comp.root] if comp is not None else []
        elif ins.opcode == "parameter":
            number = ins.parameter_number or 0
            for call in self._callers.get(ins.computation, []):
                deps += [o] if (o := self._operand(call, number)) is not None else []
        return deps

    def _dependency_order(self) -> list[Instruction]:
        """Every instruction after its dependencies (iterative depth-first post-order), so that
        the memoized recursions of `value` and `index_only` stay shallow on long chains."""
        order: list[Instruction] = []
        done: set[tuple[str, str]] = set()
        for start in self.module.instructions():
            stack = [(start, False)]
            while stack:
                ins, expanded = stack.pop()
                key = (ins.computation, ins.name)
                if expanded:
                    order.append(ins)
                    continue
                if key in done:
                    continue
                done.add(key)
                stack.append((ins, True))
                stack.extend((d, False) for d in self._dependencies(ins))
        return order

    # -- intervals ------------------------------------------------------------------------------

    def _leaf_fits(self, ins: Instruction, k: int) -> bool:
        value = self.value(ins)
        if ins.is_tuple:
            value = value[k] if isinstance(value, tuple) and k < len(value) else None
        fits = FITS[ins.leaves[k].element]
        return isinstance(value, Interval) and value.within(fits)

    def _operand(self, ins: Instruction, k: int) -> Instruction | None:
        if k >= len(ins.operands):
            return None
        return self._by_name[ins.computation].get(ins.operands[k])

    def _iv(self, ins: Instruction, k: int) -> Interval | None:
        operand = self._operand(ins, k)
        return self.interval(operand) if operand is not None else None

    def _compute(self, ins: Instruction) -> object:
        if ins.is_tuple:
            return self._tuple_value(ins)
        full = type_range(ins.leaves[0].element) if ins.leaves else None
        if full is None:
            return None
        found = self._array(ins, full)
        if found is None or not found.within(full):
            return full
        return found

    def _tuple_value(self, ins: Instruction) -> object:
        op = ins.opcode
        if op in ("tuple", "sort", "optimization-barrier"):
            ops = [self._operand(ins, k) for k in range(len(ins.operands))]
            if op == "optimization-barrier" and ops and ops[0] is not None:
                return self.value(ops[0])
            return tuple(self.value(o) if o is not None else None for o in ops)
        if op == "call":
            return self._call(ins)
        if op == "get-tuple-element":
            return self._element(ins)
        return tuple(type_range(leaf.element) for leaf in ins.leaves)

    def _element(self, ins: Instruction) -> object:
        source = self._operand(ins, 0)
        value = self.value(source) if source is not None else None
        index = int(ins.attrs.get("index", "-1"))
        if isinstance(value, tuple) and 0 <= index < len(value):
            return value[index]
        return None

    def _array(self, ins: Instruction, full: Interval) -> Interval | None:
        op = ins.opcode
        if op in _MOVE or op == "optimization-barrier":
            return self._iv(ins, 0)
        rule = _RULES.get(op)
        if rule is not None:
            return rule(self, ins)
        if op == "get-tuple-element":
            value = self._element(ins)
            return value if isinstance(value, Interval) else None
        if op == "call":
            value = self._call(ins)
            return value if isinstance(value, Interval) else None
        return None

    def _call(self, ins: Instruction) -> object:
        comp = self.module.computation(ins.called("to_apply") or "")
        return self.value(comp.root) if comp is not None else None

    def _parameter(self, ins: Instruction) -> Interval | None:
        callers = self._callers.get(ins.computation, [])
        number = int(ins.literal)
        if ins.computation == self.module.entry.name or not callers:
            return None
        joined: Interval | None = None
        for call in callers:
            iv = self._iv(call, number)
            if iv is None:
                return None
            joined = iv if joined is None else joined.join(iv)
        return joined

    def _region_root(self, ins: Instruction, key: str = "to_apply") -> str | None:
        comp = self.module.computation(ins.called(key) or "")
        if comp is None:
            return None
        root = comp.root
        return "assign" if root.opcode == "parameter" else root.opcode

    # -- index uses -----------------------------------------------------------------------------

    def _index_uses(self, ins: Instruction) -> bool:
        uses = self._users.get((ins.computation, ins.name), [])
        if ins.is_root:
            callers = self._callers.get(ins.computation)
            if ins.computation == self.module.entry.name or not callers:
                return False  # an output, or a region's result
            if not all(self.index_only(call) for call in callers):
                return False
        if not uses and not ins.is_root:
            return False
        return all(self._index_use(user, k) for user, k in uses)

    def _index_use(self, user: Instruction, k: int) -> bool:
        op = user.opcode
        if op == "gather":
            return k == 1
        if op == "dynamic-slice":
            return k >= 1
        if op == "dynamic-update-slice":
            return k >= 2
        if op == "scatter":
            return k == (len(user.operands) - 1) // 2
        if op == "compare":
            return True  # a pred: the index's comparisons are the same in 32 bits
        if op == "select":
            return k >= 1 and self.index_only(user)
        if op == "clamp":
            return k == 1 and self.index_only(user)
        if op in _INDEX_CHAIN:
            return _integer(user) and self.index_only(user)
        if op in ("add", "subtract", "maximum", "minimum"):
            other = self._iv(user, 1 - k)
            bounded = other is not None and other.magnitude <= _BOUNDED
            return bounded and self.index_only(user)
        if op == "call":
            comp = self.module.computation(user.called("to_apply") or "")
            param = _parameter_of(comp, k) if comp is not None else None
            return param is not None and self.index_only(param)
        return False


# -- interval rules ---------------------------------------------------------------------------


def _constant(r: IntRanges, ins: Instruction) -> Interval | None:
    text = ins.literal
    if ins.leaves and ins.leaves[0].element == "pred":
        return Interval(0, 1)
    if "..." in text or re.search(r"[.eEn]", text.replace("{", "").replace("}", "")):
        return None
    numbers = [int(n) for n in re.findall(r"-?\d+", text)]
    return Interval(min(numbers), max(numbers)) if numbers else None


def _iota(r: IntRanges, ins: Instruction) -> Interval | None:
    dims = ins.leaves[0].dims
    axis = int(ins.attrs.get("iota_dimension", "0"))
    return Interval(0, max(dims[axis] - 1, 0)) if axis < len(dims) else None


def _convert(r: IntRanges, ins: Instruction) -> Interval | None:
    source = r._operand(ins, 0)
    if source is None or not source.leaves:
        return None
    return r.interval(source) or type_range(source.leaves[0].element)


def _join_all(r: IntRanges, ins: Instruction, first: int = 0) -> Interval | None:
    ivs = [r._iv(ins, k) for k in range(first, len(ins.operands))]
    if not ivs or any(iv is None for iv in ivs):
        return None
    return functools.reduce(Interval.join, ivs)  # type: ignore[arg-type]


def _binary(fn):
    def rule(r: IntRanges, ins: Instruction) -> Interval | None:
        a, b = r._iv(ins, 0), r._iv(ins, 1)
        return fn(a, b) if a is not None and b is not None else None

    return rule


def _corners(fn):
    def combine(a: Interval, b: Interval) -> Interval:
        values = [fn(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return Interval(min(values), max(values))

    return combine


def _divide(a: Interval, b: Interval) -> Interval | None:
    if b.lo <= 0 <= b.hi:
        return None
    return Interval(-a.magnitude, a.magnitude)


def _remainder(a: Interval, b: Interval) -> Interval:
    bound = min(b.magnitude - 1, a.magnitude) if b.magnitude else a.magnitude
    return Interval(0 if a.lo >= 0 else -bound, 0 if a.hi <= 0 else bound)


def _and(a: Interval, b: Interval) -> Interval | None:
    bounds = [iv.hi for iv in (a, b) if iv.lo >= 0]
    return Interval(0, min(bounds)) if bounds else None


def _shift_right(r: IntRanges, ins: Instruction) -> Interval | None:
    a = r._iv(ins, 0)
    return Interval(0, a.hi) if a is not None and a.lo >= 0 else None


def _clamp(r: IntRanges, ins: Instruction) -> Interval | None:
    lo, x, hi = (r._iv(ins, k) for k in range(3))
    if lo is None or hi is None:
        return None
    if x is None:
        return Interval(lo.lo, hi.hi)
    return Interval(min(max(x.lo, lo.lo), hi.lo), min(max(x.hi, lo.hi), hi.hi))


def _abs(r: IntRanges, ins: Instruction) -> Interval | None:
    a = r._iv(ins, 0)
    if a is None:
        return None
    return Interval(0 if a.lo <= 0 <= a.hi else min(abs(a.lo), abs(a.hi)), a.magnitude)


def _negate(r: IntRanges, ins: Instruction) -> Interval | None:
    a = r._iv(ins, 0)
    return Interval(-a.hi, -a.lo) if a is not None else None


def _reduce(r: IntRanges, ins: Instruction) -> Interval | None:
    if ins.is_tuple or len(ins.operands) != 2:
        return None
    x, init = r._iv(ins, 0), r._iv(ins, 1)
    source = r._operand(ins, 0)
    if x is None or init is None or source is None:
        return None
    if ins.opcode == "reduce":
        kept = math.prod(ins.leaves[0].dims)
        count = math.prod(source.leaves[0].dims) // max(kept, 1)
    else:  # reduce-window: the window's size
        sizes = re.search(r"size=([\dx]+)", ins.attrs.get("window", ""))
        count = math.prod(int(s) for s in sizes.group(1).split("x")) if sizes else 0
    return _combine(r._region_root(ins), x, init, count)


def _combine(root: str | None, x: Interval, init: Interval, count: int) -> Interval | None:
    if root in ("maximum", "minimum"):
        return x.join(init)
    if root == "add" and count:
        return Interval(init.lo + min(0, x.lo * count), init.hi + max(0, x.hi * count))
    return None


def _scatter(r: IntRanges, ins: Instruction) -> Interval | None:
    if ins.is_tuple or len(ins.operands) != 3:
        return None
    base, updates = r._iv(ins, 0), r._iv(ins, 2)
    if base is None or updates is None or r._region_root(ins) != "assign":
        return None
    return base.join(updates)


def _select(r: IntRanges, ins: Instruction) -> Interval | None:
    return _join_all(r, ins, first=1)


def _pair(r: IntRanges, ins: Instruction) -> Interval | None:
    a, b = r._iv(ins, 0), r._iv(ins, 1)
    return a.join(b) if a is not None and b is not None else None


def _pred(r: IntRanges, ins: Instruction) -> Interval:
    return Interval(0, 1)


def _param(r: IntRanges, ins: Instruction) -> Interval | None:
    return r._parameter(ins)


_RULES = {
    "constant": _constant,
    "iota": _iota,
    "parameter": _param,
    "convert": _convert,
    "compare": _pred,
    "is-finite": _pred,
    "add": _binary(_corners(lambda x, y: x + y)),
    "subtract": _binary(_corners(lambda x, y: x - y)),
    "multiply": _binary(_corners(lambda x, y: x * y)),
    "maximum": _binary(_corners(max)),
    "minimum": _binary(_corners(min)),
    "divide": _binary(_divide),
    "remainder": _binary(_remainder),
    "and": _binary(_and),
    "shift-right-logical": _shift_right,
    "shift-right-arithmetic": _shift_right,
    "clamp": _clamp,
    "abs": _abs,
    "negate": _negate,
    "select": _select,
    "concatenate": _join_all,
    "pad": _pair,
    "dynamic-update-slice": _pair,
    "reduce": _reduce,
    "reduce-window": _reduce,
    "scatter": _scatter,
}


def _default(ins: Instruction) -> object:
    if ins.is_tuple:
        return tuple(type_range(leaf.element) for leaf in ins.leaves)
    return type_range(ins.leaves[0].element) if ins.leaves else None


def _integer(ins: Instruction) -> bool:
    return bool(ins.leaves) and type_range(ins.leaves[0].element) is not None


def _parameter_of(comp: Computation, number: int) -> Instruction | None:
    for ins in comp.instructions:
        if ins.opcode == "parameter" and ins.parameter_number == number:
            return ins
    return None
