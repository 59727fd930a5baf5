"""HLO modules as plain data, read back from the serialized `HloModuleProto` that is written.

jaxlib turns the proto into an `HloModule`; its printer (with metadata) gives the text this module
parses into `Computation`s of `Instruction`s: name, opcode, result type (array leaves with element
type, dims and dynamic flags), operand names, attributes and the metadata `op_name`. The module
header gives `input_output_alias`. Only what the validator, the memory estimate and the io spec
need is parsed; everything else stays in `Instruction.attrs` as raw text.

    HLO text line:   [ROOT ]%name = TYPE opcode(operands), attr=value, ..., metadata={op_name="..."}
    TYPE:            f32[8,<=16]{1,0} | (TYPE, TYPE, ...) | token[]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax._src.lib import xla_client

__all__ = [
    "Alias",
    "ArrayType",
    "Computation",
    "HloModule",
    "HloParseError",
    "Instruction",
    "ELEMENT_BITS",
    "module_from_proto",
    "parse_hlo_text",
    "proto_from_text",
    "proto_to_text",
]

# bits per element of every HLO primitive type
ELEMENT_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f4e2m1fn": 4,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3fnuz": 8,
    "f8e4m3b11fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8,
    "token": 0,
}


class HloParseError(ValueError):
    """The HLO text does not have the shape this parser expects (a bug: report it)."""


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """One array leaf of an HLO result type."""

    element: str
    dims: tuple[int, ...]
    dynamic: tuple[bool, ...]  # per dim: `<=N` (bounded) or `?` (unbounded)

    @property
    def is_static(self) -> bool:
        return not any(self.dynamic)

    @property
    def nbytes(self) -> int:
        """Bytes of the array at its (upper-bound) dims."""
        return math.ceil(math.prod(self.dims) * ELEMENT_BITS.get(self.element, 0) / 8)

    def __str__(self) -> str:
        dims = ",".join(
            ("<=" if dyn else "") + str(d) for d, dyn in zip(self.dims, self.dynamic, strict=True)
        )
        return f"{self.element}[{dims}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    computation: str
    name: str
    opcode: str
    type_text: str  # the result type as printed
    leaves: tuple[ArrayType, ...]  # array leaves of the result type, in order
    operands: tuple[str, ...]  # operand instruction names (empty for parameter / constant)
    literal: str  # the text between the opcode's parentheses (parameter number, constant value)
    attrs: dict[str, str]  # attribute name -> raw value text
    op_name: str | None  # metadata op_name (JAX: "jit(fn)/<scope>/.../<primitive>")
    is_root: bool

    @property
    def is_tuple(self) -> bool:
        return self.type_text.startswith("(")

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def elements(self) -> frozenset[str]:
        return frozenset(leaf.element for leaf in self.leaves)

    @property
    def parameter_number(self) -> int | None:
        return int(self.literal) if self.opcode == "parameter" else None

    @property
    def custom_call_target(self) -> str | None:
        target = self.attrs.get("custom_call_target")
        return _unquote(target) if target is not None else None

    def called(self, key: str) -> str | None:
        """The computation named by attribute `key` (to_apply, condition, body, calls)."""
        value = self.attrs.get(key)
        return value.lstrip("%") if value else None


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]

    @property
    def root(self) -> Instruction:
        roots = [i for i in self.instructions if i.is_root]
        return roots[0] if roots else self.instructions[-1]

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}


@dataclasses.dataclass(frozen=True)
class Alias:
    """`input_output_alias` entry: output tuple index <- parameter (and index within it)."""

    output_index: tuple[int, ...]
    parameter: int
    parameter_index: tuple[int, ...]
    kind: str  # may-alias / must-alias


@dataclasses.dataclass(frozen=True)
class HloModule:
    name: str
    computations: tuple[Computation, ...]
    aliases: tuple[Alias, ...]

    @property
    def entry(self) -> Computation:
        for comp in self.computations:
            if comp.is_entry:
                return comp
        return self.computations[-1]

    def computation(self, name: str) -> Computation | None:
        for comp in self.computations:
            if comp.name == name:
                return comp
        return None

    def instructions(self) -> Iterator[Instruction]:
        for comp in self.computations:
            yield from comp.instructions

    @property
    def instruction_count(self) -> int:
        return sum(len(c.instructions) for c in self.computations)

    def parameters(self) -> list[Instruction]:
        """Entry parameters in parameter-number order."""
        params = [i for i in self.entry.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number or 0)


# -- jaxlib bridge -----------------------------------------------------------------------------


def proto_to_text(proto: bytes, *, metadata: bool = True) -> str:
    """The HLO text of a serialized HloModuleProto, printed by XLA (with metadata op_names)."""
    from jax._src.lib import xla_client

    module = xla_client.XlaComputation(proto).get_hlo_module()
    return module.to_string(_print_options(metadata))


def _print_options(metadata: bool) -> xla_client.hlo.HloPrintOptions:
    from jax._src.lib import xla_client

    options = xla_client.hlo.HloPrintOptions()
    options.print_metadata = metadata
    options.print_large_constants = False
    return options


def proto_from_text(text: str) -> bytes:
    """Parse HLO text with XLA's own parser and serialize it (for tests and hand-written HLO)."""
    from jax._src.lib import xla_client

    return xla_client.hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()


def module_from_proto(proto: bytes) -> HloModule:
    """Deserialize an HloModuleProto and parse it into an `HloModule`."""
    return parse_hlo_text(proto_to_text(proto))


# -- text parser -------------------------------------------------------------------------------

_HEADER = re.compile(r"^HloModule\s+([^\s,]+)")
_ALIAS = re.compile(r"\{([\d,\s]*)\}:\s*\((\d+),\s*\{([\d,\s]*)\}(?:,\s*([\w-]+))?\)")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*(?:\(.*\)\s*->\s*.*?)?\s*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_LEAF = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_ARRAY_TYPE = re.compile(r"^[a-z][a-z0-9]*\[[^\]]*\]")
_OPCODE = re.compile(r"^([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


def parse_hlo_text(text: str) -> HloModule:
    """Parse XLA's printed HLO text (as `proto_to_text` prints it)."""
    name = ""
    aliases: tuple[Alias, ...] = ()
    computations: list[Computation] = []
    current: tuple[str, bool] | None = None
    body: list[Instruction] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if current is None:
            header = _HEADER.match(line)
            if header:
                name, aliases = header.group(1), _aliases(line)
                continue
            comp = _COMPUTATION.match(line)
            if comp:
                current, body = (comp.group(2), bool(comp.group(1))), []
            continue  # FileNames / StackFrames tables and other top-level lines
        if line.startswith("}"):
            computations.append(Computation(current[0], current[1], tuple(body)))
            current = None
            continue
        try:
            body.append(_instruction(current[0], line))
        except (HloParseError, ValueError, IndexError) as exc:
            raise HloParseError(f"HLO line {lineno}: {exc}: {line.strip()[:200]}") from None
    if current is not None:
        raise HloParseError(f"computation {current[0]} is not closed")
    if not computations:
        raise HloParseError("no computations in the HLO text")
    return HloModule(name, tuple(computations), aliases)


def _aliases(header: str) -> tuple[Alias, ...]:
    start = header.find("input_output_alias=")
    if start < 0:
        return ()
    open_at = header.index("{", start)
    block = header[open_at : _close(header, open_at) + 1]
    return tuple(
        Alias(_ints(out), int(param), _ints(index), kind or "may-alias")
        for out, param, index, kind in _ALIAS.findall(block)
    )


def _instruction(computation: str, line: str) -> Instruction:
    m = _INSTRUCTION.match(line)
    if not m:
        raise HloParseError("not an instruction")
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):
        end = _close(rest, 0) + 1
    else:
        shape = _ARRAY_TYPE.match(rest)
        if not shape:
            raise HloParseError("no result type")
        end = shape.end()
        if rest[end : end + 1] == "{":  # layout
            end = _close(rest, end) + 1
    type_text, rest = rest[:end], rest[end:].lstrip()
    op = _OPCODE.match(rest)
    if not op:
        raise HloParseError("no opcode")
    opcode = op.group(1)
    open_at = op.end() - 1
    close_at = _close(rest, open_at)
    literal = rest[open_at + 1 : close_at]
    attrs = _attributes(rest[close_at + 1 :])
    operands = () if opcode in ("parameter", "constant", "iota") else _operand_names(literal)
    metadata = attrs.pop("metadata", "")
    op_name = _OP_NAME.search(metadata)
    return Instruction(
        computation=computation,
        name=name,
        opcode=opcode,
        type_text=type_text,
        leaves=tuple(_leaf(e, d) for e, d in _LEAF.findall(type_text)),
        operands=operands,
        literal=literal.strip(),
        attrs=attrs,
        op_name=_unescape(op_name.group(1)) if op_name else None,
        is_root=is_root,
    )


def _leaf(element: str, dims_text: str) -> ArrayType:
    dims, dynamic = [], []
    for d in (x.strip() for x in dims_text.split(",") if x.strip()):
        if d == "?":
            dims.append(0)
            dynamic.append(True)
        elif d.startswith("<="):
            dims.append(int(d[2:]))
            dynamic.append(True)
        else:
            dims.append(int(d))
            dynamic.append(False)
    return ArrayType(element, tuple(dims), tuple(dynamic))


def _operand_names(text: str) -> tuple[str, ...]:
    names = []
    for part in _split_top(text):
        token = part.split()[-1] if part.split() else ""
        if token:
            names.append(token.lstrip("%"))
    return tuple(names)


def _attributes(text: str) -> dict[str, str]:
    attrs = {}
    for part in _split_top(text):
        key, sep, value = part.partition("=")
        if sep:
            attrs[key.strip()] = value.strip()
    return attrs


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets and quotes."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _skip_string(text, i)
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
        i += 1
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return [p for p in parts if p]


def _close(text: str, open_at: int) -> int:
    """Index of the bracket closing the one at `open_at` (quotes skipped)."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _skip_string(text, i)
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise HloParseError(f"unbalanced {text[open_at]!r}")


def _skip_string(text: str, i: int) -> int:
    """Index just past the string literal starting at text[i] == '"'."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    raise HloParseError("unterminated string")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def _unquote(text: str) -> str:
    text = text.strip()
    return _unescape(text[1:-1]) if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)
