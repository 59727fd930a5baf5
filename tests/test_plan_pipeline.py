"""The plan vocabulary of pipeline, expert and context parallelism: `Pipeline`, `Experts` and
`Plan(pipeline=, experts=, context_axis=)`.

Every refusal is a PlanError whose message carries the arithmetic (the numbers the user wrote
and the ones they conflict with) and a fix; plans read from files (`Plan.from_json`) are refused
the same way, never with a TypeError or KeyError from deep inside the constructors.
"""

from __future__ import annotations

import json

import pytest
import torch

import portable
from portable import Experts, Mesh, PartitionSpec, Pipeline, Plan, PlanError
from portable.ir.plan import SCHEDULES, ShardingRule


def _error(make) -> PlanError:
    with pytest.raises(PlanError) as info:
        make()
    return info.value


# --- construction ------------------------------------------------------------------------------


def test_the_names_are_exported():
    assert portable.Pipeline is Pipeline and portable.Experts is Experts
    from portable import parallel

    assert parallel.Pipeline is Pipeline and parallel.Experts is Experts


def test_pipeline_defaults_and_fields():
    pipeline = Pipeline()
    assert (pipeline.axis, pipeline.stages, pipeline.schedule) == ("pp", None, "1f1b")
    assert (pipeline.microbatches, pipeline.virtual_stages, pipeline.split_points) == (1, 1, ())
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
    # one split point may be given as a bare string; a list becomes a tuple
    assert Pipeline(split_points="blocks.2").split_points == ("blocks.2",)
    assert Pipeline(split_points=["blocks.1", "blocks.2"]).split_points == ("blocks.1", "blocks.2")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_builds_a_plan(schedule):
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    plan = Plan(
        Mesh({"pp": 2, "dp": 2}),
        batch_axes=("dp",),
        pipeline=Pipeline(schedule=schedule, microbatches=4, virtual_stages=virtual),
    )
    assert plan.pipeline is not None and plan.pipeline.schedule == schedule
    assert plan.mesh is not None and plan.pipeline.stage_count(plan.mesh) == 2 * virtual


def test_stage_count_is_the_axis_times_virtual_stages():
    mesh = Mesh({"dp": 2, "pp": 4})
    assert Pipeline(microbatches=4).stage_count(mesh) == 4
    interleaved = Pipeline(schedule="interleaved-1f1b", virtual_stages=3, microbatches=8)
    assert interleaved.stage_count(mesh) == 12
    assert Pipeline(stages=4, microbatches=4).stage_count(mesh) == 4
    # zero-bubble may place one or several stages on each rank
    assert Pipeline(schedule="zero-bubble", virtual_stages=2, microbatches=4).stage_count(mesh) == 8


def test_gpipe_may_run_fewer_micro_batches_than_ranks():
    # gpipe (all forwards, then all backwards) runs any number of micro-batches; the 1F1B family
    # needs one per rank to fill the pipeline
    Plan(Mesh({"pp": 4}), pipeline=Pipeline(schedule="gpipe", microbatches=1))
    Plan(Mesh({"pp": 4}), pipeline=Pipeline(schedule="1f1b", microbatches=4))


def test_experts_and_context_axis():
    plan = Plan(
        Mesh({"dp": 2, "ep": 2, "cp": 2}),
        batch_axes=("dp",),
        experts=Experts(axis="ep", modules=r"blocks\.\d+\.moe", capacity_factor=1.25),
        context_axis="cp",
    )
    assert plan.experts == Experts("ep", r"blocks\.\d+\.moe", 1.25)
    assert plan.context_axis == "cp"
    assert Experts() == Experts(axis="ep", modules=".*", capacity_factor=None)
    # an integer factor is a number too
    assert Experts(capacity_factor=2).capacity_factor == 2


# --- validation: the arithmetic in every message -----------------------------------------------


def test_unknown_schedule_lists_the_schedules():
    err = _error(lambda: Pipeline(schedule="1F1B"))
    assert "unknown pipeline schedule '1F1B'" in err.what
    assert err.fix is not None
    assert all(s in err.fix for s in SCHEDULES)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_fewer_micro_batches_than_ranks(schedule):
    err = _error(
        lambda: Plan(Mesh({"pp": 4}), pipeline=Pipeline(schedule=schedule, microbatches=2))
    )
    assert f"the {schedule} schedule needs at least one micro-batch per pp rank" in err.what
    assert "microbatches=2 < pp(4)" in err.what
    assert "microbatches >= 4" in str(err.fix)


def test_fewer_micro_batches_than_ranks_names_the_axis():
    pipeline = Pipeline("stage", schedule="interleaved-1f1b", virtual_stages=2, microbatches=2)
    err = _error(lambda: Plan(Mesh({"stage": 4}), pipeline=pipeline))
    assert "per stage rank: microbatches=2 < stage(4)" in err.what


def test_interleaved_needs_virtual_stages():
    err = _error(lambda: Pipeline(schedule="interleaved-1f1b", microbatches=4))
    assert "interleaved-1f1b schedule needs virtual_stages >= 2 (got 1)" in err.what
    assert "virtual_stages=2" in str(err.fix)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_per_rank_schedules_refuse_virtual_stages(schedule):
    err = _error(lambda: Pipeline(schedule=schedule, virtual_stages=3, microbatches=4))
    assert f"the {schedule} schedule runs one stage per rank, but virtual_stages=3" in err.what
    assert "interleaved-1f1b" in str(err.fix)


def test_stages_must_be_the_axis_times_virtual_stages():
    err = _error(lambda: Plan(Mesh({"pp": 2}), pipeline=Pipeline(stages=3, microbatches=4)))
    assert "pipeline stages=3 but pp(2) x virtual_stages(1) = 2" in err.what
    assert "stages=2" in str(err.fix)
    interleaved = Pipeline(
        stages=4, schedule="interleaved-1f1b", virtual_stages=3, microbatches=4
    )  # 2 x 3 = 6 stages, not 4
    err = _error(lambda: Plan(Mesh({"pp": 2}), pipeline=interleaved))
    assert "stages=4 but pp(2) x virtual_stages(3) = 6" in err.what


def test_split_points_must_make_the_stages():
    # against the explicit stage count, at construction
    err = _error(lambda: Pipeline(stages=2, split_points=("blocks.1", "blocks.2")))
    assert "2 split points make 3 stages, but stages=2" in err.what
    assert "name 1 module paths" in str(err.fix)
    # against the mesh, in the plan
    pipeline = Pipeline(microbatches=4, split_points=("blocks.2",))
    err = _error(lambda: Plan(Mesh({"pp": 4}), pipeline=pipeline))
    assert "1 split points make 2 stages, but pp(4) x virtual_stages(1) = 4" in err.what
    assert "name 3 module paths where stages 1..3 begin" in str(err.fix)
    # the right count passes
    Plan(Mesh({"pp": 2}), pipeline=pipeline)


def test_virtual_stages_run_micro_batches_in_rounds_of_the_axis():
    for schedule in ("interleaved-1f1b", "zero-bubble"):
        pipeline = Pipeline(schedule=schedule, virtual_stages=2, microbatches=6)
        err = _error(lambda p=pipeline: Plan(Mesh({"pp": 4}), pipeline=p))
        assert f"{schedule} with virtual stages" in err.what
        assert "rounds of pp(4): 6 % 4 = 2" in err.what
        assert "multiple of 4" in str(err.fix)
    # one stage per rank takes any count of at least the axis size
    Plan(Mesh({"pp": 4}), pipeline=Pipeline(schedule="zero-bubble", microbatches=6))


@pytest.mark.parametrize(
    "field, value", [("microbatches", 0), ("microbatches", True), ("virtual_stages", 0)]
)
def test_counts_are_positive_integers(field, value):
    err = _error(lambda: Pipeline(**{field: value}))
    assert f"pipeline {field} is {value!r}" in err.what


@pytest.mark.parametrize("value", [-1, 2.0, "2"])
def test_stages_is_a_positive_integer(value):
    err = _error(lambda: Pipeline(stages=value))
    assert f"pipeline stages is {value!r}" in err.what


def test_zero_stages_is_refused_at_construction():
    err = _error(lambda: Pipeline(stages=0))
    assert "pipeline stages is 0" in err.what


@pytest.mark.parametrize("point", [3, None, "a\nb", "x" * 2000])
def test_split_points_are_module_paths(point):
    err = _error(lambda: Pipeline(split_points=("blocks.1", point)))
    assert "pipeline split_points holds" in err.what and "module paths" in str(err.fix)


@pytest.mark.parametrize(
    "plan_fields",
    [
        {"batch_axes": ("pp",)},
        {"fsdp_axis": "pp"},
        {"sequence_parallel": "pp"},
        {"specs": {"blocks.0.mlp.fc.weight": PartitionSpec("pp", None)}},
        {"rules": (ShardingRule(r".*\.weight", PartitionSpec(None, "pp")),)},
    ],
    ids=["batch", "fsdp", "sequence_parallel", "spec", "rule"],
)
def test_the_pipeline_axis_is_its_own(plan_fields):
    err = _error(
        lambda: Plan(Mesh({"pp": 2, "dp": 2}), pipeline=Pipeline(microbatches=2), **plan_fields)
    )
    assert "mesh axis 'pp' is the pipeline axis and also splits tensors or the batch" in err.what
    assert "an axis of its own" in str(err.fix)


@pytest.mark.parametrize(
    "plan_fields", [{"context_axis": "pp"}, {"experts": Experts(axis="pp")}], ids=["cp", "ep"]
)
def test_the_pipeline_axis_is_not_the_context_or_expert_axis(plan_fields):
    err = _error(
        lambda: Plan(Mesh({"pp": 2, "dp": 2}), pipeline=Pipeline(microbatches=2), **plan_fields)
    )
    assert "mesh axis 'pp' is the pipeline axis" in err.what


@pytest.mark.parametrize(
    "plan_fields, axis",
    [
        ({"pipeline": Pipeline(axis="stage", microbatches=2)}, "stage"),
        ({"experts": Experts(axis="ep")}, "ep"),
        ({"context_axis": "cp"}, "cp"),
    ],
    ids=["pipeline", "experts", "context"],
)
def test_unknown_axis_names_the_mesh_axes(plan_fields, axis):
    err = _error(lambda: Plan(Mesh({"dp": 2, "tp": 2}), **plan_fields))
    assert f"unknown mesh axis {axis!r}" in err.what
    assert "dp, tp" in str(err.fix)
    err = _error(lambda: Plan(**plan_fields))
    assert f"plan names mesh axis {axis!r} but has no mesh" in err.what


@pytest.mark.parametrize("factor", [0, -1.5, float("nan"), "1.25", True, [1]])
def test_experts_capacity_factor_is_positive(factor):
    err = _error(lambda: Experts(capacity_factor=factor))
    assert f"experts capacity_factor is {factor!r}" in err.what
    assert "positive number" in str(err.fix)


@pytest.mark.parametrize(
    "pattern, why",
    [
        (r"(blocks)\.\d+\.\1", "groupref"),  # a backreference
        (r"(?=blocks)\w+", "assert"),  # a lookahead
        (r"(?<!x)moe", "assert"),  # a lookbehind
        ("(", "not a valid regular expression"),
        ("a" * 1001, "at most 1000 characters"),
    ],
)
def test_experts_modules_is_a_safe_regex(pattern, why):
    err = _error(lambda: Experts(modules=pattern))
    assert why in err.what
    # a nested repeat is fine: matching is linear in the name whatever the pattern
    Experts(modules=r"(blocks\.\d+)+\.moe")


# --- JSON --------------------------------------------------------------------------------------


def _full_plan() -> Plan:
    return Plan(
        Mesh({"pp": 2, "dp": 2, "ep": 2, "cp": 2}),
        specs={"wte.weight": PartitionSpec("ep", None)},
        batch_axes=("dp",),
        pipeline=Pipeline(
            axis="pp",
            stages=4,
            schedule="interleaved-1f1b",
            microbatches=6,
            virtual_stages=2,
            split_points=("blocks.2", "blocks.4", "blocks.6"),
        ),
        experts=Experts(axis="ep", modules=r"blocks\.\d+\.moe\.experts", capacity_factor=1.5),
        context_axis="cp",
    )


def test_json_round_trip_with_pipeline_experts_and_context():
    plan = _full_plan()
    data = plan.to_json()
    assert data["pipeline"] == {
        "axis": "pp",
        "schedule": "interleaved-1f1b",
        "microbatches": 6,
        "virtual_stages": 2,
        "stages": 4,
        "split_points": ["blocks.2", "blocks.4", "blocks.6"],
    }
    assert data["experts"] == {
        "axis": "ep",
        "modules": r"blocks\.\d+\.moe\.experts",
        "capacity_factor": 1.5,
    }
    assert data["context_axis"] == "cp"
    again = Plan.from_json(json.loads(json.dumps(data)))
    assert again == plan
    assert again.to_json() == data


def test_json_leaves_out_defaults():
    plan = Plan(Mesh({"pp": 2}), pipeline=Pipeline(microbatches=2), experts=None)
    data = plan.to_json()
    assert "stages" not in data["pipeline"] and "split_points" not in data["pipeline"]
    assert "experts" not in data and "context_axis" not in data
    assert Plan.from_json(json.loads(json.dumps(data))) == plan
    minimal = Plan(Mesh({"ep": 2}), experts=Experts())
    assert minimal.to_json()["experts"] == {"axis": "ep", "modules": ".*"}
    assert Plan.from_json(minimal.to_json()) == minimal


def test_json_validates_like_the_constructors():
    # a well-formed document with inconsistent arithmetic gets the constructors' message
    data = _full_plan().to_json()
    data["pipeline"]["microbatches"] = 5
    err = _error(lambda: Plan.from_json(data))
    assert "rounds of pp(2): 5 % 2 = 1" in err.what
    data = _full_plan().to_json()
    data["pipeline"]["stages"] = 6
    err = _error(lambda: Plan.from_json(data))
    assert "3 split points make 4 stages, but stages=6" in err.what
    del data["pipeline"]["split_points"]
    err = _error(lambda: Plan.from_json(data))
    assert "stages=6 but pp(2) x virtual_stages(2) = 4" in err.what


_PIPELINE_FIELDS = (
    "['axis', 'microbatches', 'schedule', 'split_points', 'stages', 'virtual_stages']"
)

# (the document's fields beside a mesh {pp: 2, ep: 2, cp: 2}, what the message says)
_MALFORMED = {
    # the pipeline object
    "pipeline a list": (
        {"pipeline": ["1f1b"]},
        f"pipeline is an object with fields {_PIPELINE_FIELDS}",
    ),
    "pipeline a string": ({"pipeline": "1f1b"}, "pipeline is an object with fields"),
    "pipeline unknown field": (
        {"pipeline": {"microbatches": 2, "chunks": 2}},
        f"pipeline is an object with fields {_PIPELINE_FIELDS}",
    ),
    "pipeline axis a number": (
        {"pipeline": {"microbatches": 2, "axis": 0}},
        "pipeline axis and schedule are strings",
    ),
    "pipeline axis null": (
        {"pipeline": {"microbatches": 2, "axis": None}},
        "pipeline axis and schedule are strings",
    ),
    "pipeline schedule a list": (
        {"pipeline": {"microbatches": 2, "schedule": ["1f1b"]}},
        "pipeline axis and schedule are strings",
    ),
    "pipeline microbatches a string": ({"pipeline": {"microbatches": "2"}}, "microbatches is '2'"),
    "pipeline microbatches null": ({"pipeline": {"microbatches": None}}, "microbatches is None"),
    "pipeline microbatches a float": ({"pipeline": {"microbatches": 2.5}}, "microbatches is 2.5"),
    "pipeline stages a string": (
        {"pipeline": {"microbatches": 2, "stages": "2"}},
        "pipeline stages is '2'",
    ),
    "pipeline stages a list": ({"pipeline": {"microbatches": 2, "stages": [2]}}, "stages is [2]"),
    "pipeline virtual_stages null": (
        {"pipeline": {"microbatches": 2, "virtual_stages": None}},
        "pipeline virtual_stages is None",
    ),
    "pipeline split_points a string": (
        {"pipeline": {"microbatches": 2, "split_points": "blocks.1"}},
        "split_points is a list of module paths",
    ),
    "pipeline split_points null": (
        {"pipeline": {"microbatches": 2, "split_points": None}},
        "split_points is a list of module paths",
    ),
    "pipeline split_points numbers": (
        {"pipeline": {"microbatches": 2, "split_points": [1]}},
        "pipeline split_points holds 1",
    ),
    "pipeline split_points nested": (
        {"pipeline": {"microbatches": 2, "split_points": [["blocks.1"]]}},
        "pipeline split_points holds ['blocks.1']",
    ),
    # the experts object
    "experts a list": (
        {"experts": ["ep"]},
        "experts is an object with fields ['axis', 'capacity_factor', 'modules']",
    ),
    "experts a string": ({"experts": "ep"}, "experts is an object with fields"),
    "experts unknown field": ({"experts": {"top_k": 2}}, "experts is an object with fields"),
    "experts axis a number": ({"experts": {"axis": 2}}, "experts axis and modules are strings"),
    "experts modules a number": (
        {"experts": {"modules": 5}},
        "experts axis and modules are strings",
    ),
    "experts modules null": (
        {"experts": {"modules": None}},
        "experts axis and modules are strings",
    ),
    "experts modules a lookbehind": ({"experts": {"modules": "(?<=a)b"}}, "uses assert"),
    "experts capacity_factor a string": (
        {"experts": {"capacity_factor": "1.5"}},
        "experts capacity_factor is '1.5'",
    ),
    "experts capacity_factor a list": (
        {"experts": {"capacity_factor": [1.5]}},
        "experts capacity_factor is [1.5]",
    ),
    "experts capacity_factor zero": (
        {"experts": {"capacity_factor": 0}},
        "experts capacity_factor is 0",
    ),
    # the context axis and the plan itself
    "context_axis a number": ({"context_axis": 2}, "context_axis is not an axis name"),
    "context_axis a list": ({"context_axis": ["cp"]}, "context_axis is not an axis name"),
    "context_axis unknown": ({"context_axis": "sp"}, "unknown mesh axis 'sp'"),
    "unknown plan field": ({"pipeline_parallel": 2}, "a plan is an object with fields"),
}


@pytest.mark.parametrize("fields, says", list(_MALFORMED.values()), ids=list(_MALFORMED))
def test_malformed_json_is_a_plan_error(fields, says):
    data = {"mesh": {"pp": 2, "ep": 2, "cp": 2}, **fields}
    err = _error(lambda: Plan.from_json(data))
    assert says in err.what
    assert err.fix  # every refusal says what to do


@pytest.mark.parametrize("field", ["pipeline", "experts"])
@pytest.mark.parametrize("value", [[], 0, False, ""], ids=["list", "zero", "false", "string"])
def test_falsy_wrong_types_are_refused(field, value):
    err = _error(lambda: Plan.from_json({"mesh": {"pp": 2, "ep": 2}, field: value}))
    assert "malformed plan" in err.what


def test_spmd_partition_refuses_what_it_does_not_plan():
    """Expert parallelism is vocabulary only: partitioning refuses it (and a pipeline, which has
    its own pass) instead of running without it. Context parallelism is partitioned
    (tests/test_context_parallel.py)."""
    from portable.passes.spmd_partition import partition

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    program = portable.capture(model, (torch.randn(2, 4),))
    for plan, named in (
        (Plan(Mesh({"ep": 2}), experts=Experts()), "experts"),
        (Plan(Mesh({"pp": 2}), pipeline=Pipeline(microbatches=2)), "pipeline"),
    ):
        with pytest.raises(PlanError, match=named) as info:
            partition(program.replace(plan=plan))
        assert "not implemented yet" in str(info.value.fix)
