"""Hostile archives (issue 13, items 1-3): no field of the format can make loading, compiling or
running execute code, allocate without bound, hang, or follow a link out of the archive; every
refusal is a typed PortableError. The attacker recomputes the content hash (it is unkeyed).

The field-by-field suite is in tests/adversarial.py (shared with benchmarks/reliability.py)."""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

import portable
from portable import ArchiveError, PlanError, ResourceLimitError, VerifyError
from portable.cli.app import main
from portable.ir.content_hash import doc_hash
from portable.ir.plan import ShardingRule
from portable.ir.safe_regex import compile_pattern

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adversarial  # noqa: E402

SLOW = os.environ.get("PORTABLE_SLOW") == "full"


@pytest.fixture(scope="module")
def rich(tmp_path_factory):
    program, inputs = adversarial.rich_program()
    path = program.save(tmp_path_factory.mktemp("rich") / "rich.portable")
    return program, inputs, path


def _edit(path: Path, edit, *, forge: bool = True) -> None:
    doc = json.loads((path / "program.json").read_text())
    edit(doc)
    if forge:
        adversarial.forge_hash(doc, safetensors.torch.load_file(path / "weights.safetensors"))
    (path / "program.json").write_text(json.dumps(doc))


def _copy(rich, tmp_path: Path) -> Path:
    dest = tmp_path / "copy.portable"
    shutil.copytree(rich[2], dest)
    return dest


def _node(doc, op: str) -> dict:
    return next(n for n in doc["program"]["graph"] if n["op"] == op)


# --- code execution -------------------------------------------------------------------------


def test_every_field_of_the_format_is_refused_or_harmless(rich, tmp_path):
    """Code payloads, trailing newlines and control characters in every string and key of
    program.json, and wrong types / out-of-range numbers in every leaf: each attacked archive
    is loaded, compiled on cpu and called. Nothing runs the payload; nothing fails untyped."""
    _, inputs, path = rich
    results = adversarial.attack_all(path, inputs, tmp_path, per_field=3 if SLOW else 1)
    kinds = collections.Counter(r.kind for r in results)
    bad = [f"{r.kind}: {r.attack.field} <- {r.attack.payload}: {r.detail}" for r in results]
    bad = [b for b, r in zip(bad, results, strict=True) if r.kind in ("code", "crash")]
    assert not bad, "\n".join(bad)
    fields = {r.attack.field for r in results}
    assert len(results) > 400 and kinds["typed"] > 300, kinds
    for field in (
        "program.graph[*].name",
        "program.graph[*].kwargs{key}",
        "program.graph[*].op",
        "program.signature.inputs[*].name",
        "program.metadata.symbolic_dims{key}",
        "program.plan.rules[*].pattern",
        "program.graph[*].source.code",
        "format_version",
    ):
        assert field in fields, field


def test_kwargs_key_injection_is_refused_with_metadata_that_used_to_skip_checks(rich, tmp_path):
    """The reported exploit: a kwargs key pasted into fx's generated source, plus non-empty
    symbolic_dims (which used to switch the shape-rule check off), with a recomputed hash."""
    canary = tmp_path / "CANARY"
    path = _copy(rich, tmp_path)

    def edit(doc):
        key = f"x=__import__('pathlib').Path({str(canary)!r}).touch(),y"
        _node(doc, "aten.gelu.default")["kwargs"][key] = 1
        doc["program"]["metadata"]["symbolic_dims"]["zz"] = {"min": 1, "max": 2, "source": "x"}

    _edit(path, edit)
    with pytest.raises(ArchiveError, match="keyword argument .* which its schema does not name"):
        portable.load(path)
    out = tmp_path / "out"
    assert main(["lower", str(path), "-t", "cpu", "--parity", "--out", str(out)]) == 3
    assert not canary.exists() and not out.exists()


@pytest.mark.parametrize(
    "name, why",
    [
        ("addmm\n", "not a plain identifier"),  # `^...$` let this through
        ("a b", "not a plain identifier"),
        ("lambda", "keyword"),
        ("self", "reserved"),
        ("torch", "reserved"),
        ("x" * 300, "characters long"),
    ],
)
def test_node_names_are_checked_as_whole_strings(rich, tmp_path, name, why):
    path = _copy(rich, tmp_path)
    _edit(path, lambda doc: _node(doc, "aten.gelu.default").update(name=name))
    with pytest.raises(ArchiveError, match=why):
        portable.load(path)


def test_placeholder_named_self_cannot_break_the_generated_signature(rich, tmp_path):
    path = _copy(rich, tmp_path)

    def edit(doc):
        x = doc["program"]["signature"]["inputs"][-1]
        old, x["name"] = x["name"], "self"
        for node in doc["program"]["graph"]:
            if node["name"] == old:
                node["name"] = "self"
        text = json.dumps(doc["program"]["graph"]).replace(
            f'{{"node": "{old}"}}', '{"node": "self"}'
        )
        doc["program"]["graph"] = json.loads(text)

    _edit(path, edit)
    with pytest.raises(ArchiveError, match="reserved"):
        portable.load(path)


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda n: n.update(args=n["args"] + [1, 2, 3]), "positional arguments"),
        (lambda n: n.update(kwargs={"approximate": "tanh", "self": 1}), "twice"),
        (lambda n: n.update(args=[]), "lacks its required argument self"),
        (lambda n: n.update(extra=1), "bad node"),
    ],
)
def test_arguments_must_fit_the_op_schema(rich, tmp_path, edit, why):
    path = _copy(rich, tmp_path)
    _edit(path, lambda doc: edit(_node(doc, "aten.gelu.default")))
    with pytest.raises(ArchiveError, match=why):
        portable.load(path)


def test_placeholders_output_and_getitem_keep_their_shape(rich, tmp_path):
    cases = [
        (lambda doc: doc["program"]["graph"][0].update(args=[1]), "placeholder .* arguments"),
        (lambda doc: doc["program"]["graph"][-1].update(kwargs={"a": 1}), "one tuple of results"),
        (lambda doc: doc["program"]["graph"][-1].update(args=[{"tuple": [1]}]), "other than graph"),
    ]
    for edit, why in cases:
        path = _copy(rich, tmp_path)
        _edit(path, edit)
        with pytest.raises(ArchiveError, match=why):
            portable.load(path)
        shutil.rmtree(path)


def test_devices_and_pinned_memory_are_refused(rich, tmp_path):
    path = _copy(rich, tmp_path)

    def edit(doc):
        node = next(n for n in doc["program"]["graph"] if "device" in n["kwargs"])
        node["kwargs"]["device"] = {"device": "cuda:0"}

    _edit(path, edit)
    with pytest.raises(ArchiveError, match="device 'cuda:0'"):
        portable.load(path)


# --- metadata can never switch a check off; the hash covers what runs -------------------------


def test_symbolic_dims_do_not_switch_off_the_shape_rules(rich, tmp_path):
    """A node recording a wrong shape is caught with dynamic dims declared, too."""
    path = _copy(rich, tmp_path)

    def edit(doc):
        node = _node(doc, "aten.gelu.default")
        node["tensor"]["shape"][-1] = 9

    _edit(path, edit)
    with pytest.raises(VerifyError, match="shape rule gives"):
        portable.load(path)


def test_a_wrong_symbolic_expression_is_caught(rich, tmp_path):
    program = rich[0]
    symbol = next(iter(program.metadata["symbolic_dims"]))
    path = _copy(rich, tmp_path)

    def edit(doc):
        node = _node(doc, "aten.gelu.default")
        assert node["tensor"]["shape"][0] == symbol
        node["tensor"]["shape"][0] = f"2*{symbol}"

    _edit(path, edit)
    with pytest.raises(VerifyError, match=rf"2\*{symbol}"):
        portable.load(path)


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: p["metadata"]["symbolic_dims"][next(iter(p["metadata"]["symbolic_dims"]))].update(
            max=4096
        ),
        lambda p: p["metadata"].update(name="other"),
        lambda p: p["plan"].update(batch_axes=[]),
    ],
    ids=["symbolic-range", "name", "plan-batch-axes"],
)
def test_the_content_hash_covers_metadata_and_the_whole_plan(rich, tmp_path, edit):
    path = _copy(rich, tmp_path)
    _edit(path, lambda doc: edit(doc["program"]), forge=False)
    with pytest.raises(ArchiveError, match="content hash mismatch"):
        portable.load(path)


def test_expected_hash_pins_the_program_and_defeats_a_format_downgrade(rich, tmp_path):
    program, _, source = rich
    assert portable.load(source, expected_hash=program.content_hash).content_hash == (
        program.content_hash
    )
    path = _copy(rich, tmp_path)

    def downgrade(doc):  # format 1 did not hash metadata: change it and claim format 1
        doc["format_version"] = 1
        doc["program"]["metadata"]["symbolic_dims"][next(iter(program.metadata["symbolic_dims"]))][
            "max"
        ] = 4096

    _edit(path, downgrade)
    portable.load(path)  # without a pin, a consistent forgery loads (the hash is no signature)
    with pytest.raises(ArchiveError, match="not the expected"):
        portable.load(path, expected_hash=program.content_hash)


# --- resource bombs -------------------------------------------------------------------------


def _declare_huge_input(doc, batch: int) -> None:
    """Give the user input a static batch of `batch` rows, consistently in every spec."""
    program = doc["program"]
    symbol = next(iter(program["metadata"]["symbolic_dims"]))
    program["metadata"]["symbolic_dims"] = {}
    text = json.dumps(program).replace(f'"{symbol}"', str(batch))
    doc["program"] = json.loads(text)


def test_parity_refuses_a_huge_declared_input_before_allocating(rich, tmp_path, capsys):
    path = _copy(rich, tmp_path)
    _edit(path, lambda doc: _declare_huge_input(doc, 10**9))
    portable.load(path)  # shapes are checked with fake tensors: loading allocates nothing
    code = main(["lower", str(path), "-t", "cpu", "--parity", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "would allocate 22.4 GiB" in err and "over the limit of 4.0 GiB" in err
    assert "--max-alloc" in err


def test_a_program_whose_intermediates_are_huge_is_refused_at_compile(rich, tmp_path):
    path = _copy(rich, tmp_path)
    _edit(path, lambda doc: _declare_huge_input(doc, 10**9))
    program = portable.load(path)
    with pytest.raises(ResourceLimitError, match=r"node .* would allocate"):
        portable.compile(program, backend="cpu")
    with portable.limits.override(max_tensor_bytes=1 << 40):
        portable.compile(program, backend="cpu")  # the limit is configurable


def test_dynamic_sizes_are_checked_per_call(rich):
    program = rich[0]
    run = portable.compile(program, backend="cpu")
    with portable.limits.override(max_tensor_bytes=8 * 8 * 4):
        run(torch.randn(8, 6))
        with pytest.raises(ResourceLimitError, match="would allocate"):
            run(torch.randn(16, 6))


@pytest.mark.parametrize("where", ["metadata", "graph"])
def test_deep_json_nesting_is_a_typed_error(rich, tmp_path, where):
    """100,001 nested lists (json.loads would raise RecursionError) in metadata or an arg."""
    path = _copy(rich, tmp_path)
    doc = json.loads((path / "program.json").read_text())
    if where == "metadata":
        doc["program"]["metadata"]["deep"] = "DEEP"
    else:
        _node(doc, "aten.gelu.default")["args"].append("DEEP")
    deep = "[" * 100_001 + "1" + "]" * 100_001
    (path / "program.json").write_text(json.dumps(doc).replace('"DEEP"', deep))
    with pytest.raises(ArchiveError, match="nests arrays/objects more than 64 deep"):
        portable.load(path)


def test_program_json_size_is_bounded(rich, tmp_path):
    path = _copy(rich, tmp_path)
    with portable.limits.override(max_json_bytes=1000):
        with pytest.raises(ArchiveError, match="is over 1000 bytes"):
            portable.load(path)


def test_size_arithmetic_cannot_grow_without_bound(rich, tmp_path):
    """sym.mul chains square an integer at every node; sizes beyond 2**62 are refused."""
    path = _copy(rich, tmp_path)

    def edit(doc):
        graph = doc["program"]["graph"]
        nodes = [{"name": "big0", "op": "sym.mul", "args": [2**31, 2**31], "kwargs": {}}]
        nodes.append(
            {"name": "big1", "op": "sym.mul", "args": [{"node": "big0"}, {"node": "big0"}]}
        )
        for n in nodes:
            n.setdefault("kwargs", {})
            n["tensor"] = None
        graph[-1:-1] = nodes

    _edit(path, edit)
    with pytest.raises(VerifyError, match="big1 computes a size beyond 2"):
        portable.load(path)


# --- links and special files ----------------------------------------------------------------


@pytest.mark.parametrize("entry", ["program.json", "weights.safetensors"])
def test_links_out_of_the_archive_are_refused_without_disclosing_the_target(rich, tmp_path, entry):
    path = _copy(rich, tmp_path)
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"s" * 12345)
    (path / entry).unlink()
    (path / entry).symlink_to(outside)
    with pytest.raises(ArchiveError, match="link that leads out of the archive") as info:
        portable.load(path)
    assert "12345" not in str(info.value) and "secret" not in str(info.value)


def test_a_link_inside_the_archive_is_followed(rich, tmp_path):
    path = _copy(rich, tmp_path)
    os.rename(path / "weights.safetensors", path / "weights.real")
    (path / "weights.safetensors").symlink_to("weights.real")
    assert portable.load(path).content_hash == rich[0].content_hash


def test_a_fifo_is_refused_without_hanging(rich, tmp_path):
    path = _copy(rich, tmp_path)
    (path / "program.json").unlink()
    os.mkfifo(path / "program.json")
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture_error(errors, path), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "loading a FIFO hung"
    assert isinstance(errors[0], ArchiveError) and "not a regular file" in str(errors[0])


def _capture_error(errors: list, path: Path) -> None:
    try:
        portable.load(path)
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)


def test_weight_keys_with_control_characters_are_refused(rich, tmp_path):
    path = _copy(rich, tmp_path)
    weights = safetensors.torch.load_file(path / "weights.safetensors")
    weights["evil\x1b[2J"] = torch.zeros(1)
    safetensors.torch.save_file(weights, path / "weights.safetensors")
    data = (path / "weights.safetensors").read_bytes()

    def edit(doc):
        import hashlib

        doc["weights"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        doc["content_hash"] = doc_hash(doc["program"], weights)

    _edit(path, edit, forge=False)
    with pytest.raises(ArchiveError, match="weight key that contains control characters"):
        portable.load(path)


# --- plans: rules cannot hang -----------------------------------------------------------------


def test_a_catastrophic_rule_pattern_matches_in_linear_time():
    """`(a*)*b` takes exponential time in Python's re on 'aaa...c'; rules use an NFA."""
    rule = ShardingRule(r"(a*)*b", portable.PartitionSpec(None))
    assert rule.matches("a" * 5000 + "b") and not rule.matches("a" * 5000 + "c")


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=a)a", r"(?i)a", r"(?>a)", "[", "(" * 60])
def test_unsupported_rule_patterns_are_plan_errors(pattern):
    with pytest.raises(PlanError, match="sharding rule pattern"):
        compile_pattern(pattern)


def test_rule_patterns_mean_what_python_re_means():
    import random
    import re

    random.seed(0)
    atoms = ["a", "b", ".", "[ab]", "[^a]", r"\d", "x", "^", "$", r"\w"]

    def pattern(depth=0):
        c = random.random()
        if depth > 3 or c < 0.3:
            return random.choice(atoms)
        if c < 0.5:
            return f"({pattern(depth + 1)}|{pattern(depth + 1)})"
        if c < 0.7:
            return f"({pattern(depth + 1)})" + random.choice(
                ["*", "+", "?", "{1,2}", "*?", "{0,3}"]
            )
        return pattern(depth + 1) + pattern(depth + 1)

    for _ in range(500):
        p = pattern()
        compiled = compile_pattern(p)
        for _ in range(8):
            name = "".join(random.choice("ab.x_0") for _ in range(random.randint(0, 6)))
            assert compiled.fullmatch(name) == (re.fullmatch(p, name) is not None), (p, name)


@pytest.mark.parametrize(
    "plan, why",
    [
        ({"mesh": {"dp": True}}, "has size True"),
        ({"mesh": {"dp": 10**9}}, "has size"),
        ({"mesh": {"a": 1024, "b": 1024, "c": 2}}, "over 1048576"),
        ({"mesh": {"dp\n": 2}}, "not a plain identifier|is not an identifier"),
        ({"mesh": {"dp": 2}, "rules": [{"pattern": ["x"], "spec": [None]}]}, "pattern"),
        ({"mesh": {"dp": 2}, "batch_axes": [None]}, "batch_axes"),
        ({"mesh": {"dp": 2}, "specs": {"w": [[1]]}}, "partition spec"),
        ({"mesh": {"dp": 2}, "unknown": 1}, "fields"),
    ],
)
def test_malformed_plans_are_plan_errors(plan, why):
    with pytest.raises(PlanError, match=why):
        portable.Plan.from_json(plan)
