"""The spmd-partition pass: layouts from the plan, the collectives it inserts, local shapes, the
metadata contract and plan errors (numerics on real engines: test_distributed_torch.py and
test_xla_spmd.py)."""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch

import portable
from portable import Mesh, Plan, PlanError
from portable import parallel as par
from portable.passes import get_pass
from portable.passes.spmd_partition import partition
from tests.spmd_cases import plan_for, tp_rules, training_program

P = torch.ops.portable
COLLECTIVES = {
    P.all_reduce.default,
    P.all_gather.default,
    P.reduce_scatter.default,
    P.all_to_all.default,
}


@pytest.fixture(scope="module")
def programs():
    from tests.support import load_spec

    return {stem: training_program(load_spec(stem))[0] for stem in ("mlp", "gpt", "llama")}


def _local(program, name):
    return tuple(
        next(i for i in program.signature.inputs if i.target == name or i.name == name).spec.shape
    )


def test_data_parallel_splits_the_batch_and_all_reduces_every_gradient(programs):
    program = programs["llama"]
    per_rank, report = partition(program.replace(plan=plan_for("llama", "dp")))
    portable.verify(per_rank)
    batch = [i for i in per_rank.signature.user_inputs]
    assert all(i.spec.shape[0] == 1 for i in batch)  # global batch 2 over dp=2
    assert _local(per_rank, "embed.weight") == _local(program, "embed.weight")
    n_params = len(program.parameters())
    # every gradient is a partial sum over dp, reduced once before the optimizer update
    assert report.counts["all_reduce[dp]"] >= n_params
    assert "all_gather[dp]" not in report.counts
    assert per_rank.spmd.mesh == Mesh({"dp": 2})
    assert per_rank.spmd.output("loss").sharding.is_replicated


def test_tensor_parallel_llama_keeps_heads_local(programs):
    program = programs["llama"]
    per_rank, report = partition(program.replace(plan=plan_for("llama", "tp")))
    portable.verify(per_rank)
    assert _local(per_rank, "blocks.0.attn.q_proj.weight") == (32, 64)
    assert _local(per_rank, "blocks.0.attn.o_proj.weight") == (64, 32)
    assert (
        _local(per_rank, "blocks.0.mlp.down_proj.weight")[1] * 2
        == _local(program, "blocks.0.mlp.down_proj.weight")[1]
    )
    # head-parallel attention and column/row MLPs: activations are reduced, weights never gathered
    assert report.counts.get("all_gather[tp]", 0) == 0
    assert report.counts["all_reduce[tp]"] > 0
    assert report.counts["replicated-ops"] == 0
    # optimizer state follows its parameter
    assert _local(per_rank, "optimizer.blocks.0.attn.q_proj.weight.exp_avg") == (32, 64)


def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(programs):
    program = programs["gpt"]
    per_rank, report = partition(program.replace(plan=plan_for("gpt", "fsdp")))
    portable.verify(per_rank)
    full = _local(program, "blocks.0.mlp.fc.weight")
    assert _local(per_rank, "blocks.0.mlp.fc.weight") == (full[0] // 2, full[1])
    assert _local(per_rank, "optimizer.blocks.0.mlp.fc.weight.exp_avg") == (full[0] // 2, full[1])
    assert report.counts["all_gather[dp]"] > 0 and report.counts["reduce_scatter[dp]"] > 0


def test_two_dimensional_mesh_and_sequence_parallel(programs):
    program = programs["llama"]
    plan = Plan(
        Mesh({"dp": 2, "tp": 2}),
        rules=tp_rules("llama"),
        batch_axes=("dp",),
        sequence_parallel="tp",
    )
    per_rank, report = partition(program.replace(plan=plan))
    portable.verify(per_rank)
    assert report.counts["all_reduce[dp]"] > 0
    # partial sums of the row-parallel layers are reduce-scattered onto the sequence dim
    assert report.counts["reduce_scatter[tp]"] > 0 and report.counts["all_gather[tp]"] > 0


def test_every_collective_has_its_own_wait_and_the_archive_keeps_the_contract(programs, tmp_path):
    program = programs["gpt"]
    per_rank, report = partition(program.replace(plan=plan_for("gpt", "dp_tp")))
    for node in per_rank.graph.nodes:
        if node.target in COLLECTIVES:
            users = list(node.users)
            assert [u.target for u in users] == [P.wait.default], node.name
    recorded = {c.node for c in per_rank.spmd.collectives}
    assert recorded == {n.name for n in per_rank.graph.nodes if n.target in COLLECTIVES}
    assert all(c.bytes > 0 for c in per_rank.spmd.collectives)
    assert any("all_reduce over dp (2 ranks)" in n for n in report.notes)
    loaded = portable.load(per_rank.save(tmp_path / "gpt.portable"))
    assert loaded.spmd == per_rank.spmd and "spmd" not in loaded.metadata
    assert loaded.plan == per_rank.plan and loaded.content_hash == per_rank.content_hash


def test_inference_outputs_keep_their_batch_split(example_spec):
    spec = example_spec("gpt")
    program = portable.capture(
        spec.build(), spec.inputs(), plan=Plan(Mesh({"dp": 2}), batch_axes=("dp",))
    )
    per_rank = get_pass("spmd-partition").apply(program).program
    portable.verify(per_rank)
    (out,) = per_rank.spmd.outputs
    assert out.sharding.dims[0] == ("dp",)
    assert per_rank.signature.outputs[0].spec.shape[0] == 1


def test_single_device_plan_is_a_no_op(programs):
    program = programs["mlp"]
    result = get_pass("spmd-partition").apply(program)
    assert result.program is program and not result.report.changed


def test_partitioning_twice_is_refused(programs):
    per_rank, _ = partition(programs["mlp"].replace(plan=plan_for("mlp", "dp")))
    with pytest.raises(portable.PassError, match="already partitioned"):
        partition(per_rank)


def test_a_batch_the_data_axis_does_not_divide_shows_the_arithmetic(programs):
    plan = Plan(Mesh({"dp": 3}), batch_axes=("dp",))
    with pytest.raises(PlanError, match=r"dp\(3\) do not divide input .* dim 0 \(2\): 2 % 3 = 2"):
        partition(programs["gpt"].replace(plan=plan))


def test_non_dividing_tensor_parallel_degree_shows_the_arithmetic(programs):
    with pytest.raises(PlanError, match=r"tp=3 does not divide heads=8: 8 % 3 = 2"):
        par.head_parallel("attn", heads=8, axis_size=3)
    plan = Plan(Mesh({"tp": 3}), rules=par.column_parallel(r"blocks\.\d+\.mlp\.fc"))
    with pytest.raises(
        PlanError,
        match=r"tp\(3\) does not divide blocks\.0\.mlp\.fc\.weight dim 0 \(256\): 256 % 3 = 1",
    ):
        partition(programs["gpt"].replace(plan=plan))


def test_unknown_axis_and_rules_matching_nothing_are_refused(programs):
    with pytest.raises(PlanError, match=r"(?s)unknown mesh axis 'mp'.*dp, tp"):
        Plan(Mesh({"dp": 2, "tp": 2}), rules=par.column_parallel("fc", axis="mp"))
    with pytest.raises(PlanError, match="unknown mesh axis 'data'"):
        Plan(Mesh({"dp": 2}), batch_axes=("data",))
    plan = Plan(Mesh({"tp": 2}), rules=par.column_parallel(r"layers\.\d+\.fc"))
    with pytest.raises(
        PlanError, match=r"sharding rule 'layers\\\\.\\\\d\+\\\\.fc\\\\.weight' matches no tensor"
    ):
        partition(programs["gpt"].replace(plan=plan))


def test_world_size_must_match_the_mesh():
    plan = Plan(Mesh({"dp": 2, "tp": 2}))
    plan.check_world_size(4, "torchrun")
    with pytest.raises(
        PlanError, match=r"torchrun starts 2 processes but the plan's mesh \(dp=2 x tp=2\) has 4"
    ):
        plan.check_world_size(2, "torchrun")


def test_ops_without_a_rule_run_on_full_copies(programs):
    # the MLP's mse_loss has no rule: it runs replicated, and the report says so
    per_rank, report = partition(programs["mlp"].replace(plan=plan_for("mlp", "dp")))
    assert report.counts["replicated-ops"] == 2
    assert any("aten.mse_loss.default" in n for n in report.notes)
    assert not any(n.target is operator.getitem and not n.users for n in per_rank.graph.nodes)


def test_vocab_parallel_embedding_looks_up_on_the_shard(programs):
    program = programs["llama"]
    per_rank, report = partition(program.replace(plan=plan_for("llama", "dp_tp_vocab")))
    portable.verify(per_rank)
    assert _local(per_rank, "embed.weight") == (64, 64)  # vocab 128 over tp=2
    lookups = [n for n in per_rank.graph.nodes if n.target is torch.ops.aten.embedding.default]
    (lookup,) = lookups
    assert lookup.args[0].op == "placeholder"  # the local shard itself, never gathered
    assert report.counts.get("all_gather[tp]", 0) == 0


def test_tied_weights_answer_to_either_name(programs):
    # GPT ties lm_head.weight to wte.weight: a rule for wte shards the one tensor both use
    per_rank, _ = partition(programs["gpt"].replace(plan=plan_for("gpt", "dp_tp_vocab")))
    tied = programs["gpt"].metadata["tied_weights"]
    kept = next(iter(tied.values()))
    assert _local(per_rank, kept)[0] * 2 == _local(programs["gpt"], kept)[0]


def test_cli_lowers_a_two_by_two_plan_to_per_rank_neuron_hlo(tmp_path, capsys):
    """`portable lower SPEC --train --plan plan.json -p spmd-partition -t neuron`."""
    import json

    from portable.cli import main

    plan = tmp_path / "plan.json"
    mlp = [
        *par.column_parallel(r"blocks\.\d+\.mlp\.fc"),
        *par.row_parallel(r"blocks\.\d+\.mlp\.proj"),
    ]
    plan.write_text(
        json.dumps(Plan(Mesh({"dp": 2, "tp": 2}), rules=mlp, batch_axes=("dp",)).to_json())
    )
    out = tmp_path / "out"
    spec = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py") + ":GPT"
    code = main(
        [
            "lower",
            spec,
            "--train",
            "--plan",
            str(plan),
            "-p",
            "spmd-partition",
            "-t",
            "neuron",
            "--out",
            str(out),
            "-q",
        ]
    )
    assert code == 0, capsys.readouterr().err
    found = list(out.rglob("manifest.json"))
    spmd = [json.loads(p.read_text()).get("spmd") for p in found]
    assert any(s and s["world_size"] == 4 for s in spmd), found
    loaded = portable.load(out / "program.portable")
    assert loaded.plan.mesh.size == 4 and loaded.spmd.size == 4 and loaded.is_per_rank


def test_cli_refuses_a_plan_that_does_not_fit_before_capture(tmp_path, capsys):
    from portable.cli import main

    code = main(
        [
            "lower",
            "examples/gpt.py:GPT",
            "--plan",
            str(tmp_path / "missing.json"),
            "-t",
            "cpu",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 3 and "no such plan file" in capsys.readouterr().err
