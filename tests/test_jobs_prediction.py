"""The planner's prediction of a job's step beside what the job measured (issue 19, item 5).

A real two-rank cpu job writes RUN/prediction.json when it starts, and its report compares step
time, compute, exposed communication, data wait, MFU and tokens/s with the medians of the
steady steps. The comparison's arithmetic on hand-made numbers; the medians of the last start's
steady steps; the Parallelism each example plan maps to; the measured CPU system.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics

import pytest
import torch

import portable
from portable.errors import JobError
from portable.jobs.prediction import (
    COMPONENTS,
    PREDICTION_FILE,
    compare,
    comparison,
    cpu_system,
    job_parallelism,
    measured,
)
from portable.jobs.report import make_report
from portable.planner.estimate import collective_time
from tests.support.jobs import GPT, GPT_SHAPE, PLANS, REPO, records, tokenize, train

STEPS = 6
KEYS = [key for key, _ in COMPONENTS]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return tokenize(REPO / "docs" / "parallelism.md", tmp_path_factory.mktemp("data") / "t.bin")


@pytest.fixture(scope="module")
def dp2_run(tokens, tmp_path_factory):
    """A GPT job: 6 steps data parallel over two gloo ranks, and its report."""
    run = tmp_path_factory.mktemp("jobs") / "dp2"
    train(GPT, tokens, run, *GPT_SHAPE, "--steps", str(STEPS), "--nproc", "2", "--plan", _plan())
    return run, make_report(run).summary


def _plan(name: str = "dp2") -> str:
    return f"{PLANS}:{name}"


# --------------------------------------------------------------------------- a real job


def test_the_job_writes_the_prediction_when_it_starts(dp2_run):
    run, _ = dp2_run
    doc = json.loads((run / PREDICTION_FILE).read_text())
    assert (doc["format"], doc["format_version"], doc["first_step"]) == (
        "portable-prediction",
        1,
        1,
    )
    assert "error" not in doc
    assert doc["system"]["name"] == "cpu" and doc["system"]["devices"] == 2
    assert doc["plan"]["describe"] == "tp1 pp1 dp2 mb1 rc:none"
    assert doc["plan"]["overlap_grad_reduce"] is False  # the job waits on each collective at once
    # the CPU peak is the launcher's, split over the two ranks
    peak = json.loads((run / ".job" / "job.json").read_text())["cpu_peak_flops"]
    assert doc["peak_flops"] == pytest.approx(peak)
    assert doc["system"]["peak_flops_per_device"] == pytest.approx(peak / 2)
    assert any("assumed" in a for a in doc["assumptions"])
    b = doc["breakdown"]
    predicted = doc["predicted"]
    assert predicted["step_time_s"] == pytest.approx(b["compute"] + b["optimizer"] + b["comm"])
    assert predicted["exposed_comm_s"] == b["dp_comm"] > 0  # the gradients' all-reduce


def test_the_report_compares_each_component(dp2_run):
    run, summary = dp2_run
    section = summary["predicted_vs_measured"]
    assert section["error"] is None and section["system"] == "cpu" and section["devices"] == 2
    assert (section["steady_steps"], section["steady_from"]) == (STEPS - 2, 3)
    rows = {r["component"]: r for r in section["rows"]}
    assert list(rows) == KEYS
    for key in ("step_time_s", "compute_s", "exposed_comm_s", "mfu", "tokens_per_s"):
        p, m = rows[key]["predicted"], rows[key]["measured"]
        assert math.isfinite(p) and p > 0 and math.isfinite(m) and m > 0, (key, p, m)
        assert rows[key]["measured_over_predicted"] == pytest.approx(m / p)
    wait = rows["data_wait_s"]
    assert wait["predicted"] == 0.0 and wait["measured"] >= 0.0
    assert wait["measured_over_predicted"] is None
    # measured: medians of steps 3..6 of metrics.jsonl
    steady = [r for r in records(run / "metrics.jsonl") if r["step"] > 2]
    assert rows["step_time_s"]["measured"] == statistics.median(r["step_time_s"] for r in steady)
    compute = statistics.median(r["step_time_s"] - r["exposed_comm_s"] for r in steady)
    assert rows["compute_s"]["measured"] == pytest.approx(compute)
    # the same in summary.json and summary.md
    written = json.loads((run / "report" / "summary.json").read_text())
    assert written["predicted_vs_measured"] == json.loads(json.dumps(section))
    md = (run / "report" / "summary.md").read_text()
    assert "## Predicted vs measured, per step (the planner)" in md
    assert f"Measured: the median of {STEPS - 2} steady steps, from step 3." in md
    step = rows["step_time_s"]
    line = f"| step time | {step['predicted']:.4g} s | {step['measured']:.4g} s |"
    assert line in md
    assert "| data wait | 0 s |" in md and "- link: assumed: gloo over loopback" in md


# --------------------------------------------------------------------------- the arithmetic


def test_compare_hand_made_numbers():
    predicted = {
        "step_time_s": 0.5,
        "compute_s": 0.4,
        "exposed_comm_s": 0.1,
        "data_wait_s": 0.0,
        "mfu": 0.5,
        "tokens_per_s": 1000.0,
    }
    seen = {
        "step_time_s": 1.0,
        "compute_s": 0.6,
        "exposed_comm_s": 0.4,
        "data_wait_s": 0.02,
        "mfu": 0.25,
        "tokens_per_s": 500.0,
    }
    rows = compare(predicted, seen)
    assert [r["component"] for r in rows] == KEYS
    ratios = [r["measured_over_predicted"] for r in rows]
    assert ratios == pytest.approx([2.0, 1.5, 4.0, None, 0.5, 0.5])
    assert rows[3]["predicted"] == 0.0 and rows[3]["measured"] == 0.02
    # what is missing, not a number, or not finite has no ratio
    odd = compare({"step_time_s": True, "mfu": float("nan")}, {"step_time_s": 1.0, "mfu": 0.1})
    assert all(r["measured_over_predicted"] is None for r in odd)
    assert odd[0]["predicted"] is None and odd[4]["predicted"] is None


def _record(step: int, t: float) -> dict:
    return {
        "step": step,
        "step_time_s": t,
        "exposed_comm_s": t / 4,
        "data_wait_s": 0.01,
        "mfu": 0.1 / t,
        "tokens_per_s": 100 / t,
    }


def test_measured_medians_of_the_last_starts_steady_steps():
    # steps 1-4 ran before a resume at step 4; steps 5-10 after it (5 and 6 are warm-up)
    times = {1: 9.0, 2: 9.0, 3: 9.0, 4: 9.0, 5: 7.0, 6: 7.0, 7: 1.0, 8: 3.0, 9: 2.0, 10: 5.0}
    logged = [_record(k, t) for k, t in reversed(times.items())]  # order does not matter
    values, steady = measured(logged, first_step=5, warmup=2, comm_timed=True)
    assert steady == [7, 8, 9, 10]
    assert values["step_time_s"] == 2.5  # median of 1, 3, 2, 5
    assert values["exposed_comm_s"] == 2.5 / 4 and values["compute_s"] == 2.5 * 3 / 4
    assert values["data_wait_s"] == 0.01
    assert values["mfu"] == pytest.approx(statistics.median(0.1 / t for t in (1, 3, 2, 5)))
    # collectives inside an XLA step are not timed: no compute or communication figure
    values, _ = measured(logged, first_step=5, warmup=2, comm_timed=False)
    assert values["compute_s"] is None and values["exposed_comm_s"] is None
    # two steps or fewer: none dropped
    assert measured(logged[:2], first_step=9, warmup=2, comm_timed=True)[1] == [9, 10]


def test_comparison_of_a_prediction_that_failed_and_of_a_foreign_file():
    failed = {"format": "portable-prediction", "format_version": 1, "first_step": 3}
    section = comparison({**failed, "error": "PlannerError: x"}, [], warmup=2)
    assert section["error"] == "PlannerError: x" and section["rows"] == []
    with pytest.raises(JobError, match="prediction.json is not a portable-prediction"):
        comparison({"format": "something else"}, [], warmup=2)


# --------------------------------------------------------------------------- plan and system


@pytest.fixture(scope="module")
def step_program():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    return portable.capture(
        model,
        (x, y),
        loss_fn=lambda m, x, y: torch.nn.functional.mse_loss(m(x), y),
        optimizer=portable.optim.AdamW(lr=1e-3),
    )


def _example_plan(name: str):
    spec = importlib.util.spec_from_file_location("example_plans", PLANS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


@pytest.mark.parametrize(
    "name, devices, tp, dp, zero",
    [
        ("dp2", 2, 1, 2, 0),
        ("fsdp2", 2, 1, 2, 3),
        ("gpt_tp2", 2, 2, 1, 0),
        ("gpt_dp2_tp2", 4, 2, 2, 0),
    ],
)
def test_the_parallelism_of_each_example_plan(step_program, name, devices, tp, dp, zero):
    plan = job_parallelism(_example_plan(name), devices, step_program)
    assert (plan.tp, plan.dp, plan.zero) == (tp, dp, zero)
    assert (plan.micro_batch, plan.global_batch, plan.pp) == (1, dp, 1)
    assert plan.recompute == "none" and plan.precision == "float32" and plan.grad_bytes == 4
    assert plan.overlap_grad_reduce is False


def test_the_cpu_system_prices_with_the_rates_given(step_program):
    host, assumptions = cpu_system(2e10, 2, "float32", memory_bandwidth=5e9, op_overhead_s=2e-6)
    assert host.peak("float32") == 2e10 and host.hbm_bandwidth == 5e9
    assert host.efficiency.kernel_overhead_s == 2e-6 and not host.efficiency.calibrated
    assert host.level_for(2).level == "node"
    # a 1 MB all-reduce over the 2 ranks: 2 ring steps of 50 us + 2 (n-1)/n x 1 MB at 1 GB/s
    assert collective_time(host, "all_reduce", 1e6, 2, 1) == pytest.approx(2 * 50e-6 + 1e-3)
    assert any("GFLOP/s" in a for a in assumptions) and any("assumed" in a for a in assumptions)
    measured_host, _ = cpu_system(1e10, 1, "float32")  # bandwidth and op time measured here
    assert measured_host.hbm_bandwidth > 1e8 and 0 < measured_host.efficiency.kernel_overhead_s
    with pytest.raises(JobError, match="a CPU peak of"):
        cpu_system(float("nan"), 2, "float32")
