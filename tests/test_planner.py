"""The planner's cost counting and estimate on a tiny Transformer (costs from its program)."""

from __future__ import annotations

import dataclasses

import pytest

from portable import planner
from portable.errors import PlannerError
from portable.planner.counted import Coeffs, Gemm
from portable.planner.estimate import _rates, _waves

S, H, HEADS, V = 32, 64, 4, 128


@pytest.fixture(scope="module")
def model() -> planner.Transformer:
    return planner.Transformer(layers=2, hidden=H, heads=HEADS, vocab=V, seq=S, name="tiny")


@pytest.fixture(scope="module")
def costs(model: planner.Transformer) -> planner.Costs:
    return planner.costs_of(model)


def test_coeffs_fit_is_exact_for_linear_data() -> None:
    truth = Coeffs(3.0, 5.0, 7.0, 11.0)
    points = [truth.at(b, t) for b, t in ((2, 1), (4, 1), (2, 2), (4, 2))]
    fitted = Coeffs.fit(*points, (2, 4))
    for b, t in ((1, 1), (3, 4), (8, 8)):
        assert fitted.at(b, t) == pytest.approx(truth.at(b, t))


def test_layers_repeat_the_captured_block(costs: planner.Costs, model: planner.Transformer) -> None:
    assert [s.name for s in costs.segments] == ["embed", "layer.0", "layer.1", "head"]
    assert costs.hidden == H and costs.seq == S


def test_model_flops_match_the_transformer_formula(costs: planner.Costs) -> None:
    # per sample, forward + backward: 3 x (24 s h^2 + 4 s^2 h) per layer + 6 s h V for the head
    layer = 3 * (24 * S * H * H + 4 * S * S * H)
    assert costs.model_flops_per_sample == pytest.approx(2 * layer + 6 * S * H * V)


def test_saved_activations_follow_korthikanti(costs: planner.Costs) -> None:
    """Korthikanti et al. 2022: s b h (34 + 5 a s / h) bytes per layer without recomputation,
    34 s b h with selective, 10 + 24 / t (+ 5 a s / (h t)) under TP without sequence parallel;
    2 s b h with full recomputation."""
    layer = costs.layers[0]
    sbh = S * H
    core = 5 * HEADS * S / H
    for b in (1, 4):
        # without recomputation the boolean causal mask (s^2 bytes) is saved too
        assert layer.saved["none"].at(b, 1) / (sbh * b) == pytest.approx(34 + core, abs=0.6)
        assert layer.saved["selective"].at(b, 1) / (sbh * b) == pytest.approx(34)
        assert layer.saved["selective"].at(b, 2) / (sbh * b) == pytest.approx(10 + 12)
        assert layer.saved["none"].at(b, 4) / (sbh * b) == pytest.approx(10 + 6 + core / 4, abs=0.6)
        assert layer.saved["full"].at(b, 1) / (sbh * b) == pytest.approx(2)


def test_tensor_parallel_collectives_are_megatrons(costs: planner.Costs) -> None:
    layer = costs.layers[0]
    kinds = [(c.kind, c.phase) for c in layer.collectives]
    assert kinds == [("all_reduce", "forward")] * 2 + [("all_reduce", "backward")] * 2
    assert layer.collectives[0].bytes.at(3, 8) == 3 * S * H * 2  # the bf16 activation


def test_selective_recomputes_the_core_attention(costs: planner.Costs) -> None:
    layer = costs.layers[0]
    # QK^T and attention over V: 4 b s^2 h FLOPs, split by t
    assert layer.recompute["selective"].flops.at(2, 2) == pytest.approx(4 * 2 * S * S * H / 2)
    assert layer.recompute["full"].flops.at(1, 1) == layer.forward.flops.at(1, 1)


def test_estimate_parts_sum_to_the_step(model: planner.Transformer) -> None:
    system = planner.system("a100-80gb", devices=8)
    est = planner.estimate(
        model, system, planner.Parallelism(tp=2, pp=2, global_batch=16, recompute="selective")
    )
    parts = est.breakdown
    total = parts.compute + parts.comm + parts.bubble + parts.optimizer
    assert est.step_time_s == pytest.approx(total)
    assert est.plan.dp == 2 and est.plan.micro_batch is not None
    assert 0 < est.mfu < 1 and est.fits
    assert est.memory_per_device_bytes == pytest.approx(est.memory.total)
    assert est.tokens_per_s == pytest.approx(16 * S / est.step_time_s)


def test_more_recomputation_trades_time_for_memory(model: planner.Transformer) -> None:
    system = planner.system("h100", devices=8)
    runs = {
        rc: planner.estimate(
            model, system, planner.Parallelism(tp=8, global_batch=8, micro_batch=8, recompute=rc)
        )
        for rc in ("none", "selective", "full")
    }
    assert runs["none"].memory.activations > runs["selective"].memory.activations
    assert runs["selective"].memory.activations > runs["full"].memory.activations
    assert runs["none"].step_time_s < runs["selective"].step_time_s < runs["full"].step_time_s


def test_bubble_follows_the_schedule_formula(model: planner.Transformer) -> None:
    system = planner.system("h100", devices=2)
    est = planner.estimate(model, system, planner.Parallelism(pp=2, global_batch=4, micro_batch=1))
    ideal = est.breakdown.compute + est.breakdown.tp_comm
    # (p - 1) / m of the ideal time, m = 4 micro-batches (slowest stage)
    assert est.breakdown.bubble == pytest.approx(ideal / 4, rel=0.35)


def test_search_ranks_fitting_plans(model: planner.Transformer) -> None:
    found = planner.search(model, planner.system("h100", devices=8), 32, top=5)
    assert found and all(e.fits for e in found)
    times = [e.step_time_s for e in found]
    assert times == sorted(times)


def test_bad_plans_are_typed_errors(model: planner.Transformer) -> None:
    system = planner.system("h100", devices=8)
    with pytest.raises(PlannerError, match="does not divide"):
        planner.estimate(model, system, planner.Parallelism(tp=3, global_batch=8))
    with pytest.raises(PlannerError, match="sequence parallel"):
        planner.Parallelism(sequence_parallel=True)
    with pytest.raises(PlannerError, match="recompute"):
        planner.Parallelism(recompute="sometimes")
    with pytest.raises(PlannerError, match="layers do not split"):
        planner.estimate(model, system, planner.Parallelism(pp=4, dp=2, global_batch=8))
    with pytest.raises(PlannerError, match="not a multiple of heads"):
        dataclasses.replace(model, heads=5)


def test_experts_add_routed_work_and_split_over_ep(costs: planner.Costs) -> None:
    from portable.planner.estimate import price

    system = planner.system("h100", devices=8)
    moe = dataclasses.replace(costs, experts=8, routed=2)
    plan = planner.Parallelism(dp=8, global_batch=8, micro_batch=1)
    dense = price(costs, system, plan)
    one = price(moe, system, plan, experts=8, routed=2)
    split = price(moe, system, dataclasses.replace(plan, ep=8), experts=8, routed=2)
    assert one.breakdown.compute > dense.breakdown.compute  # two experts per token
    assert split.memory.parameters < one.memory.parameters  # experts spread over ep
    assert split.breakdown.ep_comm > 0 and one.breakdown.ep_comm == 0


def test_wave_quantization_of_a_matmul() -> None:
    """A product whose output tiles fill whole waves of the A100's 108 SMs runs at the rate;
    one tile more opens a second wave that is nearly empty (NVIDIA's wave quantization)."""
    rates = _rates(planner.system("a100-80gb", devices=1), "bfloat16")

    def product(rows: float, cols: float) -> Gemm:
        return Gemm(Coeffs(), Coeffs(), Coeffs(rep=1.0), Coeffs(rep=rows), Coeffs(rep=cols))

    assert _waves(product(256 * 12, 128 * 9), 1, 1, rates) == pytest.approx(1.0)
    assert _waves(product(256 * 12 + 1, 128 * 9), 1, 1, rates) < 0.6
    # a small output: one wave, mostly idle; a tile that is not full loses its padding
    assert _waves(product(256, 128), 1, 1, rates) == pytest.approx(1 / 108)
    assert _waves(product(256 * 108, 64), 1, 1, rates) == pytest.approx(0.5)
    # fused attention has no tile grid
    assert _waves(Gemm(Coeffs(), Coeffs()), 1, 1, rates) == 1.0


def test_counted_matmuls_carry_their_output_tiles(costs: planner.Costs) -> None:
    forward = costs.layers[0].forward.gemms
    assert forward and all(g.rows.at(2, 1) > 0 and g.cols.at(2, 1) > 0 for g in forward)
    # the first projection (QKV, column-parallel): tokens x 3h, its columns split by TP
    qkv = forward[0]
    assert qkv.batch.at(2, 1) * qkv.rows.at(2, 1) == 2 * S
    assert qkv.cols.at(2, 1) == 3 * H and qkv.cols.at(2, 2) == 3 * H / 2


def test_overlapped_tensor_parallel_backward(model: planner.Transformer) -> None:
    """Megatron's asynchronous TP all-reduce: the backward's column-parallel collectives hide
    behind the weight-gradient matmuls; compute is the same either way."""
    system = planner.system("a100-80gb", devices=8)
    base = planner.Parallelism(tp=8, global_batch=8, micro_batch=8, recompute="none")
    on = planner.estimate(model, system, base)
    off = planner.estimate(model, system, dataclasses.replace(base, overlap_tp_comm=False))
    assert on.breakdown.compute == pytest.approx(off.breakdown.compute)
    assert 0 < on.breakdown.tp_comm < off.breakdown.tp_comm
    assert on.step_time_s < off.step_time_s
