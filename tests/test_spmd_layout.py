"""`SpmdLayout` (portable/ir/spmd.py): the per-rank contract as typed IR.

Its JSON is the "spmd" entry archives have always had in their metadata, so a per-rank archive
saved before the typed field loads, hashes and re-saves byte for byte; a layout from a file is
checked field by field (PlanError, ArchiveError through the archive); the verifier checks it
against the signature; backends that do not declare `per_rank` refuse per-rank programs.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

import portable
from portable.backends import Target, get_backend
from portable.backends.base import PER_RANK_BUILTINS
from portable.errors import ArchiveError, BackendError, PlanError, VerifyError
from portable.ir.plan import Mesh, Plan
from portable.ir.serialize import program_from_json, program_to_json
from portable.ir.sharding import Sharding
from portable.ir.spmd import Collective, SpmdLayout, TensorLayout
from portable.parallel import column_parallel, row_parallel
from portable.passes import PassManager, get_pass


@pytest.fixture(scope="module")
def per_rank():
    """The MLP example's training step, tensor-parallel over tp=2, through the pass manager
    (so its metadata also has the pass history, written after the layout)."""
    from tests.support import load_spec

    spec = load_spec("mlp")
    program = portable.capture(
        spec.build(), spec.batch(), loss_fn=spec.loss_fn, optimizer=portable.optim.SGD(lr=0.1)
    )
    plan = Plan(Mesh({"tp": 2}), rules=[*column_parallel("fc1"), *row_parallel("fc2")])
    out, _ = PassManager([get_pass("spmd-partition")]).run(program.replace(plan=plan))
    return out


def _doc(program) -> dict:
    return program_to_json(program)


# --------------------------------------------------------------------------- the typed field


def test_the_pass_writes_a_typed_layout_over_the_signature(per_rank):
    layout = per_rank.spmd
    assert isinstance(layout, SpmdLayout) and "spmd" not in per_rank.metadata
    assert layout.mesh == Mesh({"tp": 2}) and layout.size == 2 and per_rank.is_per_rank
    assert [t.name for t in layout.inputs] == [i.name for i in per_rank.signature.inputs]
    assert [t.name for t in layout.outputs] == [o.name for o in per_rank.signature.outputs]
    fc1 = layout.input("p_model_fc1_weight")
    local = per_rank.signature.inputs[0].spec.shape
    assert fc1.sharding.dims[0] == ("tp",) and fc1.global_shape[0] == 2 * local[0]
    assert {c.op for c in layout.collectives} == {"all_reduce"}
    assert per_rank.replace().spmd == layout  # replace carries it


def test_json_is_the_metadata_entry_archives_have(per_rank):
    doc = _doc(per_rank)["metadata"]
    keys = list(doc)
    assert keys.index("spmd") == keys.index("passes") - 1  # where the pass's write put it
    entry = doc["spmd"]
    assert list(entry) == ["mesh", "inputs", "outputs", "global_shapes", "collectives"]
    assert entry["mesh"] == {"tp": 2}
    assert entry["inputs"]["p_model_fc1_weight"] == {"dims": [["tp"], []], "partial": {}}
    assert entry["global_shapes"]["inputs"]["p_model_fc1_weight"] == list(
        per_rank.spmd.input("p_model_fc1_weight").global_shape
    )
    first = entry["collectives"][0]
    assert list(first) == ["node", "op", "axis", "group_size", "bytes"]
    assert SpmdLayout.from_json(entry) == per_rank.spmd


def test_archive_round_trip_is_byte_identical_and_keeps_the_hash(per_rank, tmp_path):
    first = per_rank.save(tmp_path / "a.portable")
    loaded = portable.load(first)
    assert loaded.spmd == per_rank.spmd and "spmd" not in loaded.metadata
    assert loaded.content_hash == per_rank.content_hash
    second = loaded.save(tmp_path / "b.portable")
    assert (second / "program.json").read_bytes() == (first / "program.json").read_bytes()


def test_a_layout_over_one_device_is_not_per_rank(per_rank):
    one = SpmdLayout.replicated(per_rank.signature, Mesh({}))
    assert not one.is_per_rank and one.size == 1
    assert not per_rank.replace(spmd=None).is_per_rank


def test_metadata_may_not_hold_the_layout_untyped(per_rank):
    program = per_rank.replace(metadata={**per_rank.metadata, "spmd": per_rank.spmd.to_json()})
    with pytest.raises(ArchiveError, match="reserved") as info:
        program_to_json(program)
    assert "Program.spmd" in str(info.value)


# --------------------------------------------------------------------------- hostile files


def _mutated(per_rank, mutate) -> dict:
    entry = copy.deepcopy(_doc(per_rank)["metadata"]["spmd"])
    mutate(entry)
    return entry


_MALFORMED = {
    "an extra field": (lambda e: e.update(extra=1), "exactly the fields"),
    "no collectives": (lambda e: e.pop("collectives"), "exactly the fields"),
    "mesh not an object": (lambda e: e.update(mesh=[["tp", 2]]), "mesh is not"),
    "bad mesh size": (lambda e: e.update(mesh={"tp": 0}), "size 0"),
    "unknown axis": (
        lambda e: e["inputs"].update(p_model_fc1_weight={"dims": [["dp"], []], "partial": {}}),
        "names axis 'dp'",
    ),
    "axis twice": (
        lambda e: e["inputs"].update(p_model_fc1_weight={"dims": [["tp"], ["tp"]], "partial": {}}),
        "axis twice",
    ),
    "bad reduce op": (
        lambda e: e["outputs"].update(loss={"dims": [], "partial": {"tp": "xor"}}),
        "partial is not",
    ),
    "dims not lists": (
        lambda e: e["inputs"].update(p_model_fc1_weight={"dims": "tp", "partial": {}}),
        "dims is not",
    ),
    "rank mismatch": (
        lambda e: e["global_shapes"]["inputs"].update(p_model_fc1_weight=[4]),
        "its global shape [4] has 1",
    ),
    "names differ": (lambda e: e["global_shapes"]["inputs"].pop("p_model_fc1_weight"), "different"),
    "negative size": (
        lambda e: e["global_shapes"]["inputs"].update(p_model_fc1_weight=[-1, 4]),
        "is not a list of",
    ),
    "boolean size": (
        lambda e: e["global_shapes"]["inputs"].update(p_model_fc1_weight=[True, 4]),
        "is not a list of",
    ),
    "too many dims": (
        lambda e: e["global_shapes"]["inputs"].update(p_model_fc1_weight=[1] * 65),
        "at most 64",
    ),
    "collective node": (lambda e: e["collectives"][0].update(node="a b"), "collective's node"),
    "collective axis": (lambda e: e["collectives"][0].update(axis="dp"), "over axis 'dp'"),
    "collective size": (lambda e: e["collectives"][0].update(group_size=0), "group_size 0"),
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_malformed_layouts_are_refused_naming_the_field(per_rank, case):
    mutate, expected = _MALFORMED[case]
    with pytest.raises(PlanError) as info:
        SpmdLayout.from_json(_mutated(per_rank, mutate))
    assert expected in str(info.value), str(info.value)
    assert info.value.fix


@pytest.mark.parametrize("data", [None, [], "spmd", 3])
def test_a_layout_is_an_object(data):
    with pytest.raises(PlanError, match="malformed spmd layout"):
        SpmdLayout.from_json(data)


def test_an_archive_with_a_malformed_layout_is_an_archive_error(per_rank):
    doc = json.loads(json.dumps(_doc(per_rank)))
    doc["metadata"]["spmd"]["mesh"] = {"tp": "2"}
    with pytest.raises(ArchiveError, match="metadata.spmd") as info:
        program_from_json(doc, per_rank.weights)
    assert "size '2'" in str(info.value)


# --------------------------------------------------------------------------- verified


def test_the_verifier_checks_the_layout_against_the_signature(per_rank):
    portable.verify(per_rank)
    layout = per_rank.spmd
    wrong = dataclasses.replace(layout.inputs[0], global_shape=(7, 7))
    with pytest.raises(VerifyError, match="the spmd layout says \\[7, 7\\]"):
        portable.verify(
            per_rank.replace(spmd=dataclasses.replace(layout, inputs=(wrong,) + layout.inputs[1:]))
        )
    with pytest.raises(VerifyError, match="are not the signature's"):
        portable.verify(
            per_rank.replace(spmd=dataclasses.replace(layout, outputs=layout.outputs[1:]))
        )


def test_collectives_are_records_of_the_layout():
    mesh = Mesh({"dp": 2})
    layout = SpmdLayout(
        mesh,
        (TensorLayout("x", Sharding((("dp",),)), (4,)),),
        (TensorLayout("y", Sharding(((),)), (4,)),),
        (Collective("all_gather_default", "all_gather", "dp", 2, 8),),
    )
    assert SpmdLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    assert layout.with_collectives(()).collectives == ()
    with pytest.raises(PlanError, match="no input `z`"):
        layout.input("z")


# --------------------------------------------------------------------------- capabilities


def test_cuda_refuses_per_rank_programs_naming_the_backends_that_take_them(per_rank):
    with pytest.raises(BackendError) as info:
        get_backend("cuda").check_program(per_rank, Target("cuda"))
    message = str(info.value)
    assert "backend cuda takes single-device programs" in message
    assert "per-rank program over a mesh of 2 devices" in message
    assert "before `spmd-partition`" in message
    assert "cpu, neuron, xla" in message


def test_the_claims_are_declared_per_backend_and_the_refusal_names_them():
    builtins = ("cpu", "xla", "neuron", "cuda", "onnx")
    takes = {n: get_backend(n).capabilities().per_rank for n in builtins}
    assert takes == {"cpu": True, "xla": True, "neuron": True, "cuda": False, "onnx": False}
    assert set(PER_RANK_BUILTINS) == {n for n, yes in takes.items() if yes}


def test_a_layout_over_one_device_passes_the_capability_check(per_rank):
    single = per_rank.replace(spmd=SpmdLayout.replicated(per_rank.signature, Mesh({})))
    get_backend("cuda").check_program(single, Target("cuda"))  # not per-rank: no refusal
