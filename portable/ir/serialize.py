"""Programs as JSON, and the content hash. The archive (`portable.archive`) stores this JSON next
to a safetensors weights file; docs/archive-format.md is the schema.

Contracts:
- `program_from_json(program_to_json(p), p.weights)` rebuilds `p` exactly: node names, order,
  targets, args (int vs float, list vs tuple, dtypes ...), `meta["tensor"]` and `meta["source"]`.
  Other node meta (torch.export's `val`, `stack_trace`, ...) is not stored.
- Decoding never executes code from the document: ops resolve through the opset table, dtypes and
  layouts through fixed tables, node names must be plain identifiers.
- `program_hash` covers the kind, opset version, signature, plan, graph (without source
  locations, which are debug info) and every weight (key, dtype, shape, bytes); not metadata.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import math
import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from ..errors import ArchiveError, PortableError
from ..opset import lookup, op_name, opset_table
from .plan import Plan
from .program import Program, ProgramKind
from .signature import Signature, TensorSpec
from .source import SourceLoc

__all__ = [
    "decode_value",
    "doc_hash",
    "doc_structure_bytes",
    "encode_value",
    "program_from_json",
    "program_hash",
    "program_to_json",
    "structure_bytes",
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
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _malformed(what: str) -> ArchiveError:
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
        raise _malformed(f'untagged float {data!r} (floats are written as {{"float": x}})')
    if not isinstance(data, dict):
        raise _malformed(f"unexpected value {data!r}")
    if len(data) == 1 and next(iter(data)) in _TAGS:
        tag, value = next(iter(data.items()))
        return _decode_tagged(tag, value, nodes)
    return {k: decode_value(v, nodes) for k, v in data.items()}


def _decode_tagged(tag: str, value: Json, nodes: Mapping[str, torch.fx.Node] | None) -> Any:
    if tag == "node":
        if nodes is None or value not in nodes:
            raise _malformed(f"reference to node {value!r}, which is not defined before its use")
        return nodes[value]
    if tag == "float":
        if isinstance(value, str) and value in _NONFINITE:
            return _NONFINITE[value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _malformed(f"bad float {value!r}")
    if tag == "tuple":
        if not isinstance(value, list):
            raise _malformed(f"bad tuple {value!r}")
        return tuple(decode_value(v, nodes) for v in value)
    if tag == "dict":
        if not isinstance(value, dict):
            raise _malformed(f"bad dict {value!r}")
        return {k: decode_value(v, nodes) for k, v in value.items()}
    if tag == "device":
        try:
            return torch.device(value)
        except (RuntimeError, TypeError) as exc:
            raise _malformed(f"bad device {value!r}") from exc
    tables: dict[str, dict[str, Any]] = {
        "dtype": _DTYPES,
        "layout": _LAYOUTS,
        "memory_format": _FORMATS,
    }
    table = tables[tag]
    if not isinstance(value, str) or value not in table:
        raise _malformed(f"unknown {tag} {value!r}")
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
        raise _malformed(f"bad tensor spec {data!r}")
    dtype, shape = data.get("dtype"), data.get("shape")
    if dtype not in _DTYPES or not isinstance(shape, list):
        raise _malformed(f"bad tensor spec {data!r}")
    if not all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in shape):
        raise _malformed(f"bad shape {shape!r}")
    return TensorSpec(tuple(shape), _DTYPES[dtype])


def _encode_source(meta: Any, node: str) -> Json:
    if meta is None:
        return None
    if isinstance(meta, SourceLoc):
        return meta.to_json()
    raise ArchiveError(f"cannot save node {node}: meta['source'] is a {type(meta).__name__}")


def _decode_source(data: Json) -> SourceLoc | None:
    if data is None:
        return None
    try:
        return SourceLoc(**data)
    except TypeError as exc:
        raise _malformed(f"bad source location {data!r}") from exc


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
    return out


def _target(op: Json) -> tuple[str, Any]:
    if not isinstance(op, str):
        raise _malformed(f"bad op {op!r}")
    if op in ("placeholder", "output"):
        return op, None
    if op == "getitem":
        return "call_function", operator.getitem
    entry = opset_table().get(op)
    if entry is None:
        raise ArchiveError(
            f"the archive uses op {op}, which is not in this portable's opset",
            op=op,
            fix="load it with the portable version that wrote it, or upgrade portable",
        )
    return "call_function", entry.overload


def _decode_graph(nodes: Json) -> torch.fx.GraphModule:
    if not isinstance(nodes, list) or not nodes:
        raise _malformed("graph is not a non-empty list of nodes")
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for data in nodes:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise _malformed(f"bad node {data!r}")
        name = data["name"]
        if not _NAME.match(name) or keyword.iskeyword(name) or name in env:
            raise _malformed(f"node name {name!r} is not a unique Python identifier")
        kind, target = _target(data.get("op"))
        args, kwargs = data.get("args", []), data.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise _malformed(f"node {name} has bad args or kwargs")
        node = graph.create_node(
            kind,
            name if kind == "placeholder" else ("output" if kind == "output" else target),
            tuple(decode_value(a, env) for a in args),
            {k: decode_value(v, env) for k, v in kwargs.items()},
            name=name,
        )
        if node.name != name:  # fx renames placeholders that shadow builtins (`input`)
            _force_name(graph, node, name)
        if "tensor" in data:
            node.meta["tensor"] = _decode_tensor(data["tensor"])
        if "source" in data:
            node.meta["source"] = _decode_source(data["source"])
        env[name] = node
    if nodes[-1].get("op") != "output" or sum(n.op == "output" for n in graph.nodes) != 1:
        raise _malformed("the graph must end with its one output node")
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _force_name(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> None:
    """Give `node` exactly `name` (as torch.export does for placeholders named like builtins)."""
    namespace = graph._graph_namespace
    namespace._used_names.discard(node.name)
    namespace._rename_object(node, name)
    node.name = name


# --- program --------------------------------------------------------------------------------


def _structure(program: Program) -> dict[str, Json]:
    return {
        "kind": program.kind.value,
        "opset_version": program.opset_version,
        "signature": program.signature.to_json(),
        "plan": program.plan.to_json(),
        "graph": [_encode_node(n) for n in program.graph.nodes],
    }


def program_to_json(program: Program) -> dict[str, Json]:
    """The JSON document of everything but the weights (see docs/archive-format.md, "program").

    Raises ArchiveError naming the node or metadata key that has no encoding."""
    doc = _structure(program)
    doc["metadata"] = encode_value(program.metadata, "metadata")
    doc["graph"] = doc.pop("graph")  # last, so the file reads header first
    return doc


def program_from_json(doc: Json, weights: dict[str, torch.Tensor]) -> Program:
    """Rebuild a Program from `program_to_json`'s document and its weights.

    Raises ArchiveError on unknown ops or malformed documents; does not check hashes or verify."""
    if not isinstance(doc, dict):
        raise _malformed("the program is not a JSON object")
    try:
        kind = ProgramKind(doc["kind"])
        signature = _decode_signature(doc["signature"])
        plan = Plan.from_json(doc.get("plan"))
        metadata = decode_value(doc.get("metadata", {}))
    except PortableError as exc:
        if isinstance(exc, ArchiveError):
            raise
        raise _malformed(exc.what) from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, dict):
        raise _malformed("metadata is not an object")
    gm = _decode_graph(doc.get("graph"))
    return Program(kind, gm, signature, dict(weights), plan, metadata)


def _decode_signature(data: Json) -> Signature:
    for spec in (*data["inputs"], *data["outputs"]):
        _decode_spec(spec)  # checks dtype names against the fixed table before from_json
    return Signature.from_json(data)


# --- hashing --------------------------------------------------------------------------------


def _canonical(obj: Json) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _plan_canonical(plan: Plan) -> Json:
    # Mesh axis order and spec order matter, so they are lists here, not (sorted) objects.
    return {
        "mesh": [[n, s] for n, s in plan.mesh.axes] if plan.mesh else None,
        "specs": [[name, spec.to_json()] for name, spec in plan.specs],
        "rules": [[r.pattern, r.spec.to_json()] for r in plan.rules],
    }


def _structure_bytes(kind: str, opset: str, signature: Json, plan: Plan, graph: Json) -> bytes:
    nodes = [{k: v for k, v in n.items() if k != "source"} for n in graph]
    return _canonical(
        {
            "kind": kind,
            "opset_version": opset,
            "signature": signature,
            "plan": _plan_canonical(plan),
            "graph": nodes,
        }
    )


def _digest(structure: bytes, weights: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256(structure)
    for key in sorted(weights):
        t = weights[key].detach().cpu().contiguous()
        h.update(
            b"\n" + _canonical([key, str(t.dtype).removeprefix("torch."), list(t.shape)]) + b"\n"
        )
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def structure_bytes(program: Program) -> bytes:
    """Canonical bytes of what the hash covers besides the weights."""
    s = _structure(program)
    return _structure_bytes(s["kind"], s["opset_version"], s["signature"], program.plan, s["graph"])


def doc_structure_bytes(doc: Json) -> bytes:
    """`structure_bytes` computed from a JSON document, without building the graph."""
    try:
        plan = Plan.from_json(doc.get("plan"))
        return _structure_bytes(
            doc["kind"], doc["opset_version"], doc["signature"], plan, doc["graph"]
        )
    except PortableError as exc:
        raise _malformed(exc.what) from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed(f"{type(exc).__name__}: {exc}") from exc


def program_hash(program: Program) -> str:
    """sha256 (hex) of the program's structure and weights; see the module docstring."""
    return _digest(structure_bytes(program), program.weights)


def doc_hash(doc: Json, weights: Mapping[str, torch.Tensor]) -> str:
    """`program_hash` of the program `doc` describes, computed before rebuilding it."""
    return _digest(doc_structure_bytes(doc), weights)
