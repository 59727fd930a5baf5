"""portable.schedules: closed forms against torch's schedulers, tracing into the opset, the
archive form under hostile input, and the native schedules' documented formulas."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.optim import lr_scheduler as S

import portable
from portable.errors import ArchiveError, CaptureError
from portable.opset import lookup
from portable.schedules import (
    MAX_DEPTH,
    MAX_MILESTONES,
    MAX_PARTS,
    WSD,
    Constant,
    Cosine,
    ExponentialDecay,
    InverseSqrt,
    Linear,
    LinearDecay,
    LinearWarmup,
    MultiStepDecay,
    Polynomial,
    Schedule,
    Sequence,
    StepDecay,
    as_schedule,
    from_torch,
)

F64 = torch.float64
BASES = (0.1, 0.03, 2.5e-4)  # one optimizer, three parameter groups


def _t(step: float) -> torch.Tensor:
    return torch.tensor(float(step), dtype=F64)


def _optimizer(bases: tuple[float, ...] = BASES) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": b} for b in bases]
    return torch.optim.SGD(groups, lr=bases[0])


def _advance(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[list[float]]:
    """get_last_lr() before each of `steps` optimizer steps (the lr each step runs at)."""
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optimizer.step() without gradients
        for _ in range(steps):
            seen.append([float(lr) for lr in scheduler.get_last_lr()])
            optimizer.step()
            scheduler.step()
    return seen


# ------------------------------------------------------------------- torch schedulers

# name -> (scheduler factory, schedule length: the check covers 3x it)
TORCH = {
    "constant": (lambda o: S.ConstantLR(o, factor=0.5, total_iters=10), 10),
    "constant_0_iters": (lambda o: S.ConstantLR(o, factor=0.25, total_iters=0), 10),
    "linear_warmup": (lambda o: S.LinearLR(o, start_factor=0.1, total_iters=100), 100),
    "linear_to_0": (lambda o: S.LinearLR(o, 1.0, 0.0, total_iters=60), 60),
    "linear_down": (lambda o: S.LinearLR(o, 0.9, 0.05, total_iters=37), 37),
    "linear_0_iters": (lambda o: S.LinearLR(o, 0.3, 1.0, total_iters=0), 10),
    "cosine": (lambda o: S.CosineAnnealingLR(o, T_max=100), 100),
    "cosine_eta_min": (lambda o: S.CosineAnnealingLR(o, T_max=50, eta_min=1e-3), 50),
    "cosine_short": (lambda o: S.CosineAnnealingLR(o, T_max=7, eta_min=0.01), 7),
    "polynomial": (lambda o: S.PolynomialLR(o, total_iters=80, power=2.0), 80),
    "polynomial_sqrt": (lambda o: S.PolynomialLR(o, total_iters=40, power=0.5), 40),
    "polynomial_0_iters": (lambda o: S.PolynomialLR(o, total_iters=0), 10),
    "step": (lambda o: S.StepLR(o, step_size=30, gamma=0.5), 100),
    "multistep": (lambda o: S.MultiStepLR(o, [10, 30, 30, 80], gamma=0.3), 100),
    "exponential": (lambda o: S.ExponentialLR(o, gamma=0.97), 100),
    "sequential_warmup_cosine": (
        lambda o: S.SequentialLR(
            o, [S.LinearLR(o, 0.1, total_iters=20), S.CosineAnnealingLR(o, 80, 1e-4)], [20]
        ),
        100,
    ),
    "sequential_three": (
        lambda o: S.SequentialLR(
            o,
            [S.ConstantLR(o, 0.2, 5), S.ExponentialLR(o, 0.9), S.PolynomialLR(o, 40, 1.5)],
            [10, 30],
        ),
        70,
    ),
    "sequential_restarted_quirks": (  # total_iters=0 parts enter through torch's closed form
        lambda o: S.SequentialLR(
            o, [S.StepLR(o, 3, 0.5), S.ConstantLR(o, 0.5, 0), S.MultiStepLR(o, [0, 4])], [7, 12]
        ),
        20,
    ),
}


def _close(ours: float, theirs: float, base: float) -> bool:
    # 1e-12 relative; where torch's recursion leaves a residue next to an exact 0 of the
    # closed form (LinearLR to end_factor=0), 1e-14 of the base lr
    return abs(ours - theirs) <= 1e-12 * abs(theirs) + 1e-14 * base


@pytest.mark.parametrize("pre_steps", [0, 7], ids=["fresh", "stepped7"])
@pytest.mark.parametrize("name", list(TORCH))
def test_converted_schedule_gives_torchs_lrs(name, pre_steps):
    make, length = TORCH[name]
    optimizer = _optimizer()
    scheduler = make(optimizer)
    _advance(optimizer, scheduler, pre_steps)
    schedule, start = from_torch(scheduler)
    assert start == pre_steps == scheduler.last_epoch
    bases = [group["initial_lr"] for group in optimizer.param_groups]
    for j, lrs in enumerate(_advance(optimizer, scheduler, 3 * length + 3)):
        for base, theirs in zip(bases, lrs, strict=True):
            ours = float(schedule.lr(_t(start + j), base))
            assert _close(ours, theirs, base), (name, start + j, base, ours, theirs)


LONG = 2000
LONG_TORCH = {
    "cosine": (lambda o: S.CosineAnnealingLR(o, LONG), 3 * LONG),
    "linear_to_0": (lambda o: S.LinearLR(o, 1.0, 0.0, LONG), 3 * LONG),
    "polynomial": (lambda o: S.PolynomialLR(o, LONG, 2.0), 3 * LONG),
    "exponential": (lambda o: S.ExponentialLR(o, 0.999), 3 * LONG),
    # With eta_min > 0, torch's recursion rounds lr - eta_min at the floor, and the rise that
    # follows T_max amplifies it (measured: 9e-13 relative at T_max=2000, 3e-11 at 20000, with
    # eta_min / base = 0.04): the 1e-12 claim holds up to T_max there.
    "cosine_eta_min": (lambda o: S.CosineAnnealingLR(o, LONG, 1e-5), LONG + 1),
    "sequential": (
        lambda o: S.SequentialLR(
            o, [S.LinearLR(o, 0.1, total_iters=200), S.CosineAnnealingLR(o, LONG, 1e-5)], [200]
        ),
        LONG + 201,
    ),
}


@pytest.mark.parametrize("name", list(LONG_TORCH))
def test_long_schedules(name):
    make, steps = LONG_TORCH[name]
    optimizer = _optimizer()
    scheduler = make(optimizer)
    schedule, start = from_torch(scheduler)
    epochs = torch.arange(start, start + steps, dtype=F64)
    ours = [schedule.lr(epochs, group["initial_lr"]).tolist() for group in optimizer.param_groups]
    for j, lrs in enumerate(_advance(optimizer, scheduler, steps)):
        for i, theirs in enumerate(lrs):
            assert _close(ours[i][j], theirs, BASES[i]), (name, j, BASES[i], ours[i][j], theirs)


def test_a_scheduler_resumed_from_state_dicts_starts_where_it_was():
    make, length = TORCH["sequential_warmup_cosine"]
    first = _optimizer()
    old = make(first)
    _advance(first, old, 33)
    optimizer = _optimizer()
    scheduler = make(optimizer)
    optimizer.load_state_dict(first.state_dict())
    scheduler.load_state_dict(old.state_dict())
    schedule, start = from_torch(scheduler)
    assert start == 33
    for j, lrs in enumerate(_advance(optimizer, scheduler, length)):
        for group, theirs in zip(optimizer.param_groups, lrs, strict=True):
            assert _close(float(schedule.lr(_t(33 + j), group["initial_lr"])), theirs, 1.0)


def test_a_scheduler_constructed_at_a_later_epoch():
    optimizer = _optimizer()
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    scheduler = S.StepLR(optimizer, step_size=30, last_epoch=9)  # its first step makes it 10
    schedule, start = from_torch(scheduler)
    assert (schedule, start) == (StepDecay(30, 0.1), 10)
    for j, lrs in enumerate(_advance(optimizer, scheduler, 60)):
        assert lrs[0] == pytest.approx(float(schedule.lr(_t(10 + j), BASES[0])), rel=1e-12)


def test_an_lr_that_is_not_the_schedules_is_refused():
    # torch continues from the current lr: a resumed cosine whose optimizer lr was not restored
    optimizer = _optimizer()
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    with pytest.raises(CaptureError, match=r"torch continues from the current lr") as info:
        from_torch(S.CosineAnnealingLR(optimizer, T_max=100, last_epoch=9))
    assert "state_dict" in (info.value.fix or "")
    optimizer = _optimizer()
    scheduler = S.LinearLR(optimizer, 0.1, total_iters=10)
    optimizer.param_groups[1]["lr"] = 0.5  # set by hand
    with pytest.raises(CaptureError, match=r"param group 1's lr is 0.5"):
        from_torch(scheduler)


def test_parts_of_a_sequential_stepped_on_their_own_are_refused():
    optimizer = _optimizer()
    warm, cos = S.LinearLR(optimizer, 0.1, total_iters=5), S.CosineAnnealingLR(optimizer, 10)
    sequential = S.SequentialLR(optimizer, [warm, cos], [5])
    _advance(optimizer, sequential, 2)
    warm.last_epoch += 1
    with pytest.raises(CaptureError, match=r"part 0 \(LinearLR\) should be at epoch 2"):
        from_torch(sequential)


def _lambda(o):
    return S.LambdaLR(o, lambda epoch: 0.9**epoch)


REFUSED = {
    "LambdaLR": (_lambda, "a Python lambda cannot be stored in a program"),
    "LambdaLR_per_group": (
        lambda o: S.LambdaLR(o, [lambda e: 1.0] * len(o.param_groups)),
        "a Python lambda cannot be stored in a program",
    ),
    "MultiplicativeLR": (
        lambda o: S.MultiplicativeLR(o, lambda e: 0.95),
        "a Python lambda cannot be stored in a program",
    ),
    "ReduceLROnPlateau": (lambda o: S.ReduceLROnPlateau(o), "validation metric"),
    "ChainedScheduler": (
        lambda o: S.ChainedScheduler([S.ConstantLR(o), S.ExponentialLR(o, 0.9)]),
        "chained",
    ),
    "CyclicLR": (lambda o: S.CyclicLR(o, 0.01, 0.1), "cycles momentum"),
    "OneCycleLR": (lambda o: S.OneCycleLR(o, 0.1, total_steps=100), "cycles momentum"),
    "CosineAnnealingWarmRestarts": (
        lambda o: S.CosineAnnealingWarmRestarts(o, 10),
        "not converted",
    ),
    "nested_SequentialLR": (
        lambda o: S.SequentialLR(
            o,
            [S.ConstantLR(o), S.SequentialLR(o, [S.ConstantLR(o), S.ExponentialLR(o, 0.9)], [3])],
            [5],
        ),
        "inside a SequentialLR",
    ),
    "in_a_SequentialLR": (
        lambda o: S.SequentialLR(o, [S.ConstantLR(o), _lambda(o)], [5]),
        "a Python lambda",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_a_program_cannot_hold_is_refused_with_the_fix(name):
    make, message = REFUSED[name]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler = make(optimizer)
    with pytest.raises(CaptureError, match=message) as info:
        as_schedule(scheduler)
    assert info.value.fix and (
        "portable.schedules" in (info.value.fix or "") or "flatten" in (info.value.fix or "")
    )


def test_a_subclass_of_a_converted_scheduler_is_refused():
    class Tweaked(S.StepLR):
        def get_lr(self):
            return [lr * 2 for lr in super().get_lr()]

    with pytest.raises(CaptureError, match=r"Tweaked is not one portable converts"):
        from_torch(Tweaked(_optimizer(), step_size=3))


def test_as_schedule():
    assert as_schedule(None) == (Constant(), 0)
    cosine = Cosine(100)
    assert as_schedule(cosine) == (cosine, 0)
    optimizer = _optimizer()
    scheduler = S.ExponentialLR(optimizer, 0.5)
    _advance(optimizer, scheduler, 3)
    assert as_schedule(scheduler) == (ExponentialDecay(0.5), 3)
    with pytest.raises(CaptureError, match=r"cannot be a builtins.int") as info:
        as_schedule(3)  # type: ignore[arg-type]
    assert "portable.schedules.Schedule" in (info.value.fix or "")


# ------------------------------------------------------------------- every class

EXAMPLES: list[Schedule] = [
    Constant(),
    Constant(0.5, 10),
    Linear(0.1, 0.5, 10),
    LinearWarmup(10, 0.1),
    Cosine(100, 1e-4),
    Cosine(20, periodic=True),
    LinearDecay(10, 1e-5),
    Polynomial(10, 2.0, 1e-5),
    StepDecay(10, 0.5),
    MultiStepDecay((3, 5, 5, 12), 0.5),
    MultiStepDecay((), 0.5),
    ExponentialDecay(0.9),
    InverseSqrt(10, 0.01),
    WSD(10, 20, 30, 1e-5, "cosine"),
    WSD(0, 20, 0),
    WSD(5, 5, 5, decay_shape="sqrt", start_factor=0.2),
    Sequence((LinearWarmup(10, 0.1), Cosine(90, 3e-5)), (10,)),
    Sequence((Sequence((Constant(0.1), StepDecay(3)), (2,)), WSD(1, 2, 3)), (7,)),
]


def test_examples_cover_every_kind():
    from portable.schedules import _KINDS

    assert {type(s) for s in EXAMPLES} == set(_KINDS.values())
    assert all(cls.kind == kind for kind, cls in _KINDS.items())


@pytest.mark.parametrize("schedule", EXAMPLES, ids=lambda s: s.kind)
def test_lr_traces_into_the_opset(schedule):
    graph = make_fx(lambda t: schedule.lr(t, 0.1), tracing_mode="fake")(_t(3))
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert [
        n.op for n in graph.graph.nodes if n.op not in ("call_function", "placeholder", "output")
    ] == []
    assert [str(n.target) for n in calls if lookup(n.target) is None] == []
    for step in (0, 1, 9, 10, 11, 29, 30, 31, 60, 99, 100, 250):
        eager = schedule.lr(_t(step), 0.1)
        traced = graph(_t(step))
        assert traced.dtype == F64 and traced.shape == () and torch.equal(traced, eager), step


@pytest.mark.parametrize("schedule", EXAMPLES, ids=lambda s: s.kind)
def test_archive_round_trip(schedule):
    data = json.loads(json.dumps(schedule.to_dict(), allow_nan=False))
    assert data["kind"] == schedule.kind
    back = Schedule.from_dict(data)
    assert back == schedule and type(back) is type(schedule)
    assert back.describe() == schedule.describe()
    steps = torch.arange(0, 300, dtype=F64)
    assert torch.equal(back.lr(steps, 0.1), schedule.lr(steps, 0.1))


def test_lr_is_elementwise_over_a_tensor_of_epochs():
    steps = torch.arange(0, 200, dtype=F64)
    for schedule in EXAMPLES:
        whole = schedule.lr(steps, 0.1)
        one_by_one = torch.stack([schedule.lr(t, 0.1) for t in steps])
        torch.testing.assert_close(whole, one_by_one, rtol=1e-15, atol=0)


def test_lr_checks_its_arguments():
    with pytest.raises(CaptureError, match=r"float64 tensor, got torch.float32") as info:
        Cosine(10).lr(torch.tensor(1.0), 0.1)
    assert "to(torch.float64)" in (info.value.fix or "")
    with pytest.raises(CaptureError, match=r"base_lr must be a finite number"):
        Cosine(10).lr(_t(1), -0.1)
    with pytest.raises(CaptureError, match=r"base_lr must be"):
        Cosine(10).lr(_t(1), float("nan"))


def test_construction_checks_types_and_ranges():
    cases = [
        (lambda: Cosine(0), r"cosine.steps must be an int in \[1, 2\*\*53\], got 0"),
        (lambda: Cosine("10"), r"cosine\.steps must be an int"),  # type: ignore[arg-type]
        (lambda: Cosine(10.0), r"cosine\.steps must be an int"),  # type: ignore[arg-type]
        (lambda: Cosine(True), r"cosine\.steps must be an int"),
        (lambda: Cosine(10, min_lr=float("inf")), r"cosine.min_lr must be a finite number"),
        (lambda: LinearWarmup(10, -0.5), r"linear_warmup.start_factor must be"),
        (lambda: WSD(1, 2, 3, decay_shape="exp"), r"wsd.decay_shape must be one of"),
        (lambda: Sequence((Cosine(3),), (1,)), r"needs 0 milestones, got 1"),
        (lambda: Sequence((Cosine(3), 3), (1,)), r"sequence.schedules\[1\] must be a portable"),  # type: ignore[arg-type]
        (lambda: Sequence((), ()), r"a list of 1 to 64 schedules"),
        (lambda: MultiStepDecay((5, 3)), r"must be non-decreasing, got \[5, 3\]"),
    ]
    for make, message in cases:
        with pytest.raises(CaptureError, match=message):
            make()
    assert Cosine(10, min_lr=0).min_lr == 0.0 and isinstance(Cosine(10, min_lr=0).min_lr, float)
    deep: Schedule = Constant()
    for _ in range(MAX_DEPTH):
        deep = Sequence((deep, Constant()), (1,))
    with pytest.raises(CaptureError, match=r"nested 9 deep"):
        Sequence((deep, Constant()), (1,))


# ------------------------------------------------------------------- hostile archives


def _nested(depth: int) -> dict:
    data: dict = {"kind": "constant"}
    for _ in range(depth):
        data = {"kind": "sequence", "schedules": [data], "milestones": []}
    return data


HOSTILE = {
    "not_a_dict": ([{"kind": "cosine", "steps": 3}], r"must be an object with a 'kind'"),
    "no_kind": ({"steps": 3}, r"unknown schedule kind None"),
    "kind_not_str": ({"kind": ["cosine"], "steps": 3}, r"unknown schedule kind \['cosine'\]"),
    "huge_int_kind": ({"kind": 10**5000}, r"unknown schedule kind <a 16610-bit int>"),
    "unknown_kind": ({"kind": "lambda", "code": "import os"}, r"unknown schedule kind 'lambda'"),
    "unknown_field": ({"kind": "cosine", "steps": 3, "eval": "x"}, r"unknown field\(s\) 'eval'"),
    "non_str_key": ({"kind": "cosine", "steps": 3, 7: 1}, r"unknown field\(s\) 7"),
    "missing_field": ({"kind": "cosine"}, r"has no 'steps'"),
    "str_steps": ({"kind": "cosine", "steps": "100"}, r"\(cosine\)\.steps must be an int"),
    "float_steps": ({"kind": "cosine", "steps": 100.0}, r"\(cosine\)\.steps must be an int"),
    "bool_steps": ({"kind": "cosine", "steps": True}, r"\(cosine\)\.steps must be an int"),
    "negative_steps": ({"kind": "linear_decay", "steps": -5}, r"got -5"),
    "huge_steps": ({"kind": "cosine", "steps": 10**400}, r"got <a 1329-bit int>"),
    "nan": ({"kind": "cosine", "steps": 3, "min_lr": float("nan")}, r"finite number"),
    "inf": ({"kind": "exponential_decay", "gamma": float("inf")}, r"finite number"),
    "null_float": ({"kind": "exponential_decay", "gamma": None}, r"gamma must be a finite"),
    "str_bool": ({"kind": "cosine", "steps": 3, "periodic": "yes"}, r"true or false"),
    "bad_shape": (
        {"kind": "wsd", "warmup": 1, "stable": 1, "decay": 1, "decay_shape": "exp"},
        r"one of",
    ),
    "milestones_not_list": ({"kind": "multistep_decay", "milestones": "1,2"}, r"a list of at most"),
    "milestones_decrease": ({"kind": "multistep_decay", "milestones": [4, 2]}, r"non-decreasing"),
    "milestone_float": ({"kind": "multistep_decay", "milestones": [1, 2.5]}, r"milestones\[1\]"),
    "huge_milestones": (
        {"kind": "multistep_decay", "milestones": list(range(10**6))},
        r"a list of at most 1024",
    ),
    "huge_parts": (
        {"kind": "sequence", "schedules": [{"kind": "constant"}] * 10**5, "milestones": []},
        r"a list of 1 to 64 schedules",
    ),
    "parts_not_dicts": (
        {"kind": "sequence", "schedules": [3], "milestones": []},
        r"schedules\[0\]",
    ),
    "milestone_count": (
        {"kind": "sequence", "schedules": [{"kind": "constant"}], "milestones": [3]},
        r"needs 0 milestones, got 1",
    ),
    "deep": (_nested(10_000), rf"nest more than {MAX_DEPTH} deep"),
    "too_big": (
        {
            "kind": "sequence",
            "schedules": [
                {
                    "kind": "sequence",
                    "schedules": [{"kind": "multistep_decay", "milestones": [1] * MAX_MILESTONES}]
                    * MAX_PARTS,
                    "milestones": [1] * (MAX_PARTS - 1),
                }
            ]
            * MAX_PARTS,
            "milestones": [1] * (MAX_PARTS - 1),
        },
        r"over 4096 parts and milestones",
    ),
    "nested_error_names_its_place": (
        {
            "kind": "sequence",
            "schedules": [{"kind": "constant"}, {"kind": "cosine", "steps": 0}],
            "milestones": [1],
        },
        r"schedule\(sequence\)\.schedules\[1\]\(cosine\)\.steps must be an int",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_archive_data_is_an_archive_error(name):
    data, message = HOSTILE[name]
    with pytest.raises(ArchiveError, match=message) as info:
        Schedule.from_dict(data)
    assert "re-capture" in (info.value.fix or "")


def test_from_dict_does_not_run_constructors_with_capture_errors():
    # the archive path checks with ArchiveError; an accepted dict builds the same object
    assert Schedule.from_dict({"kind": "cosine", "steps": 3, "min_lr": 0}) == Cosine(3, 0.0)


# ------------------------------------------------------------------- native formulas


def _ref_warmup(t, steps, start):
    return start + (1 - start) * min(t, steps) / steps


def _ref_wsd(t, b, warmup, stable, decay, m, shape, start):
    if t < warmup:
        return b * _ref_warmup(t, warmup, start)
    if t < warmup + stable:
        return b
    q = min(t - warmup - stable, decay) / decay
    f = {"linear": 1 - q, "cosine": (1 + math.cos(math.pi * q)) / 2, "sqrt": 1 - math.sqrt(q)}
    return m + (b - m) * f[shape]


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_phases(shape):
    b, m = 3e-4, 3e-5
    schedule = WSD(warmup=10, stable=20, decay=30, min_lr=m, decay_shape=shape, start_factor=0.1)
    for t in [0, 1, 5, 9, 10, 11, 29, 30, 31, 45, 59, 60, 61, 500]:
        want = _ref_wsd(t, b, 10, 20, 30, m, shape, 0.1)
        assert float(schedule.lr(_t(t), b)) == pytest.approx(want, rel=1e-14, abs=0), t
    assert float(schedule.lr(_t(0), b)) == pytest.approx(0.1 * b, rel=1e-15)
    assert float(schedule.lr(_t(10), b)) == b and float(schedule.lr(_t(29), b)) == b
    assert float(schedule.lr(_t(60), b)) == m and float(schedule.lr(_t(10**6), b)) == m


def test_wsd_without_warmup_or_decay():
    schedule = WSD(warmup=0, stable=5, decay=0, min_lr=1e-6)
    assert [float(schedule.lr(_t(t), 0.1)) for t in (0, 4, 5, 9)] == [0.1, 0.1, 1e-6, 1e-6]


def test_warmups_end_at_the_base_lr_and_floors_are_reached_and_held():
    b = 0.02
    assert float(LinearWarmup(100, 0.0).lr(_t(0), b)) == 0.0
    assert float(LinearWarmup(100, 0.1).lr(_t(50), b)) == pytest.approx(b * 0.55, rel=1e-15)
    for steps in (1, 7, 49, 100, 997):
        assert float(LinearWarmup(steps, 0.1).lr(_t(steps), b)) == b
        assert float(LinearWarmup(steps, 0.1).lr(_t(steps + 5), b)) == b
        for floor in (Cosine(steps, 1e-5), LinearDecay(steps, 1e-5), Polynomial(steps, 3.0, 1e-5)):
            assert float(floor.lr(_t(steps), b)) == 1e-5, floor
            assert float(floor.lr(_t(3 * steps), b)) == 1e-5, floor
    cosine = Cosine(100, 1e-5)
    for t in (0, 25, 50, 75):
        want = 1e-5 + (b - 1e-5) * (1 + math.cos(math.pi * t / 100)) / 2
        assert float(cosine.lr(_t(t), b)) == pytest.approx(want, rel=1e-14)
    periodic = Cosine(100, 1e-5, periodic=True)
    assert float(periodic.lr(_t(150), b)) == pytest.approx(float(cosine.lr(_t(50), b)), rel=1e-14)
    assert float(periodic.lr(_t(200), b)) == pytest.approx(b, rel=1e-14)


def test_inverse_sqrt():
    b = 1e-3
    schedule = InverseSqrt(warmup=49, start_factor=0.0)
    assert float(schedule.lr(_t(0), b)) == 0.0
    assert float(schedule.lr(_t(49), b)) == b
    assert float(schedule.lr(_t(4 * 49), b)) == pytest.approx(b / 2, rel=1e-15)
    for t in (10, 48, 50, 1000, 123456):
        want = b * min(t, 49) / 49 if t < 49 else b * math.sqrt(49 / t)
        assert float(schedule.lr(_t(t), b)) == pytest.approx(want, rel=1e-14), t


def test_closed_forms_of_the_decays():
    b = 0.5
    for t in (0, 1, 9, 10, 11, 25, 40):
        assert float(StepDecay(10, 0.3).lr(_t(t), b)) == pytest.approx(
            b * 0.3 ** (t // 10), rel=1e-15
        )
        count = sum(m <= t for m in (3, 10, 10, 25))
        got = float(MultiStepDecay((3, 10, 10, 25), 0.3).lr(_t(t), b))
        assert got == pytest.approx(b * 0.3**count, rel=1e-15)
        assert float(ExponentialDecay(0.9).lr(_t(t), b)) == pytest.approx(b * 0.9**t, rel=1e-14)
        poly = b * (1 - min(t, 20) / 20) ** 2.0
        assert float(Polynomial(20, 2.0).lr(_t(t), b)) == pytest.approx(poly, rel=1e-14, abs=1e-300)
        lin = b * (0.8 + (0.2 - 0.8) * min(t, 20) / 20)
        assert float(Linear(0.8, 0.2, 20).lr(_t(t), b)) == pytest.approx(lin, rel=1e-14)
        const = b * (0.25 if t < 10 else 1.0)
        assert float(Constant(0.25, 10).lr(_t(t), b)) == const


def test_sequence_restarts_each_part_at_its_milestone():
    warm, decay = LinearWarmup(10, 0.1), LinearDecay(40, 1e-4)
    schedule = Sequence((warm, decay, Constant(0.5)), (10, 50))
    for t in range(0, 80):
        part, local = (
            (warm, t) if t < 10 else (decay, t - 10) if t < 50 else (Constant(0.5), t - 50)
        )
        assert torch.equal(schedule.lr(_t(t), 0.1), part.lr(_t(local), 0.1)), t
    repeated = Sequence((Constant(0.1), Constant(0.2), Constant(0.3)), (5, 5))  # bisect_right
    assert [float(repeated.lr(_t(t), 1.0)) for t in (4, 5, 6)] == [0.1, 0.3, 0.3]


def test_describe():
    recipe = Sequence((LinearWarmup(100, 0.1), Cosine(900, 3e-5)), (100,))
    assert (
        recipe.describe()
        == "linear warmup 100 steps from 0.1x, then cosine to 3e-05 over 900 steps"
    )
    late = Sequence((LinearWarmup(100, 0.1), Cosine(900, 3e-5)), (150,))
    assert late.describe().endswith(", then at step 150 cosine to 3e-05 over 900 steps")
    assert WSD(10, 20, 30, 1e-5, "sqrt").describe() == (
        "wsd: linear warmup 10 steps from 0x, stable 20 steps, sqrt decay to 1e-05 over 30 steps"
    )
    for schedule in EXAMPLES:
        text = schedule.describe()
        assert text and "\n" not in text


def test_exported_from_the_package():
    assert portable.schedules.Cosine is Cosine
    assert "schedules" in portable.__all__
