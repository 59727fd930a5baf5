"""Neuron lowering of pipelined training steps (backends/neuron/pipeline.py).

Each stage's forward / backward / update program becomes its own Neuron HLO whose collectives
list replica groups of the FULL mesh in NxD order [PP, DP, CP, TP]; activations and their
gradients move between stages through per-cut `collective-permute` HLOs whose source_target_pairs
are NxD ranks; the manifest maps every rank to its stage and programs; every HLO passes the
offline validator; and the written HLOs, run on XLA:CPU in micro-batch order, reproduce the
single-device cpu step over 2 steps within 1e-5 (loss and state; rounding-noise elements as in
tests/test_xla_pipeline.py).

Default: GPT (4 layers, M=4) at PP=4 lowered, written and run on the stand-in; PP=4 x TP=2 with
tp_rules("gpt") lowered, written and validated. `@slow`: PP=4 x TP=2 run on the stand-in (8
XLA:CPU replicas) and PP=2 x V=2 interleaved for GPT; under PORTABLE_SLOW=full for Llama too.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import portable
from portable import Mesh, Pipeline, Plan
from portable.errors import BackendError, PlanError

pytest.importorskip("jax")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_xla_pipeline import _compare, _reference, _step  # noqa: E402

from portable.backends.neuron.backend import NeuronBackend  # noqa: E402
from portable.backends.neuron.hlo import parse_hlo_text  # noqa: E402
from portable.backends.neuron.pipeline import (  # noqa: E402
    PipelineLowered,
    lower_pipeline,
    run_pipeline_stand_in,
)
from portable.backends.neuron.validate import validate  # noqa: E402
from tests.spmd_cases import tp_rules  # noqa: E402

FULL = os.environ.get("PORTABLE_SLOW") == "full"


def _pp(pp: int = 4, m: int = 4) -> Plan:
    return Plan(Mesh({"pp": pp}), pipeline=Pipeline(microbatches=m))


def _pp_tp(stem: str, m: int = 4) -> Plan:
    return Plan(Mesh({"pp": 4, "tp": 2}), rules=tp_rules(stem), pipeline=Pipeline(microbatches=m))


@pytest.fixture(scope="module")
def gpt4():
    step, batch = _step("gpt", 4, 4)
    return step, batch


def _run(pl, step, batch, steps: int = 2):
    names = [i.name for i in step.signature.user_inputs]
    outs, state = run_pipeline_stand_in(
        pl, dict(step.weights), dict(zip(names, batch, strict=True)), steps
    )
    return [o[pl.stages.loss_name] for o in outs], state


def _errors(pl, record) -> list:
    found = validate(
        parse_hlo_text(record.hlo_text),
        pl.lowered.payload.target,
        program=None,
        ranks=pl.layout,
        rank_parameter=record.rank_parameter,
    )
    return [f for f in found if f.severity.name == "ERROR"]


def _permutes(text: str) -> list[str]:
    return re.findall(r"collective-permute\(.*?source_target_pairs=(\{[\d,{}]*\})", text)


def test_pp4_stage_hlo_reproduces_the_single_device_step(gpt4, tmp_path):
    step, batch = gpt4
    want = _reference(step, batch, 2)
    pp_step = step.replace(plan=_pp())
    written = portable.lower(pp_step, "neuron:trn3", tmp_path)
    assert isinstance(written.payload, PipelineLowered)
    pl = written.payload.source  # the PipelineNeuron that was written
    # one HLO per stage program (4 stages x forward/backward/update) and per transfer
    assert len(pl.programs) == 12
    kinds = [t.kind for t in pl.transfers]
    assert kinds == ["activation", "gradient"] * 3 + ["tied_gradient"]
    for t in pl.transfers:
        (pairs,) = set(_permutes(t.record.hlo_text))
        assert pairs == "{" + ",".join(f"{{{a},{b}}}" for a, b in t.pairs) + "}"
    assert [t.pairs for t in pl.transfers[:2]] == [((0, 1),), ((1, 0),)]
    assert pl.transfers[-1].pairs == ((0, 3), (3, 0))  # GPT's LM head tied to the embedding
    for record in [*pl.programs.values(), *(t.record for t in pl.transfers)]:
        assert _errors(pl, record) == []
        assert "replica-id" not in record.hlo_text and "partition-id" not in record.hlo_text
    # the manifest: the old fields, and the pipeline's rank map
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["validation"]["errors"] == 0
    assert manifest["spmd"]["program_of_rank"] == [f"GPT.stage{s}.forward" for s in range(4)]
    section = manifest["pipeline"]
    assert section["stage_of_rank"] == [[0], [1], [2], [3]]
    assert section["programs_of_rank"][1] == [
        "GPT.stage1.forward",
        "GPT.stage1.backward",
        "GPT.stage1.update",
        "GPT.cut0.activation",
        "GPT.cut0.gradient",
        "GPT.cut1.activation",
        "GPT.cut1.gradient",
    ]
    cut = section["transfers"][0]
    assert cut["tensors"][0]["send"].startswith("out:") and cut["ranks"] == [0, 1]
    keys = {p["key"] for p in manifest["programs"]}
    assert keys == {k for rank in section["programs_of_rank"] for k in rank}
    assert len(keys) == 12 + 7
    for key in keys:
        assert (tmp_path / "programs" / key / "model" / "graph.hlo").is_file()
    # the written HLO run on XLA:CPU, micro-batch by micro-batch, 2 steps
    losses, state = _run(pl, step, batch)
    worst, clean = _compare(want, losses, state)
    print(f"gpt pp=4 on the stand-in: max error {worst:.2e}, {clean:.2e} outside noise")


def test_pp4_tp2_stage_hlo_has_full_mesh_groups_and_validates(gpt4, tmp_path):
    step, _ = gpt4
    pp_step = step.replace(plan=_pp_tp("gpt"))
    written = portable.lower(pp_step, "neuron:trn3", tmp_path)
    pl = written.payload
    assert isinstance(pl, PipelineLowered)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["spmd"]["world_size"] == 8
    assert [a["axis"] for a in manifest["spmd"]["axes"]] == ["pp", "tp"]
    section = manifest["pipeline"]
    assert section["stage_of_rank"] == [[0], [0], [1], [1], [2], [2], [3], [3]]
    stages = {s["index"]: s for s in section["stage_programs"]}
    assert [stages[s]["ranks"] for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    tp_groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    by_key = {p.key: p for p in pl.programs}
    for s in range(4):
        for part in ("forward", "backward"):
            record = by_key[f"GPT.stage{s}.{part}"]
            assert record.ranks == (2 * s, 2 * s + 1)
            assert {c["axis"] for c in record.collectives} == {"tp"}
            assert all(c["replica_groups"] == tp_groups for c in record.collectives)
            # GPT's fused qkv is sliced per rank: tp = rank_id % 2
            assert record.rank_parameter is not None
            text = record.hlo_text
            assert "{{0,1},{2,3},{4,5},{6,7}}" in text and "collective-permute" not in text
    transfers = {t["key"]: t for t in section["transfers"]}
    assert transfers["GPT.cut1.activation"]["source_target_pairs"] == [[2, 4], [3, 5]]
    assert transfers["GPT.cut1.gradient"]["source_target_pairs"] == [[4, 2], [5, 3]]
    assert transfers["GPT.tied.lm_head.weight"]["source_target_pairs"] == [
        [0, 6],
        [6, 0],
        [1, 7],
        [7, 1],
    ]
    for record in pl.programs:
        found = validate(
            record.module,
            pl.target,
            program=None,
            ranks=pl.ranks,
            rank_parameter=record.rank_parameter,
        )
        assert [f for f in found if f.severity.name == "ERROR"] == [], record.key
    assert manifest["validation"]["errors"] == 0
    # `portable check`'s validator on the written folder: every program, zero errors
    checked = NeuronBackend().check(tmp_path)
    assert len(checked) == 12 + 7
    assert [f for c in checked for f in c.findings if f.severity.name == "ERROR"] == []


def test_refusals_are_typed_with_a_fix(gpt4):
    step, batch = gpt4
    with pytest.raises(PlanError) as info:
        lower_pipeline(step, "trn3", backend=NeuronBackend())  # no pipeline in the plan
    assert info.value.fix
    plan = Plan(Mesh({"dp": 4}), pipeline=Pipeline(axis="dp", microbatches=4))
    with pytest.raises(PlanError, match="not PP") as info:
        lower_pipeline(step.replace(plan=plan), "trn3", backend=NeuronBackend())
    assert "'pp'" in info.value.fix
    with pytest.raises(BackendError) as info:
        portable.compile(step.replace(plan=_pp()), backend="neuron")
    assert info.value.fix


@pytest.mark.slow
def test_pp4_tp2_and_interleaved_run_on_the_stand_in():
    """PP=4 x TP=2 stage HLOs (tp collectives over the full mesh) and transfers run on 8
    XLA:CPU replicas, and PP=2 x V=2 interleaved (transfers on a ring: stage 1 -> 2 goes from
    rank 1 to rank 0); GPT, and under PORTABLE_SLOW=full Llama too."""
    interleaved = Plan(
        Mesh({"pp": 2}),
        pipeline=Pipeline(microbatches=4, schedule="interleaved-1f1b", virtual_stages=2),
    )
    for stem in ("gpt", "llama") if FULL else ("gpt",):
        step, batch = _step(stem, 4, 4)
        want = _reference(step, batch, 2)
        for name, plan in (("pp=4 x tp=2", _pp_tp(stem)), ("pp=2 x v=2", interleaved)):
            pl = lower_pipeline(step.replace(plan=plan), "trn3", backend=NeuronBackend())
            losses, state = _run(pl, step, batch)
            worst, clean = _compare(want, losses, state)
            print(f"{stem} {name} on the stand-in: max error {worst:.2e}, {clean:.2e} clean")
        assert [t.pairs for t in pl.transfers[:4]] == [((0, 1),), ((1, 0),), ((1, 0),), ((0, 1),)]
