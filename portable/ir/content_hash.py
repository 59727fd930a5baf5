"""The content hash of a program: sha256 over its canonical structure and its weights.

Formula 2 (archives of format 2, `HASH_VERSION`) covers the kind, opset version, signature, the
whole plan (mesh, specs, rules, batch / FSDP / sequence axes), the graph without source locations
(debug info, read by no runtime), the metadata, and every weight (key, dtype, shape, bytes;
an abstract program's meta weight: key, dtype, shape and the words "no data").
Formula 1 (format-1 archives) left out the metadata and the plan's axes. docs/archive-format.md
says what a matching hash does and does not prove.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import PortableError
from .plan import Plan
from .program import Program
from .serialize import malformed, program_to_json

__all__ = ["HASH_VERSION", "doc_hash", "doc_structure_bytes", "program_hash", "structure_bytes"]

Json = Any


def _canonical(obj: Json) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


HASH_VERSION = 2  # the content-hash formula; format 1 archives were hashed by formula 1


def _plan_canonical(plan: Plan, version: int) -> Json:
    # Mesh axis order and spec order matter, so they are lists here, not (sorted) objects.
    out: dict[str, Json] = {
        "mesh": [[n, s] for n, s in plan.mesh.axes] if plan.mesh else None,
        "specs": [[name, spec.to_json()] for name, spec in plan.specs],
        "rules": [[r.pattern, r.spec.to_json()] for r in plan.rules],
    }
    if version >= 2:  # what spmd-partition reads besides the specs
        out["batch_axes"] = list(plan.batch_axes)
        out["fsdp_axis"] = plan.fsdp_axis
        out["sequence_parallel"] = plan.sequence_parallel
    return out


def _structure_bytes(parts: dict[str, Json], plan: Plan, version: int) -> bytes:
    """Canonical bytes of everything hashed besides the weights: formula 1 is kind, opset,
    signature, plan specs and graph; formula 2 adds the whole plan and the metadata. Source
    locations are never hashed (debug info, read by no runtime)."""
    body = {
        "kind": parts["kind"],
        "opset_version": parts["opset_version"],
        "signature": parts["signature"],
        "plan": _plan_canonical(plan, version),
        "graph": [{k: v for k, v in n.items() if k != "source"} for n in parts["graph"]],
    }
    if version >= 2:
        body["metadata"] = parts["metadata"]
    return _canonical(body)


def _digest(structure: bytes, weights: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256(structure)
    for key in sorted(weights):
        t = weights[key]
        h.update(
            b"\n" + _canonical([key, str(t.dtype).removeprefix("torch."), list(t.shape)]) + b"\n"
        )
        if t.is_meta:  # an abstract program's weight: its shape and dtype are all there is
            h.update(b"no data\n")
            continue
        t = t.detach().cpu().contiguous()
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def structure_bytes(program: Program) -> bytes:
    """Canonical bytes of what the hash covers besides the weights (formula HASH_VERSION)."""
    return _structure_bytes(program_to_json(program), program.plan, HASH_VERSION)


def doc_structure_bytes(doc: Json, version: int = HASH_VERSION) -> bytes:
    """`structure_bytes` computed from a JSON document, without building the graph."""
    if not isinstance(doc, dict):
        raise malformed("the program is not a JSON object")
    try:
        plan = Plan.from_json(doc.get("plan"))
        parts = {k: doc[k] for k in ("kind", "opset_version", "signature", "graph")}
        parts["metadata"] = doc.get("metadata", {})
        return _structure_bytes(parts, plan, version)
    except PortableError as exc:
        raise malformed(exc.what) from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise malformed(f"{type(exc).__name__}: {exc}") from exc


def program_hash(program: Program) -> str:
    """sha256 (hex) of the program's structure and weights; see the module docstring."""
    return _digest(structure_bytes(program), program.weights)


def doc_hash(doc: Json, weights: Mapping[str, torch.Tensor], version: int = HASH_VERSION) -> str:
    """`program_hash` of the program `doc` describes, computed before rebuilding it, by hash
    formula `version` (1 for format-1 archives)."""
    return _digest(doc_structure_bytes(doc, version), weights)
