"""Archives and plans from elsewhere: forged, bombs, links, special files (issue 13, items 1-3).

The full field-by-field sweep (every string, key and leaf of program.json) is
`tests/adversarial.py`; `sweep()` turns each of its attacks into a scenario (the long form).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch

import portable

from .base import OK, Scenario, cli_outcome, crash, refused

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
import adversarial  # noqa: E402

_cache: dict[str, tuple] = {}


def rich() -> tuple[portable.Program, tuple[torch.Tensor, ...], Path]:
    """The adversarial suite's model, captured once, saved under a private temp dir."""
    if "rich" not in _cache:
        import tempfile

        program, inputs = adversarial.rich_program()
        root = Path(tempfile.mkdtemp(prefix="reliability-rich-"))
        _cache["rich"] = (program, inputs, program.save(root / "rich.portable"))
    return _cache["rich"]


def _forged(tmp: Path, edit: Callable[[dict], None], *, forge: bool = True) -> Path:
    """A copy of the rich archive with `edit` applied and the hash recomputed."""
    _, _, source = rich()
    dest = tmp / "forged.portable"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    doc = json.loads((dest / "program.json").read_text())
    edit(doc)
    if forge:
        adversarial.forge_hash(doc, safetensors.torch.load_file(dest / "weights.safetensors"))
    (dest / "program.json").write_text(json.dumps(doc))
    return dest


def _load_and_run(path: Path) -> None:
    adversarial.run_archive(path, rich()[1])


def _node(doc: dict, op: str) -> dict:
    return next(n for n in doc["program"]["graph"] if n["op"] == op)


def _payload(tmp: Path) -> str:
    return f"__import__('pathlib').Path({str(tmp / 'CANARY')!r}).touch()"


def kwargs_key_injection(tmp: Path) -> str:
    def edit(doc):
        _node(doc, "aten.gelu.default")["kwargs"][f"x={_payload(tmp)},y"] = 1
        dims = doc["program"]["metadata"]["symbolic_dims"]
        dims["zz"] = {"min": 1, "max": 2, "source": "x"}  # used to switch shape checks off

    return refused(lambda: _load_and_run(_forged(tmp, edit)))


def kwargs_key_injection_cli(tmp: Path) -> str:
    def edit(doc):
        _node(doc, "aten.gelu.default")["kwargs"][f"x={_payload(tmp)},y"] = 1

    path = _forged(tmp, edit)
    return cli_outcome(["lower", str(path), "-t", "cpu", "--parity", "--out", str(tmp / "o")])


def node_name_injection(tmp: Path) -> str:
    edit = lambda doc: _node(doc, "aten.gelu.default").update(name=f"a\n    {_payload(tmp)}\n")  # noqa: E731
    return refused(lambda: _load_and_run(_forged(tmp, edit)))


def trailing_newline_name(tmp: Path) -> str:
    edit = lambda doc: _node(doc, "aten.gelu.default").update(name="gelu\n")  # noqa: E731
    return refused(lambda: _load_and_run(_forged(tmp, edit)), "plain identifier")


def placeholder_named_self(tmp: Path) -> str:
    def edit(doc):
        program = doc["program"]
        old = program["signature"]["inputs"][-1]["name"]
        text = json.dumps(program).replace(f'"{old}"', '"self"')
        doc["program"] = json.loads(text)

    return refused(lambda: _load_and_run(_forged(tmp, edit)), "reserved")


def wrong_shape_with_symbolic_dims(tmp: Path) -> str:
    edit = lambda doc: _node(doc, "aten.gelu.default")["tensor"]["shape"].__setitem__(-1, 9)  # noqa: E731
    return refused(lambda: _load_and_run(_forged(tmp, edit)), "shape rule gives")


def metadata_changed_without_rehash(tmp: Path) -> str:
    edit = lambda doc: doc["program"]["metadata"].update(name="other")  # noqa: E731
    return refused(lambda: _load_and_run(_forged(tmp, edit, forge=False)), "hash mismatch")


def downgrade_with_pinned_hash(tmp: Path) -> str:
    program = rich()[0]

    def edit(doc):
        doc["format_version"] = 1
        doc["program"]["metadata"]["name"] = "swapped"

    path = _forged(tmp, edit)
    return refused(lambda: portable.load(path, expected_hash=program.content_hash), "expected")


def _huge_input(doc: dict, batch: int) -> None:
    program = doc["program"]
    symbol = next(iter(program["metadata"]["symbolic_dims"]))
    program["metadata"]["symbolic_dims"] = {}
    doc["program"] = json.loads(json.dumps(program).replace(f'"{symbol}"', str(batch)))


def huge_input_parity(tmp: Path) -> str:
    path = _forged(tmp, lambda doc: _huge_input(doc, 10**9))
    argv = ["lower", str(path), "-t", "cpu", "--parity", "--out", str(tmp / "o")]
    return cli_outcome(argv, must_say="over the limit")


def huge_intermediate_compile(tmp: Path) -> str:
    path = _forged(tmp, lambda doc: _huge_input(doc, 10**9))
    return refused(lambda: portable.compile(portable.load(path), backend="cpu"), "would allocate")


def _deep(tmp: Path, where: str) -> Path:
    def edit(doc):
        if where == "metadata":
            doc["program"]["metadata"]["deep"] = "DEEP"
        else:
            _node(doc, "aten.gelu.default")["args"].append("DEEP")

    path = _forged(tmp, edit)
    text = (path / "program.json").read_text()
    deep = "[" * 100_001 + "1" + "]" * 100_001
    (path / "program.json").write_text(text.replace('"DEEP"', deep))
    return path


def deep_metadata(tmp: Path) -> str:
    return refused(lambda: _load_and_run(_deep(tmp, "metadata")), "deep")


def deep_argument(tmp: Path) -> str:
    return refused(lambda: _load_and_run(_deep(tmp, "graph")), "deep")


def size_arithmetic_bomb(tmp: Path) -> str:
    def edit(doc):
        nodes = [
            {"name": "b0", "op": "sym.mul", "args": [2**31, 2**31], "kwargs": {}, "tensor": None},
            {
                "name": "b1",
                "op": "sym.mul",
                "args": [{"node": "b0"}, {"node": "b0"}],
                "kwargs": {},
                "tensor": None,
            },
        ]
        doc["program"]["graph"][-1:-1] = nodes

    return refused(lambda: _load_and_run(_forged(tmp, edit)), "beyond 2")


def _linked(tmp: Path, entry: str) -> Path:
    path = _forged(tmp, lambda doc: None)
    secret = tmp / "secret.bin"
    secret.write_bytes(b"s" * 12345)
    (path / entry).unlink()
    (path / entry).symlink_to(secret)
    return path


def link_out_program(tmp: Path) -> str:
    return _no_disclosure(lambda: _load_and_run(_linked(tmp, "program.json")))


def link_out_weights(tmp: Path) -> str:
    return _no_disclosure(lambda: _load_and_run(_linked(tmp, "weights.safetensors")))


def _no_disclosure(fn: Callable[[], None]) -> str:
    try:
        fn()
    except portable.PortableError as exc:
        if "12345" in str(exc) or "secret" in str(exc):
            return crash("the message discloses the link's target")
        return f"typed:{type(exc).__name__}"
    return OK


def fifo_program(tmp: Path) -> str:
    path = _forged(tmp, lambda doc: None)
    (path / "program.json").unlink()
    os.mkfifo(path / "program.json")
    return refused(lambda: _load_and_run(path), "not a regular file")


def truncated_weights(tmp: Path) -> str:
    path = _forged(tmp, lambda doc: None)
    data = (path / "weights.safetensors").read_bytes()
    (path / "weights.safetensors").write_bytes(data[: len(data) // 2])
    return refused(lambda: _load_and_run(path), "truncated")


def newer_format(tmp: Path) -> str:
    edit = lambda doc: doc.update(format_version=99)  # noqa: E731
    return refused(lambda: _load_and_run(_forged(tmp, edit)), "upgrade portable")


def unknown_op(tmp: Path) -> str:
    edit = lambda doc: _node(doc, "aten.gelu.default").update(op="aten.frobnicate.default")  # noqa: E731
    return refused(lambda: _load_and_run(_forged(tmp, edit)), "not in this portable's opset")


def catastrophic_rule_in_archive(tmp: Path) -> str:
    """A plan rule `(a*)*b` (exponential in Python's re) against a long name: must not hang."""

    def edit(doc):
        doc["program"]["plan"]["rules"].append({"pattern": "(a*)*b", "spec": [None]})

    path = _forged(tmp, edit)
    program = portable.load(path)
    return OK if not program.plan.spec_for("a" * 5000 + "c") else crash("rule matched")


def _lower_with_plan(tmp: Path, text: str, must_say: str) -> str:
    (tmp / "plan.json").write_text(text)
    spec = f"{REPO / 'examples' / 'mlp.py'}:MLP"
    argv = ["lower", spec, "-t", "cpu", "--plan", str(tmp / "plan.json"), "--out", str(tmp / "o")]
    return cli_outcome(argv, must_say=must_say)


def plan_json_redos(tmp: Path) -> str:
    plan = {"mesh": {"dp": 1}, "rules": [{"pattern": "(a*)*(a*)*$x", "spec": [None]}]}
    return _lower_with_plan(tmp, json.dumps(plan), "matches no tensor")


def plan_json_deep(tmp: Path) -> str:
    return _lower_with_plan(tmp, "[" * 100_000 + "]" * 100_000, "deep")


def plan_json_malformed(tmp: Path) -> str:
    plan = {"mesh": {"dp": True}, "batch_axes": [None]}
    return _lower_with_plan(tmp, json.dumps(plan), "plan")


def save_over_archive_fails_midway(tmp: Path) -> str:
    """An exception while a new archive is written must leave the old one loadable."""
    program = rich()[0]
    path = program.save(tmp / "keep.portable")
    before = (path / "program.json").read_bytes()
    original = safetensors.torch.save_file

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    safetensors.torch.save_file = broken
    try:
        program.save(path)
    except KeyboardInterrupt:
        pass
    finally:
        safetensors.torch.save_file = original
    if (path / "program.json").read_bytes() != before:
        return "lost:the archive changed"
    leftovers = [p.name for p in tmp.iterdir() if p.name.startswith(".keep.portable.")]
    if leftovers:
        return f"lost:temp dirs left: {leftovers}"
    portable.load(path)
    return OK


SCENARIOS = [
    Scenario(
        "kwargs key injection + symbolic_dims (load, compile, run)", "archive", kwargs_key_injection
    ),
    Scenario("kwargs key injection (portable lower --parity)", "archive", kwargs_key_injection_cli),
    Scenario("node name with a statement", "archive", node_name_injection),
    Scenario("node name with a trailing newline", "archive", trailing_newline_name),
    Scenario("placeholder named self", "archive", placeholder_named_self),
    Scenario(
        "wrong recorded shape, dynamic dims declared", "archive", wrong_shape_with_symbolic_dims
    ),
    Scenario("metadata edited without rehash", "archive", metadata_changed_without_rehash),
    Scenario("format-1 downgrade against a pinned hash", "archive", downgrade_with_pinned_hash),
    Scenario("user input [1e9, 6] with --parity", "archive", huge_input_parity),
    Scenario("huge intermediates at compile", "archive", huge_intermediate_compile),
    Scenario("100,001-deep metadata", "archive", deep_metadata),
    Scenario("100,001-deep node argument", "archive", deep_argument),
    Scenario("sym.mul squaring chain", "archive", size_arithmetic_bomb),
    Scenario("program.json links out", "archive", link_out_program),
    Scenario("weights.safetensors links out", "archive", link_out_weights),
    Scenario("program.json is a FIFO", "archive", fifo_program, timeout=30),
    Scenario("truncated weights", "archive", truncated_weights),
    Scenario("newer format version", "archive", newer_format),
    Scenario("unknown op", "archive", unknown_op),
    Scenario(
        "(a*)*b rule in an archive's plan",
        "archive",
        catastrophic_rule_in_archive,
        expect="works",
        timeout=30,
    ),
    Scenario("(a*)*(a*)*$x rule in plan.json", "archive", plan_json_redos, timeout=60),
    Scenario("100,000-deep plan.json", "archive", plan_json_deep),
    Scenario("malformed plan.json", "archive", plan_json_malformed),
    Scenario(
        "save over an archive, interrupted",
        "archive",
        save_over_archive_fails_midway,
        expect="works",
    ),
]


def sweep(workdir: Path) -> list[Scenario]:
    """Every attack of tests/adversarial.py as its own scenario (the long form); payloads
    touch `workdir/CANARY` if they run."""
    _, inputs, path = rich()
    canary = workdir / "CANARY"
    doc = json.loads((path / "program.json").read_text())
    weights = safetensors.torch.load_file(path / "weights.safetensors")
    out = []
    for attack in adversarial.attacks(doc, canary):

        def run(tmp: Path, attack=attack) -> str:
            dest = tmp / "attacked.portable"
            adversarial.write_attack(path, dest, attack, weights)
            result = refused(lambda: adversarial.run_archive(dest, inputs))
            if canary.exists():
                canary.unlink()
                return "code"
            return result

        name = f"sweep {attack.field} <- {attack.payload}"
        out.append(Scenario(name, "archive", run, expect="either", quick=False, timeout=60))
    return out
