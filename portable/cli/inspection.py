"""`portable inspect ARCHIVE_OR_SPEC`: what a program contains.

Sections: program (name, kind, opset version, content hash, passes applied), op histogram,
state tensors (parameters, buffers, optimizer state) with totals, signature (inputs and outputs
with kinds and aliasing) and plan. `--text` adds the program's stable text form; `--json` prints
the same data as one JSON document.
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

from ..ir.program import Program, ProgramKind
from ..ir.signature import InputKind
from ..opset import op_name
from ..recipe import recipe_of
from .load_spec import resolve
from .table import format_bytes, format_table

__all__ = ["add_parser", "run", "summarize"]


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        parents=parents,
        help="show a program's ops, parameters, signature and plan",
        description="Show a program's op histogram, state tensors, signature (with aliasing), "
        "plan and metadata. ARCHIVE_OR_SPEC is an archive directory or a @portable SPEC.",
    )
    p.add_argument(
        "spec",
        metavar="ARCHIVE_OR_SPEC",
        help="an archive directory, file.py:Name or pkg.module:Name",
    )
    p.add_argument("--train", action="store_true", help="for a SPEC: capture the training step")
    p.add_argument("--text", action="store_true", help="also print the program's text form")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    program = resolve(args.spec).program(training=args.train)
    summary = summarize(program)
    if args.json:
        if args.text:
            summary["text"] = program.text()
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
        if args.text:
            print("\n" + program.text(), end="")
    return 0


def summarize(program: Program) -> dict[str, Any]:
    """Everything `inspect` shows, as JSON-ready data."""
    ops = collections.Counter(
        op_name(n.target) for n in program.graph.nodes if n.op == "call_function"
    )
    state = []
    values = program.state()  # placeholder name -> tensor
    for spec in program.signature.state_inputs:
        tensor = values[spec.name]
        state.append(
            {
                "name": spec.target or spec.name,
                "kind": spec.kind.value,
                "shape": list(spec.spec.shape),
                "dtype": str(spec.spec.dtype).removeprefix("torch."),
                "count": tensor.numel(),
                "bytes": tensor.numel() * tensor.element_size(),
            }
        )
    params = [s for s in state if s["kind"] == InputKind.PARAMETER.value]
    return {
        "program": {
            "name": program.name,
            "kind": program.kind.value,
            "opset_version": program.opset_version,
            "content_hash": program.content_hash,
            "passes": list(program.metadata.get("passes", [])),
            "tied_weights": dict(program.metadata.get("tied_weights", {})),  # dropped -> kept
        },
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "state": state,
        "totals": {
            "ops": sum(ops.values()),
            "parameters": sum(s["count"] for s in params),
            "parameter_bytes": sum(s["bytes"] for s in params),
            "state_bytes": sum(s["bytes"] for s in state),
        },
        "signature": program.signature.to_json(),
        "plan": _plan(program),
        "recipe": _recipe(program),
    }


def _recipe(program: Program) -> dict[str, Any] | None:
    """A training step's optimizer and recipe (None for inference programs)."""
    if program.kind is not ProgramKind.TRAINING_STEP:
        return None
    optimizer = dict(program.metadata.get("optimizer") or {})
    return {
        "optimizer": optimizer,
        "lines": recipe_of(program.metadata).describe(),
        **recipe_of(program.metadata).to_dict(),
    }


def _plan(program: Program) -> dict[str, Any]:
    plan = program.plan
    return {"single_device": plan.is_single_device, **plan.to_json()}


def _recipe_lines(recipe: dict[str, Any] | None) -> list[str]:
    if recipe is None:
        return []
    opt = recipe["optimizer"]
    hyper = ", ".join(f"{k}={v}" for k, v in opt.items() if k not in ("kind", "groups"))
    lines = ["", "training recipe:", f"  optimizer: {opt.get('kind', '?')} ({hyper})"]
    for group in opt.get("groups") or []:
        which = group.get("pattern") or ", ".join(group.get("names") or [])
        fields = {k: v for k, v in group.items() if k not in ("pattern", "names") and v is not None}
        lines.append(f"    group {which}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    return lines + [f"  {line}" for line in recipe["lines"]]


def format_summary(s: dict[str, Any]) -> str:
    """The text form of `summarize`'s result."""
    p, t = s["program"], s["totals"]
    out = [
        f"program {p['name']} ({p['kind']}, opset {p['opset_version']})",
        f"  content hash: {p['content_hash']}",
        f"  passes applied: {', '.join(p['passes']) or '(none)'}",
        f"  tied weights: {', '.join(f'{a} = {b}' for a, b in p['tied_weights'].items()) or '(none)'}",
        "",
        f"ops ({t['ops']} nodes, {len(s['ops'])} distinct):",
        format_table(["op", "count"], list(s["ops"].items()), indent="  "),
        "",
        f"state ({t['parameters']:,} parameters, {format_bytes(t['parameter_bytes'])}; "
        f"all state {format_bytes(t['state_bytes'])}):",
        format_table(
            ["name", "kind", "shape", "dtype", "count"],
            [
                (r["name"], r["kind"], _shape(r["shape"]), r["dtype"], f"{r['count']:,}")
                for r in s["state"]
            ],
            indent="  ",
        ),
        *_recipe_lines(s.get("recipe")),
        "",
        "inputs:",
        format_table(
            ["name", "kind", "target", "spec"],
            [(i["name"], i["kind"], i["target"] or "", _spec(i)) for i in s["signature"]["inputs"]],
            indent="  ",
        ),
        "outputs:",
        format_table(
            ["name", "kind", "target", "spec", "aliases"],
            [
                (o["name"], o["kind"], o["target"] or "", _spec(o), o["aliases"] or "")
                for o in s["signature"]["outputs"]
            ],
            indent="  ",
        ),
        "",
        "plan: " + _plan_text(s["plan"]),
    ]
    return "\n".join(out)


def _shape(shape: list[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _spec(d: dict[str, Any]) -> str:
    return f"{d['dtype']}{_shape(d['shape'])}"


def _plan_text(plan: dict[str, Any]) -> str:
    if plan["mesh"] is None:
        return "single device"
    lines = ["mesh " + " x ".join(f"{axis}={size}" for axis, size in plan["mesh"].items())]
    lines += [f"  {name}: {_partition(spec)}" for name, spec in plan["specs"].items()]
    lines += [f"  /{r['pattern']}/: {_partition(r['spec'])}" for r in plan["rules"]]
    return "\n".join(lines)


def _partition(dims: list[list[str] | None]) -> str:
    """`(dp, *)`: the mesh axes sharding each tensor dim, `*` for replicated."""
    return "(" + ", ".join("*" if d is None else "+".join(d) for d in dims) + ")"
