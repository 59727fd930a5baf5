"""Programs as JSON. The archive (`portable.archive`) stores this JSON next to a safetensors
weights file; docs/archive-format.md is the schema; `content_hash.py` hashes it.

Contracts:
- `program_from_json(program_to_json(p), p.weights)` rebuilds `p` exactly: node names, order,
  targets, args (int vs float, list vs tuple, dtypes ...), `meta["tensor"]` and `meta["source"]`.
  Other node meta (torch.export's `val`, `stack_trace`, ...) is not stored.
- Decoding never executes code from the document: ops resolve through the opset table, dtypes and
  layouts through fixed tables, node names must be plain identifiers.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from ..errors import ArchiveError, PortableError
from ..opset import lookup, op_name, opset_table
from .grammar import BUILTIN_NAMES, bad_identifier, bad_program_name, bad_text
from .plan import Plan
from .program import Program, ProgramKind
from .signature import Signature, SignatureError, TensorSpec
from .source import SourceLoc
from .spmd import SpmdLayout
from .symbolic import SizeExprError, parse_size

__all__ = [
    "decode_value",
    "encode_value",
    "malformed",
    "program_from_json",
    "program_to_json",
]

Json = Any

_TAGS = frozenset({"node", "float", "tuple", "dict", "dtype", "device", "layout", "memory_format"})
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_LAYOUTS = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
_FORMATS = {
    str(v).removeprefix("torch."): v
    for v in vars(torch).values()
    if isinstance(v, torch.memory_format)
}
_DEVICES = frozenset({"cpu", "meta"})
_MAX_DIM = 1 << 62  # a tensor dim or element count beyond this is not a real tensor


def malformed(what: str) -> ArchiveError:
    return ArchiveError(
        f"program.json is malformed: {what}",
        fix="the archive was edited or written by a broken tool; re-save it from the original program",
    )


# --- values ---------------------------------------------------------------------------------


def encode_value(value: Any, where: str = "value") -> Json:
    """Typed JSON for a node argument or metadata value (see docs/archive-format.md, "Values")."""
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        if math.isfinite(value):
            return {"float": value}
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [encode_value(v, where) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v, where) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ArchiveError(
                f"cannot save {where}: a dict has non-string keys", fix="use string keys"
            )
        out = {k: encode_value(v, f"{where}.{k}") for k, v in value.items()}
        return {"dict": out} if len(out) == 1 and next(iter(out)) in _TAGS else out
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise ArchiveError(
        f"cannot save {where}: values of type {type(value).__name__} have no archive encoding",
        fix="keep graph arguments and metadata to numbers, strings, None, dtypes, devices, "
        "lists, tuples and string-keyed dicts",
    )


def decode_value(data: Json, nodes: Mapping[str, torch.fx.Node] | None = None) -> Any:
    """Inverse of `encode_value`; `nodes` resolves `{"node": name}` references."""
    if data is None or isinstance(data, (bool, int, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v, nodes) for v in data]
    if isinstance(data, float):
        raise malformed(f'untagged float {data!r} (floats are written as {{"float": x}})')
    if not isinstance(data, dict):
        raise malformed(f"unexpected value {data!r}")
    if len(data) == 1 and next(iter(data)) in _TAGS:
        tag, value = next(iter(data.items()))
        return _decode_tagged(tag, value, nodes)
    return {k: decode_value(v, nodes) for k, v in data.items()}


def _decode_tagged(tag: str, value: Json, nodes: Mapping[str, torch.fx.Node] | None) -> Any:
    if tag == "node":
        if nodes is None or not isinstance(value, str) or value not in nodes:
            raise malformed(f"reference to node {value!r}, which is not defined before its use")
        return nodes[value]
    if tag == "float":
        if isinstance(value, str) and value in _NONFINITE:
            return _NONFINITE[value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise malformed(f"bad float {value!r}")
    if tag == "tuple":
        if not isinstance(value, list):
            raise malformed(f"bad tuple {value!r}")
        return tuple(decode_value(v, nodes) for v in value)
    if tag == "dict":
        if not isinstance(value, dict):
            raise malformed(f"bad dict {value!r}")
        return {k: decode_value(v, nodes) for k, v in value.items()}
    if tag == "device":
        # programs are device-neutral (captured on cpu, or shapes only on meta); backends place
        # them, so a device in an archive is one of these
        if not isinstance(value, str) or value not in _DEVICES:
            raise malformed(f"device {_short(value)} (programs hold only {sorted(_DEVICES)})")
        return torch.device(value)
    tables: dict[str, dict[str, Any]] = {
        "dtype": _DTYPES,
        "layout": _LAYOUTS,
        "memory_format": _FORMATS,
    }
    table = tables[tag]
    if not isinstance(value, str) or value not in table:
        raise malformed(f"unknown {tag} {value!r}")
    return table[value]


# --- node metadata --------------------------------------------------------------------------


def _encode_tensor(meta: Any, node: str) -> Json:
    if meta is None:
        return None
    if isinstance(meta, TensorSpec):
        return meta.to_json()
    if isinstance(meta, tuple):
        return [_encode_tensor(m, node) for m in meta]
    raise ArchiveError(f"cannot save node {node}: meta['tensor'] is a {type(meta).__name__}")


def _decode_tensor(data: Json) -> TensorSpec | tuple | None:
    if data is None:
        return None
    if isinstance(data, list):
        return tuple(_decode_tensor(d) for d in data)
    return _decode_spec(data)


def _decode_spec(data: Json) -> TensorSpec:
    if not isinstance(data, dict) or set(data) - {
        "shape",
        "dtype",
        "name",
        "kind",
        "target",
        "aliases",
    }:
        raise malformed(f"bad tensor spec {data!r}")
    dtype, shape = data.get("dtype"), data.get("shape")
    if not isinstance(dtype, str) or dtype not in _DTYPES or not isinstance(shape, list):
        raise malformed(f"bad tensor spec {_short(data)}")
    for d in shape:
        _check_dim(d, shape)
    static = [d for d in shape if isinstance(d, int)]
    if math.prod(static) > _MAX_DIM:
        raise malformed(f"shape {_short(shape)} has more than 2**62 elements")
    return TensorSpec(tuple(shape), _DTYPES[dtype])


def _check_dim(dim: Json, shape: Json) -> None:
    """A dim is an int in [0, 2**62] or a size expression over declared symbols."""
    if isinstance(dim, int) and not isinstance(dim, bool):
        if not 0 <= dim <= _MAX_DIM:
            raise malformed(f"shape {_short(shape)} has dim {dim} outside [0, 2**62]")
        return
    try:
        expr = parse_size(dim)
    except SizeExprError as exc:
        raise malformed(f"shape {_short(shape)} has a bad dim {_short(dim)}: {exc}") from None
    if not expr.free_symbols:  # a constant written as text would escape every size check
        raise malformed(f"shape {_short(shape)} writes the constant dim {dim!r} as text")


def _short(value: Json, limit: int = 120) -> str:
    """repr of a value from the document, cut to `limit` characters for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _encode_source(meta: Any, node: str) -> Json:
    if meta is None:
        return None
    if isinstance(meta, SourceLoc):
        return meta.to_json()
    raise ArchiveError(f"cannot save node {node}: meta['source'] is a {type(meta).__name__}")


_SOURCE_TEXT = ("module", "file", "code")


def _decode_source(data: Json) -> SourceLoc | None:
    """A source location: printable strings and a line number, nothing else."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) - {*_SOURCE_TEXT, "line"}:
        raise malformed(f"bad source location {_short(data)}")
    for key in _SOURCE_TEXT:
        if key in data and (why := bad_text(data[key])) is not None:
            raise malformed(f"source location {key} {why}")
    line = data.get("line")
    if line is not None and (not isinstance(line, int) or isinstance(line, bool) or line < 0):
        raise malformed(f"bad source line {_short(line)}")
    return SourceLoc(**data)


# --- graph ----------------------------------------------------------------------------------


def _op_of(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "call_function" and node.target is operator.getitem:
        return "getitem"
    if node.op == "call_function" and lookup(node.target) is not None:
        return op_name(node.target)
    raise ArchiveError(
        f"cannot save node {node.name}: a {node.op} of {op_name(node.target)}",
        fix="programs hold only opset ops; run portable.verify(program) to see why",
    )


def _encode_node(node: torch.fx.Node) -> dict[str, Json]:
    where = f"node {node.name}"
    out: dict[str, Json] = {
        "name": node.name,
        "op": _op_of(node),
        "args": [encode_value(a, where) for a in node.args],
        "kwargs": {k: encode_value(v, where) for k, v in node.kwargs.items()},
    }
    if "tensor" in node.meta:
        out["tensor"] = _encode_tensor(node.meta["tensor"], node.name)
    if "source" in node.meta:
        out["source"] = _encode_source(node.meta["source"], node.name)
    if node.meta.get("phase") in PHASES:
        out["phase"] = [node.meta["phase"], int(node.meta.get("micro_batch", 0))]
    return out


PHASES = ("forward", "backward", "optimizer")  # a training step's parts (capture/training.py)


def _decode_phase(data: Json, name: str) -> tuple[str, int]:
    if (
        isinstance(data, list)
        and len(data) == 2
        and data[0] in PHASES
        and type(data[1]) is int
        and 0 <= data[1] < 1 << 16
    ):
        return data[0], data[1]
    raise malformed(f"node {name} has a bad phase {_short(data)}")


def _target(op: Json) -> tuple[str, Any]:
    if not isinstance(op, str):
        raise malformed(f"bad op {_short(op)}")
    if op in ("placeholder", "output"):
        return op, None
    if op == "getitem":
        return "call_function", operator.getitem
    entry = opset_table().get(op)
    if entry is None:
        printable = bad_text(op, limit=200) is None
        raise ArchiveError(
            f"the archive uses op {op if printable else _short(op)}, which is not in this "
            "portable's opset",
            op=op if printable else None,
            fix="load it with the portable version that wrote it, or upgrade portable",
        )
    return "call_function", entry.overload


_NODE_FIELDS = frozenset({"name", "op", "args", "kwargs", "tensor", "source", "phase"})


def _decode_graph(nodes: Json) -> torch.fx.GraphModule:
    """Rebuild the graph. Every name becomes a Python identifier in the source torch.fx
    generates, and every kwargs key a keyword argument, so both are checked against their
    grammars (portable.ir.grammar) and the op's schema before anything is built."""
    if not isinstance(nodes, list) or not nodes:
        raise malformed("graph is not a non-empty list of nodes")
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for data in nodes:
        if not isinstance(data, dict) or set(data) - _NODE_FIELDS or "name" not in data:
            raise malformed(f"bad node {_short(data)}")
        name = data["name"]
        if (why := bad_identifier(name)) is not None:
            raise malformed(f"node name {_short(name)} {why}")
        if name in env:
            raise malformed(f"node name {name!r} is used twice")
        kind, target = _target(data.get("op"))
        args, kwargs = data.get("args", []), data.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise malformed(f"node {name} has bad args or kwargs")
        args = tuple(decode_value(a, env) for a in args)
        kwargs = {k: decode_value(v, env) for k, v in kwargs.items()}
        _check_call(name, data["op"], args, kwargs)
        node = graph.create_node(
            kind,
            name if kind == "placeholder" else ("output" if kind == "output" else target),
            args,
            kwargs,
            name=name,
        )
        if node.name != name:
            # fx renames a placeholder that shadows a builtin (`input`), as torch.export names
            # them; any other renaming means the name collides with one fx needs
            if kind != "placeholder" or name not in BUILTIN_NAMES:
                raise malformed(f"node name {name!r} collides with a name the graph needs")
            _force_name(graph, node, name)
        if "tensor" in data:
            node.meta["tensor"] = _decode_tensor(data["tensor"])
        if "source" in data:
            node.meta["source"] = _decode_source(data["source"])
        if "phase" in data:
            node.meta["phase"], node.meta["micro_batch"] = _decode_phase(data["phase"], name)
        env[name] = node
    if nodes[-1].get("op") != "output" or sum(n.op == "output" for n in graph.nodes) != 1:
        raise malformed("the graph must end with its one output node")
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _check_call(name: str, op: str, args: tuple, kwargs: dict[str, Any]) -> None:
    """The node's arguments fit its op: placeholders take none, the output one tuple of
    values, getitem (node, int), an opset op its schema (kwargs keys are argument names)."""
    if op == "placeholder":
        if args or kwargs:
            raise malformed(f"placeholder {name} has arguments")
        return
    if op == "output":
        if kwargs or len(args) != 1 or not isinstance(args[0], (tuple, list)):
            raise malformed(f"output node {name} must have one tuple of results")
        if not all(isinstance(a, torch.fx.Node) for a in args[0]):
            raise malformed(f"output node {name} returns something other than graph values")
        return
    if op == "getitem":
        if kwargs or len(args) != 2 or not isinstance(args[0], torch.fx.Node):
            raise malformed(f"getitem {name} must take (node, index)")
        if not isinstance(args[1], int) or isinstance(args[1], bool):
            raise malformed(f"getitem {name} has index {_short(args[1])}, not an int")
        return
    why = opset_table()[op].bad_call(len(args), kwargs)
    if why is not None:
        raise malformed(f"node {name} ({op}) {why}")
    if kwargs.get("pin_memory") not in (None, False):
        raise malformed(f"node {name} ({op}) asks for pinned memory, which programs never hold")


def _force_name(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> None:
    """Give `node` exactly `name` (as torch.export does for placeholders named like builtins)."""
    namespace = graph._graph_namespace
    namespace._used_names.discard(node.name)
    namespace._rename_object(node, name)
    node.name = name


# --- program --------------------------------------------------------------------------------


def program_to_json(program: Program) -> dict[str, Json]:
    """The JSON document of everything but the weights (see docs/archive-format.md, "program").

    Raises ArchiveError naming the node or metadata key that has no encoding."""
    return {
        "kind": program.kind.value,
        "opset_version": program.opset_version,
        "signature": program.signature.to_json(),
        "plan": program.plan.to_json(),
        "metadata": encode_value(_metadata_doc(program), "metadata"),
        # last, so the file reads header first
        "graph": [_encode_node(n) for n in program.graph.nodes],
    }


def program_from_json(doc: Json, weights: dict[str, torch.Tensor]) -> Program:
    """Rebuild a Program from `program_to_json`'s document and its weights.

    Raises ArchiveError on unknown ops or malformed documents; does not check hashes or verify."""
    if not isinstance(doc, dict):
        raise malformed("the program is not a JSON object")
    try:
        kind = ProgramKind(doc["kind"])
        signature = _decode_signature(doc["signature"])
        plan = Plan.from_json(doc.get("plan"))
        metadata = decode_value(doc.get("metadata", {}))
    except PortableError as exc:
        if isinstance(exc, ArchiveError):
            raise
        raise malformed(exc.what) from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise malformed(f"{type(exc).__name__}: {exc}") from exc
    _check_metadata(metadata)
    spmd = _decode_spmd(metadata)
    gm = _decode_graph(doc.get("graph"))
    return Program(kind, gm, signature, dict(weights), plan, metadata, spmd)


# the metadata entries passes record after spmd-partition's layout (pass history, comm-overlap)
_AFTER_SPMD = ("passes", "comm_overlap")


def _metadata_doc(program: Program) -> dict[str, Json]:
    """The metadata document: `program.metadata` with the layout as its "spmd" entry, where the
    partitioner's write left it in every archive before `Program.spmd`: before the entries of
    `_AFTER_SPMD`, else last (only the order of entries can differ from an old archive, for
    passes applied before spmd-partition; the content hash does not depend on it)."""
    if "spmd" in program.metadata:
        raise ArchiveError(
            'cannot save the metadata entry "spmd": the name is reserved for the layout',
            fix="set the per-rank layout as `Program.spmd` (a SpmdLayout), not in metadata",
        )
    if program.spmd is None:
        return program.metadata
    keys = list(program.metadata)
    at = next((i for i, k in enumerate(keys) if k in _AFTER_SPMD), len(keys))
    entries = list(program.metadata.items())
    return dict([*entries[:at], ("spmd", program.spmd.to_json()), *entries[at:]])


def _decode_spmd(metadata: dict[str, Json]) -> SpmdLayout | None:
    """Take the "spmd" entry out of the decoded metadata: the program's typed layout."""
    if "spmd" not in metadata:
        return None
    try:
        return SpmdLayout.from_json(metadata.pop("spmd"))
    except PortableError as exc:
        raise malformed(f"metadata.spmd: {exc.what}") from exc


_INPUT_FIELDS = frozenset({"name", "kind", "target", "shape", "dtype"})
_OUTPUT_FIELDS = _INPUT_FIELDS | {"aliases"}


def _decode_signature(data: Json) -> Signature:
    """The signature, with input names held to the identifier grammar (they are placeholders)
    and every other string to the text grammar."""
    if not isinstance(data, dict) or set(data) != {"inputs", "outputs"}:
        raise malformed("signature is not {inputs, outputs}")
    inputs, outputs = data["inputs"], data["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise malformed("signature inputs/outputs are not lists")
    for spec in inputs:
        _check_io(spec, _INPUT_FIELDS, "input")
        if (why := bad_identifier(spec["name"])) is not None:
            raise malformed(f"signature input name {_short(spec['name'])} {why}")
    for spec in outputs:
        _check_io(spec, _OUTPUT_FIELDS, "output")
        if (why := bad_text(spec["name"], limit=1024)) is not None:
            raise malformed(f"signature output name {why}")
        aliases = spec.get("aliases")
        if aliases is not None and (why := bad_identifier(aliases)) is not None:
            raise malformed(f"signature output {spec['name']} aliases a name that {why}")
    try:
        return Signature.from_json(data)
    except SignatureError as exc:  # a state input or gradient without its weight key
        raise malformed(exc.what) from exc
    except ValueError as exc:  # an unknown input or output kind
        raise malformed(str(exc)) from exc


def _check_io(spec: Json, fields: frozenset[str], what: str) -> None:
    if not isinstance(spec, dict) or not {"name", "kind", "shape", "dtype"} <= set(spec) <= fields:
        raise malformed(f"bad signature {what} {_short(spec)}")
    _decode_spec({"shape": spec["shape"], "dtype": spec["dtype"]})
    target = spec.get("target")
    if target is not None and (why := bad_text(target, limit=1024)) is not None:
        raise malformed(f"signature {what} target {why}")
    if not isinstance(spec["kind"], str):
        raise malformed(f"bad signature {what} kind {_short(spec['kind'])}")


def _check_metadata(metadata: Json) -> None:
    """The metadata keys portable reads to run a program hold values of their documented
    types (docs/archive-format.md, "metadata"); every key anywhere is printable text."""
    if not isinstance(metadata, dict):
        raise malformed("metadata is not an object")
    _check_keys(metadata, "metadata")
    if "name" in metadata and (why := bad_program_name(metadata["name"])) is not None:
        raise malformed(f"metadata.name {why}")
    version = metadata.get("opset_version")
    if version is not None and not (isinstance(version, str) and _OPSET.fullmatch(version)):
        raise malformed(f"metadata.opset_version {_short(version)} is not MAJOR.MINOR")
    tied = metadata.get("tied_weights", {})
    if not isinstance(tied, dict) or not all(isinstance(v, str) for v in tied.values()):
        raise malformed("metadata.tied_weights is not {name: name}")
    _check_symbolic_dims(metadata.get("symbolic_dims", {}))


_OPSET = re.compile(r"[0-9]{1,6}\.[0-9]{1,6}")


def _check_keys(value: Json, where: str) -> None:
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if (why := bad_text(key, limit=1024)) is not None:
                    raise malformed(f"a key of {path} {why}")
                stack.append((child, f"{path}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, path) for child in item)
        elif isinstance(item, str) and (why := bad_text(item, limit=1 << 20)) is not None:
            raise malformed(f"a string in {path} {why}")


def _check_symbolic_dims(dims: Json) -> None:
    """{symbol: {"min": int >= 0, "max": int >= min or None, "source": text}}."""
    if not isinstance(dims, dict):
        raise malformed("metadata.symbolic_dims is not an object")
    for symbol, bounds in dims.items():
        if (why := bad_identifier(symbol)) is not None:
            raise malformed(f"symbolic dim {_short(symbol)} {why}")
        if not isinstance(bounds, dict) or set(bounds) - {"min", "max", "source"}:
            raise malformed(f"symbolic dim {symbol} has bad bounds {_short(bounds)}")
        low, high = bounds.get("min", 0), bounds.get("max")
        if not _is_size(low) or not (high is None or _is_size(high) and high >= low):
            raise malformed(f"symbolic dim {symbol} has bad range [{low}, {high}]")
        if (why := bad_text(bounds.get("source", ""))) is not None:
            raise malformed(f"symbolic dim {symbol} has a source that {why}")


def _is_size(value: Json) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_DIM
