"""Read the printed form of a program (`portable.ir.printer`) back into a `Program`.

    program MLP (inference, opset 1.2)
      in  p_fc1_weight: parameter fc1.weight float32[64x32]
      in  x: user_input float32[8x32]
      %t = aten.t.default(%p_fc1_weight) : float32[32x64]  # fc1
      %mm = aten.mm.default(%x, %t) : float32[8x64]  # fc1
      out 0: output = %mm

Contract: `format_program(parse_program(text)) == text` for every text `format_program` prints
(the examples' inference and training programs, per-rank and MX-quantized ones). The parsed
program is what an archive round trip gives (node names, order, targets, args, `meta["tensor"]`,
`meta["source"]`), less what the text does not hold:

- weights: every state input gets zeros of its spec (one zero broadcast to the shape, so no
  declared size allocates anything) unless `weights` supplies them;
- plan and metadata: the default plan and `{name, opset_version}` unless given; no `spmd` layout;
- a source location is its module path only (no file or line);
- list and tuple arguments both read back as lists (they print alike);
- an output's `target` is the target of the input it aliases (None when it aliases none).

Text is read as input from elsewhere: ops resolve through the opset table and their arguments
are checked against its schema, literals come from a fixed grammar (never `eval`), names are
plain identifiers (`portable.ir.grammar`), list nesting is bounded, and no size declared in it
allocates. Every failure is a `VerifyError` naming the line. Semantic checks (shape rules,
dtypes) are `portable.verify`'s: call it on the result.

Lines, in this order (blank lines and lines starting with `#` are ignored):

    program NAME (KIND, opset MAJOR.MINOR)
    in  NAME: KIND [TARGET] SPEC
    %NAME = OP(ARG, ..., KEY=ARG, ...) : META  [# MODULE]
    %NAME = %NAME[INDEX] : META  [# MODULE]
    out NAME: KIND = %NAME [(aliases NAME)]

SPEC is `dtype[d0xd1x...]` (a dim is an int or a size expression such as `s0`); META a SPEC, a
parenthesized tuple of them, or `?` (no recorded tensor). An ARG is `%name`, `[ARG, ...]`, an
int, a float (`1.0`, `1e-05`, `inf`, `nan`), `True`/`False`/`None`, a torch dtype, layout or
memory format (`torch.float32`), or a bare word where the op's schema takes a `str` (`dp`,
`sum`) or a `Device` (`cpu`, `meta`).
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx

from ..errors import VerifyError
from ..opset import OPSET_VERSION, OpDef, opset_table
from .grammar import BUILTIN_NAMES, bad_identifier, bad_program_name, bad_text
from .plan import Plan
from .program import Program, ProgramKind
from .signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Signature,
    TensorSpec,
    dtype_from_name,
)
from .source import SourceLoc
from .symbolic import SizeExprError, parse_size

__all__ = ["parse_program"]

_MAX_DEPTH = 8  # list nesting of one argument (schemas use at most 1)
_HEADER = re.compile(r"program (.+) \((\w+), opset (\d+)\.(\d+)\)")
_INPUT = re.compile(r"in +(\S+): (\w+)(?: (.+))? (\S+)")
_OUTPUT = re.compile(r"out (.+?): (\w+) = %(\S+?)(?: \(aliases (\S+)\))?")
_CALL = re.compile(r"%(\S+) = ([\w.]+)\((.*)\)")
_GETITEM = re.compile(r"%(\S+) = %(\S+)\[(-?\d+)\]")
_SPEC = re.compile(r"(\w+)\[(.*)\]")
_DIM_SPLIT = re.compile(r"(?<=[0-9)])x")  # `4x64`, `s0x4`; not the x of `Max(`
_TOKEN = re.compile(r" *(?:(%[A-Za-z0-9_]+)|([\[\],=])|([A-Za-z0-9_.+\-]+))")
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(?:\d+\.\d*(?:e[-+]?\d+)?|\d+e[-+]?\d+|inf|nan)")
_WORDS: dict[str, Any] = {"True": True, "False": False, "None": None}
_TORCH_CONSTANTS = {
    str(v): v
    for v in vars(torch).values()
    if isinstance(v, (torch.dtype, torch.layout, torch.memory_format))
}
_DEVICES = frozenset({"cpu", "meta"})  # programs are device-neutral (as in archives)
_STR, _DEVICE, _VALUE = "str", "device", "value"
_Use = Callable[["_Line", str], torch.fx.Node]  # %name -> its node, or a VerifyError


@dataclasses.dataclass(frozen=True)
class _Line:
    number: int
    text: str

    def error(self, what: str, fix: str | None = None) -> VerifyError:
        excerpt = self.text if len(self.text) <= 160 else self.text[:157] + "..."
        return VerifyError(
            f"IR text line {self.number}: {what}",
            source=f"line {self.number}: {excerpt}",
            fix=fix
            or "write the line as portable.ir.printer prints it (see portable/ir/parser.py)",
        )


def parse_program(
    text: str,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    plan: Plan | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Program:
    """The program `text` prints (see the module docstring for what is and is not carried).

    `weights` (by weight key) replace the zero weights; `metadata` is merged over the
    header's name and opset version. Raises VerifyError naming the first bad line."""
    if not isinstance(text, str):
        raise VerifyError(f"IR text is a {type(text).__name__}, not a string")
    lines = list(_lines(text))
    if not lines:
        raise VerifyError(
            "IR text is empty", fix="start with a `program NAME (KIND, opset V)` line"
        )
    name, kind, opset = _header(lines[0])
    reader = _GraphReader()
    for line in lines[1:]:
        reader.read(line)
    signature = reader.finish(lines[-1])
    return Program(
        kind=kind,
        graph_module=torch.fx.GraphModule(torch.nn.Module(), reader.graph),
        signature=signature,
        weights=_weights(signature, reader.input_lines, weights or {}),
        plan=plan if plan is not None else Plan(),
        metadata={"name": name, "opset_version": opset, **(metadata or {})},
    )


def _lines(text: str) -> Iterator[_Line]:
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped and not stripped.startswith("#"):
            yield _Line(number, stripped)


def _header(line: _Line) -> tuple[str, ProgramKind, str]:
    match = _HEADER.fullmatch(line.text)
    if match is None:
        raise line.error("is not a `program NAME (KIND, opset MAJOR.MINOR)` header")
    name, kind, major, minor = match.groups()
    if (why := bad_program_name(name)) is not None:
        raise line.error(f"program name {why}")
    kinds = [k.value for k in ProgramKind]
    if kind not in kinds:
        raise line.error(f"program kind {kind!r} is not one of {kinds}")
    ours = tuple(int(p) for p in OPSET_VERSION.split("."))
    if int(major) != ours[0] or int(minor) > ours[1]:
        raise line.error(
            f"opset {major}.{minor} is not readable by this portable (opset {OPSET_VERSION})",
            fix="read it with the portable version that printed it",
        )
    return name, ProgramKind(kind), f"{major}.{minor}"


class _GraphReader:
    """Builds the graph line by line: inputs, then ops, then outputs."""

    _SECTIONS = ("in", "op", "out")

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()
        self.env: dict[str, torch.fx.Node] = {}
        self.inputs: list[InputSpec] = []
        self.input_lines: dict[str, _Line] = {}
        self.outputs: list[tuple[OutputSpec, torch.fx.Node]] = []
        self.section = 0

    def read(self, line: _Line) -> None:
        head = line.text.split(" ", 1)[0]
        section = "op" if head.startswith("%") else head
        if section not in self._SECTIONS:
            raise line.error("is not an `in`, `%name = ...` or `out` line")
        index = self._SECTIONS.index(section)
        if index < self.section:
            raise line.error(
                f"an `{section}` line after an `{self._SECTIONS[self.section]}` line",
                fix="write the inputs first, then the ops, then the outputs",
            )
        self.section = index
        {"in": self._input, "op": self._op, "out": self._output}[section](line)

    def finish(self, last: _Line) -> Signature:
        if not self.outputs:
            raise last.error("the program has no `out` lines", fix="end with its outputs")
        self.graph.output(tuple(node for _, node in self.outputs))
        return Signature(tuple(self.inputs), tuple(spec for spec, _ in self.outputs))

    def _input(self, line: _Line) -> None:
        match = _INPUT.fullmatch(line.text)
        if match is None:
            raise line.error("is not an `in  NAME: KIND [TARGET] SPEC` line")
        name, kind, target, spec = match.groups()
        kinds = [k.value for k in InputKind]
        if kind not in kinds:
            raise line.error(f"input kind {kind!r} is not one of {kinds}")
        if target is not None and (why := bad_text(target)) is not None:
            raise line.error(f"input target {why}")
        node = self._define(line, name, "placeholder", name, (), {})
        node.meta["tensor"] = _spec(line, spec)
        self.inputs.append(InputSpec(name, InputKind(kind), node.meta["tensor"], target))
        self.input_lines[name] = line

    def _op(self, line: _Line) -> None:
        body, _, module = line.text.partition("  # ")
        call, sep, meta = body.rpartition(" : ")
        if not sep:
            raise line.error("has no ` : META` after the op")
        if (match := _GETITEM.fullmatch(call)) is not None:
            name, source, index = match.groups()
            node = self._define(
                line,
                name,
                "call_function",
                operator.getitem,
                (self._use(line, source), int(index)),
                {},
            )
        elif (match := _CALL.fullmatch(call)) is not None:
            name, op, args = match.groups()
            entry = _entry(line, op)
            values, kwargs = _Arguments(line, entry, self._use).parse(args)
            if (why := entry.bad_call(len(values), kwargs)) is not None:
                raise line.error(f"{op} {why}", fix=f"its schema is {entry.signature}")
            node = self._define(line, name, "call_function", entry.overload, tuple(values), kwargs)
        else:
            raise line.error("is not `%name = op(args) : META` or `%name = %value[index] : META`")
        node.meta["tensor"] = _meta(line, meta)
        if module:
            if (why := bad_text(module)) is not None:
                raise line.error(f"source module {why}")
            node.meta["source"] = SourceLoc(module=module)

    def _output(self, line: _Line) -> None:
        match = _OUTPUT.fullmatch(line.text)
        if match is None:
            raise line.error("is not an `out NAME: KIND = %value [(aliases NAME)]` line")
        name, kind, value, aliases = match.groups()
        kinds = [k.value for k in OutputKind]
        if kind not in kinds:
            raise line.error(f"output kind {kind!r} is not one of {kinds}")
        if (why := bad_text(name)) is not None:
            raise line.error(f"output name {why}")
        node = self._use(line, value)
        spec = node.meta.get("tensor")
        if not isinstance(spec, TensorSpec):
            raise line.error(f"output value %{value} has no one tensor spec")
        target = None
        if aliases is not None:
            aliased = next((i for i in self.inputs if i.name == aliases), None)
            if aliased is None:
                raise line.error(f"output aliases {aliases!r}, which is no input")
            target = aliased.target
        self.outputs.append((OutputSpec(name, OutputKind(kind), spec, target, aliases), node))

    def _use(self, line: _Line, name: str) -> torch.fx.Node:
        node = self.env.get(name)
        if node is None:
            raise line.error(f"%{name[:80]} is not defined before this line")
        return node

    def _define(
        self,
        line: _Line,
        name: str,
        op: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> torch.fx.Node:
        if (why := bad_identifier(name)) is not None:
            raise line.error(f"name {name[:80]!r} {why}")
        if name in self.env:
            raise line.error(f"%{name} is defined twice")
        node = self.graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            # fx renames a placeholder that shadows a builtin (`input`); torch.export keeps the
            # name, and so does the archive. Any other renaming is a name fx needs itself.
            if op != "placeholder" or name not in BUILTIN_NAMES:
                raise line.error(f"name {name!r} collides with a name the graph needs")
            namespace = self.graph._graph_namespace
            namespace._used_names.discard(node.name)
            namespace._rename_object(node, name)
            node.name = name
        self.env[name] = node
        return node


def _entry(line: _Line, op: str) -> OpDef:
    table = opset_table()
    entry = table.get(op)
    if entry is None:
        close = difflib.get_close_matches(op, list(table), n=3)
        raise line.error(
            f"op {op} is not in the portable opset",
            fix=f"closest: {', '.join(close)}" if close else "see docs/opset.md for the ops",
        )
    return entry


# --- values ---------------------------------------------------------------------------------


class _Arguments:
    """The argument list of one call, each literal read as its schema type asks."""

    def __init__(self, line: _Line, entry: OpDef, use: _Use) -> None:
        self.line, self.use = line, use
        schema = None if entry.name.startswith("sym.") else entry.overload._schema
        arguments = schema.arguments if schema is not None else []
        self.positional = [_kind(a.type) for a in arguments if not a.kwarg_only]
        self.named = {a.name: _kind(a.type) for a in arguments}
        self.tokens: list[str] = []

    def parse(self, text: str) -> tuple[list[Any], dict[str, Any]]:
        self.tokens = _tokens(self.line, text)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        while self.tokens:
            if len(self.tokens) > 1 and self.tokens[1] == "=":
                key = self.tokens.pop(0)
                self.tokens.pop(0)
                if key in kwargs:  # keys are held to the schema's names by bad_call
                    raise self.line.error(f"keyword {key[:80]!r} is given twice")
                kwargs[key] = self._value(self.named.get(key, _VALUE), 0)
            elif kwargs:
                raise self.line.error("a positional argument after a keyword argument")
            else:
                kind = self.positional[len(args)] if len(args) < len(self.positional) else _VALUE
                args.append(self._value(kind, 0))
            if self.tokens and self.tokens.pop(0) != ",":
                raise self.line.error("arguments are not separated by `, `")
        return args, kwargs

    def _value(self, kind: str, depth: int) -> Any:
        if not self.tokens:
            raise self.line.error("an argument is missing")
        token = self.tokens.pop(0)
        if token.startswith("%"):
            return self.use(self.line, token[1:])
        if token == "[":
            return self._list(kind, depth + 1)
        if token in ("]", ",", "="):
            raise self.line.error(f"unexpected `{token}` in the arguments")
        return _literal(self.line, token, kind)

    def _list(self, kind: str, depth: int) -> list[Any]:
        if depth > _MAX_DEPTH:
            raise self.line.error(f"lists nest deeper than {_MAX_DEPTH}")
        items: list[Any] = []
        while self.tokens and self.tokens[0] != "]":
            items.append(self._value(kind, depth))
            if self.tokens and self.tokens[0] not in (",", "]"):
                raise self.line.error("list items are not separated by `, `")
            if self.tokens and self.tokens[0] == ",":
                self.tokens.pop(0)
        if not self.tokens:
            raise self.line.error("a `[` is not closed")
        self.tokens.pop(0)
        return items


def _kind(jit_type: Any) -> str:
    """How bare words read for an argument of this schema type: `str`, `device` or `value`."""
    while isinstance(jit_type, (torch._C.OptionalType, torch._C.ListType)):
        jit_type = jit_type.getElementType()
    if isinstance(jit_type, torch._C.StringType):
        return _STR
    if isinstance(jit_type, torch._C.DeviceObjType):
        return _DEVICE
    return _VALUE


def _tokens(line: _Line, text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise line.error(f"cannot read the arguments from {text[pos : pos + 40]!r}")
        tokens.append(next(g for g in match.groups() if g is not None))
        pos = match.end()
    return tokens


def _literal(line: _Line, token: str, kind: str) -> Any:
    if token in _WORDS:
        return _WORDS[token]
    if kind == _STR:
        return token
    if kind == _DEVICE:
        if token not in _DEVICES:
            raise line.error(f"device {token!r} (programs hold only {sorted(_DEVICES)})")
        return torch.device(token)
    if _INT.fullmatch(token):
        return int(token)
    if _FLOAT.fullmatch(token):
        return float(token)
    if token in _TORCH_CONSTANTS:
        return _TORCH_CONSTANTS[token]
    raise line.error(
        f"cannot read the value {token[:80]!r}",
        fix="a value is %name, [..], a number, True/False/None or a torch dtype, layout or "
        "memory format; bare words only where the op's schema takes a str or a Device",
    )


# --- tensor specs ---------------------------------------------------------------------------


def _meta(line: _Line, text: str) -> TensorSpec | tuple | None:
    if text == "?":
        return None
    if text.startswith("(") and text.endswith(")"):
        inner = text[1:-1]
        parts = re.split(r", (?=\w+\[|\?)", inner) if inner else []
        return tuple(_meta(line, part) for part in parts)
    return _spec(line, text)


def _spec(line: _Line, text: str) -> TensorSpec:
    match = _SPEC.fullmatch(text)
    if match is None:
        raise line.error(f"{text[:80]!r} is not a tensor spec `dtype[d0xd1x...]`")
    dtype_name, dims = match.groups()
    try:
        dtype = dtype_from_name(dtype_name)
    except ValueError:
        raise line.error(f"unknown dtype {dtype_name[:40]!r}") from None
    shape = tuple(_dim(line, d) for d in _DIM_SPLIT.split(dims)) if dims else ()
    return TensorSpec(shape, dtype)


def _dim(line: _Line, text: str) -> int | str:
    if _INT.fullmatch(text) and not text.startswith("-"):
        return int(text)
    try:
        expr = parse_size(text)
    except SizeExprError as exc:
        raise line.error(f"dim {text[:80]!r} is not an int or a size expression: {exc}") from None
    if not expr.free_symbols:
        raise line.error(f"dim {text!r} writes a constant as an expression")
    return text


def _weights(
    signature: Signature, lines: Mapping[str, _Line], given: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`given`'s weights, and zeros of the spec for every other state input's target (a 0-d
    zero expanded to the shape: a declared size allocates nothing; whoever materializes it,
    a backend or `save`, does so under `portable.limits`)."""
    weights = dict(given)
    for spec in signature.state_inputs:
        if spec.target is None or spec.target in weights:
            continue
        line = lines[spec.name]
        if any(isinstance(d, str) for d in spec.spec.shape):
            raise line.error(
                f"state input {spec.name} has a symbolic shape and no weight",
                fix="pass its weight in parse_program(..., weights={...})",
            )
        shape = tuple(int(d) for d in spec.spec.shape)
        weights[spec.target] = torch.zeros((), dtype=spec.spec.dtype).expand(shape)
    return weights
