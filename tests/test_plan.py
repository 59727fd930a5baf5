"""The plan data model: meshes, partition specs, rules, validation with the arithmetic."""

from __future__ import annotations

import pytest
import torch

import portable
from portable import Mesh, PartitionSpec, Plan, PlanError
from portable.ir.plan import ShardingRule


def test_mesh_axes_and_sizes():
    mesh = Mesh({"dp": 2, "tp": 4})
    assert mesh.names == ("dp", "tp") and mesh.size == 8 and mesh.axis_size("tp") == 4
    with pytest.raises(PlanError, match="(?s)unknown mesh axis 'pp'.*dp, tp"):
        mesh.axis_size("pp")
    with pytest.raises(PlanError, match="size 0"):
        Mesh({"dp": 0})
    with pytest.raises(PlanError, match="not an identifier"):
        Mesh({"d p": 2})


def test_validation_shows_the_arithmetic():
    plan = Plan(Mesh({"tp": 3}), specs=(("fc.weight", PartitionSpec("tp", None)),))
    with pytest.raises(PlanError) as info:
        plan.validate({"fc.weight": (8, 4)})
    assert "tp(3) does not divide fc.weight dim 0 (8): 8 % 3 = 2" in str(info.value)


def test_a_dynamic_dim_is_not_sharded():
    # a captured program's dynamic dims are size expressions ("s0"); only static dims divide
    plan = Plan(Mesh({"dp": 2}), specs=(("x", PartitionSpec("dp", None)),))
    plan.validate({"x": (4, "s0")})
    with pytest.raises(PlanError, match=r"dp\(2\) shards x dim 0, which is dynamic \(s0\)"):
        plan.validate({"x": ("s0", 4)})


def test_rules_match_by_regex_and_must_match_something():
    rule = ShardingRule(r"blocks\.\d+\.mlp\.fc\.weight", PartitionSpec("tp", None))
    plan = Plan(Mesh({"tp": 2}), rules=(rule,))
    plan.validate({"blocks.0.mlp.fc.weight": (8, 4), "blocks.1.mlp.fc.weight": (8, 4)})
    assert plan.spec_for("blocks.1.mlp.fc.weight") == PartitionSpec("tp", None)
    assert plan.spec_for("wte.weight") is None
    with pytest.raises(PlanError, match="matches no tensor"):
        plan.validate({"wte.weight": (8, 4)})


def test_spec_errors():
    with pytest.raises(PlanError, match="names tensor 'nope'"):
        Plan(Mesh({"dp": 2}), specs=(("nope", PartitionSpec("dp")),)).validate({"x": (4,)})
    with pytest.raises(PlanError, match="has 2 dims but x has 1"):
        Plan(Mesh({"dp": 2}), specs=(("x", PartitionSpec("dp", None)),)).validate({"x": (4,)})
    with pytest.raises(PlanError, match="uses a mesh axis twice"):
        Plan(Mesh({"dp": 2}), specs=(("x", PartitionSpec("dp", "dp")),)).validate({"x": (4, 4)})
    with pytest.raises(PlanError, match="no mesh"):
        Plan(specs=(("x", PartitionSpec(None)),)).validate({"x": (4,)})


def test_plan_is_validated_at_capture_and_stored(tmp_path):
    model = torch.nn.Linear(8, 6)
    bad = Plan(Mesh({"tp": 4}), specs=(("weight", PartitionSpec("tp", None)),))
    with pytest.raises(PlanError, match=r"tp\(4\) does not divide weight dim 0 \(6\)"):
        portable.capture(model, (torch.randn(2, 8),), plan=bad)
    good = Plan(Mesh({"dp": 2, "tp": 2}), specs=(("weight", PartitionSpec("tp", None)),))
    program = portable.capture(model, (torch.randn(2, 8),), plan=good)
    loaded = portable.load(program.save(tmp_path / "p.portable"))
    assert loaded.plan == good and not loaded.plan.is_single_device
    assert Plan().is_single_device
