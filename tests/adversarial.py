"""Hostile archives: every field of program.json (and the files around it) mutated the way an
attacker would, with the content hash recomputed (anyone can: it is unkeyed), then loaded,
compiled and run. Shared by tests/test_archive_adversarial.py and benchmarks/reliability.py.

An outcome is one of:
- "typed": a PortableError (the archive was refused, or the program refused to run);
- "ran": it loaded and ran (the mutation was harmless, e.g. a new program name);
- "crash": any other exception (a bug: the loader let something through it should have checked);
- "code": the canary file exists afterwards (code from the archive was executed).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

import portable
from portable.ir.content_hash import doc_hash
from portable.ir.plan import ShardingRule

Json = Any
Path_ = tuple[Any, ...]  # a position in the JSON document: keys and list indices


class Rich(nn.Module):
    """A small model whose archive uses every kind of field: kwargs (gelu approximate, creation
    dtype/layout/device), a portable op (layer_norm), a buffer, a float constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.register_buffer("shift", torch.arange(8.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x), approximate="tanh") * 0.5
        h = self.ln(h) + self.shift
        return torch.softmax(h, dim=-1) + torch.zeros(8, dtype=torch.float32)


def rich_program() -> tuple[portable.Program, tuple[torch.Tensor, ...]]:
    """The model captured with a dynamic batch dim (symbolic_dims metadata) and a plan (mesh,
    specs, rules, batch axes), so every part of the format is present."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    plan = portable.Plan(
        portable.Mesh({"dp": 1}),
        specs=(("fc.weight", portable.PartitionSpec(None, None)),),
        rules=(ShardingRule(r"ln\..*", portable.PartitionSpec(None)),),
        batch_axes=("dp",),
    )
    program = portable.capture(
        Rich(), (x,), dynamic_shapes=({0: Dim("batch", min=1, max=16)},), plan=plan, name="rich"
    )
    return program, (x,)


@dataclasses.dataclass(frozen=True)
class Attack:
    field: str  # the schema path, e.g. "program.graph[*].kwargs{key}"
    position: Path_
    payload: str
    edit: Callable[[Json], None]


@dataclasses.dataclass(frozen=True)
class Outcome:
    attack: Attack
    kind: str  # typed | ran | crash | code
    detail: str


def code_payloads(canary: Path) -> dict[str, str]:
    """Strings that run `canary.touch()` if they reach Python source torch.fx generates."""
    call = f"__import__('pathlib').Path({str(canary)!r}).touch()"
    return {
        "kwarg-key": f"x={call},y",
        "statement": f"a\n    {call}\n",
        "expression": call,
        "quote-break": f"'; {call}; '",
        "comment-break": f"a # \n{call}\n#",
    }


def positions(doc: Json) -> Iterator[tuple[str, Path_, str]]:
    """Every position of the document: (schema path, position, "key" | "value"), for every
    dict key and every leaf; list indices collapse to [*] in the schema path."""
    stack: list[tuple[Json, Path_, str]] = [(doc, (), "")]
    while stack:
        value, pos, schema = stack.pop()
        if isinstance(value, dict):
            for key, child in value.items():
                yield f"{schema}{{key}}", (*pos, key), "key"
                stack.append((child, (*pos, key), f"{schema}.{key}" if schema else key))
        elif isinstance(value, list):
            for i, child in enumerate(value):
                stack.append((child, (*pos, i), f"{schema}[*]"))
        else:
            yield schema, pos, "value"


def _get(doc: Json, pos: Path_) -> Json:
    for step in pos:
        doc = doc[step]
    return doc


def _set_value(pos: Path_, new: Json) -> Callable[[Json], None]:
    def edit(doc: Json) -> None:
        _get(doc, pos[:-1])[pos[-1]] = new

    return edit


def _rename_key(pos: Path_, new: str) -> Callable[[Json], None]:
    def edit(doc: Json) -> None:
        parent = _get(doc, pos[:-1])
        items = [(new if k == pos[-1] else k, v) for k, v in parent.items()]
        parent.clear()
        parent.update(items)

    return edit


def attacks(doc: Json, canary: Path, *, per_field: int = 1) -> list[Attack]:
    """Code payloads in every string and key of `doc` (the whole header, `per_field` positions
    of each schema path), plus type confusion and out-of-range numbers in every other leaf."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    payloads = code_payloads(canary)
    for schema, pos, what in positions(doc):
        count = seen.get((schema, what), 0)
        if count >= per_field:
            continue
        seen[(schema, what)] = count + 1
        if what == "key":
            for name, text in payloads.items():
                out.append(Attack(schema, pos, name, _rename_key(pos, text)))
            out.append(Attack(schema, pos, "trailing-newline", _rename_key(pos, f"{pos[-1]}\n")))
            continue
        value = _get(doc, pos)
        if isinstance(value, str):
            for name, text in payloads.items():
                out.append(Attack(schema, pos, name, _set_value(pos, text)))
            out.append(Attack(schema, pos, "trailing-newline", _set_value(pos, value + "\n")))
            out.append(Attack(schema, pos, "control-chars", _set_value(pos, value + "\x1b[2J")))
        for name, new in _confusions(value):
            out.append(Attack(schema, pos, name, _set_value(pos, new)))
    return out


def _confusions(value: Json) -> list[tuple[str, Json]]:
    """Wrong types and out-of-range numbers for a leaf."""
    out: list[tuple[str, Json]] = [("null", None), ("list", [value]), ("object", {"node": value})]
    if isinstance(value, bool) or not isinstance(value, int):
        out.append(("int", 7))
    else:
        out += [("negative", -1), ("huge", 10**30), ("bool", True), ("string", str(value))]
    return out


def write_attack(source: Path, dest: Path, attack: Attack, weights: dict) -> None:
    """Copy the archive at `source` to `dest` with `attack` applied to program.json and the
    content hash recomputed the way an attacker would."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    doc = json.loads((source / "program.json").read_text())
    attack.edit(doc)
    forge_hash(doc, weights)
    (dest / "program.json").write_text(json.dumps(doc))


def forge_hash(doc: Json, weights: dict) -> None:
    """Recompute the content hash of a (mutated) document, as anyone can."""
    try:
        version = 1 if doc.get("format_version") == 1 else 2
        doc["content_hash"] = doc_hash(doc["program"], weights, version)
    except Exception:  # the mutation broke what the hash reads: the loader must refuse it anyway
        pass


def run_archive(path: Path, inputs: tuple[torch.Tensor, ...]) -> None:
    """What a user does with an archive they were sent: load, compile on cpu, call."""
    program = portable.load(path)
    portable.compile(program, backend="cpu")(*inputs)


def outcome(attack: Attack, run: Callable[[], None], canary: Path) -> Outcome:
    try:
        run()
        kind, detail = "ran", ""
    except portable.PortableError as exc:
        kind, detail = "typed", type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - counting exactly these is the point
        kind, detail = "crash", f"{type(exc).__name__}: {str(exc)[:200]}"
    if canary.exists():
        canary.unlink()
        kind, detail = "code", "the payload ran"
    return Outcome(attack, kind, detail)


def attack_all(
    archive: Path, inputs: tuple[torch.Tensor, ...], workdir: Path, *, per_field: int = 1
) -> list[Outcome]:
    """Every attack on `archive`, each loaded, compiled and run."""
    canary = workdir / "CANARY"
    doc = json.loads((archive / "program.json").read_text())
    weights = safetensors.torch.load_file(archive / "weights.safetensors")
    results = []
    for attack in attacks(copy.deepcopy(doc), canary, per_field=per_field):
        dest = workdir / "attacked.portable"
        write_attack(archive, dest, attack, weights)
        results.append(outcome(attack, lambda d=dest: run_archive(d, inputs), canary))
    return results
