"""portable.optim: every update against eager torch.optim bit for bit (Lion against the paper's
Algorithm 2), traced into portable's opset, parameter groups, torch round trips, and records."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from portable import optim
from portable.capture.decompositions import decompositions
from portable.errors import CaptureError
from portable.opset import lookup
from portable.optim import (
    SGD,
    Adafactor,
    Adam,
    AdamW,
    Lion,
    Optimizer,
    ParamGroup,
    as_optimizer,
    from_torch,
    no_decay_groups,
    to_torch,
)

STEPS = 10
SHAPES = [(7,), (5, 6), (3, 4, 5), ()]  # 1-D, 2-D, 3-D (Adafactor factors the last two), 0-d

# (id, portable optimizer, the torch.optim optimizer it equals over params)
CASES = [
    ("sgd", SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (
        "sgd-momentum-decay",
        SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    (
        "sgd-dampening",
        SGD(lr=0.1, momentum=0.8, dampening=0.3),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, dampening=0.3),
    ),
    (
        "sgd-nesterov",
        SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    ),
    ("adam", Adam(lr=1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
    (
        "adam-l2-amsgrad",
        Adam(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True),
        lambda p: torch.optim.Adam(
            p, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True
        ),
    ),
    ("adamw", AdamW(lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2)),
    (
        "adamw-amsgrad",
        AdamW(lr=3e-2, weight_decay=0.3, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=3e-2, weight_decay=0.3, amsgrad=True),
    ),
    ("adafactor", Adafactor(lr=1e-2), lambda p: torch.optim.Adafactor(p, lr=1e-2)),
    (
        "adafactor-decay-clip",
        Adafactor(lr=0.5, beta2_decay=-0.6, eps=(1e-20, 1e-2), d=1.2, weight_decay=0.1),
        lambda p: torch.optim.Adafactor(
            p, lr=0.5, beta2_decay=-0.6, eps=(1e-20, 1e-2), d=1.2, weight_decay=0.1
        ),
    ),
]
IDS = [c[0] for c in CASES]


def _data(dtype=torch.float32, seed=0, shapes=SHAPES):
    """Parameters, STEPS gradients for each, and a schedule of lr factors changing every step."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(STEPS)]
    factors = [1.0 - 0.37 * math.sin(t) for t in range(STEPS)]
    return params, grads, factors


def _torch_steps(opt, tensors, grads, lrs):
    """Step a torch optimizer over `tensors` with `grads[t]`, setting each group's lr first."""
    for t, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(tensors, grads[t], strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in tensors]


def _portable_steps(update, opt, params, grads, lrs):
    """`update(param, grad, state, step, lr, weight_decay)` for every step: (params, states)."""
    params = [p.clone() for p in params]
    states = [opt.init_state(p) for p in params]
    for t, lr in enumerate(lrs):
        step, lr_t = torch.tensor(float(t)), torch.tensor(lr, dtype=torch.float64)
        for i, p in enumerate(params):
            params[i], states[i] = update(p, grads[t][i], states[i], step, lr_t, opt.weight_decay)
    return params, states


def _assert_same(mine, states, torch_params, torch_opt):
    for i, (a, b) in enumerate(zip(mine, torch_params, strict=True)):
        assert torch.equal(a, b), f"param {i}: {(a != b).sum()} elements differ"
    for i, p in enumerate(torch_opt.param_groups[0]["params"]):
        theirs = {k: v for k, v in torch_opt.state[p].items() if k != "step"}
        assert set(states[i]) == set(theirs)
        for k, v in states[i].items():
            assert torch.equal(v, theirs[k]), f"param {i} state {k}"


@pytest.mark.parametrize(("name", "opt", "make"), CASES, ids=IDS)
def test_update_is_bit_identical_to_torch_with_a_changing_lr(name, opt, make):
    params, grads, factors = _data()
    lrs = [opt.lr * f for f in factors]
    tensors = [p.clone().requires_grad_() for p in params]
    eager = make(tensors)
    want = _torch_steps(eager, tensors, grads, lrs)
    mine, states = _portable_steps(opt.update, opt, params, grads, lrs)
    _assert_same(mine, states, want, eager)


LOW = [CASES[i] for i in (1, 3, 5, 7, 9)]
# numels that are multiples of 64: for bfloat16, ATen's add(alpha=) rounds differently in its
# vectorized loop (alpha rounded to bfloat16, one fused multiply-add in float32) and its scalar
# remainder loop (bfloat16 arithmetic); `_add_scaled` follows the vectorized loop
VECTOR_SHAPES = [(64,), (8, 16), (2, 4, 16)]


@pytest.mark.parametrize(("name", "opt", "make"), LOW, ids=[c[0] for c in LOW])
def test_bfloat16_parameters_round_as_torch(name, opt, make):
    params, grads, factors = _data(torch.bfloat16, seed=1, shapes=VECTOR_SHAPES)
    lrs = [opt.lr * f for f in factors]
    tensors = [p.clone().requires_grad_() for p in params]
    eager = make(tensors)
    want = _torch_steps(eager, tensors, grads, lrs)
    mine, states = _portable_steps(opt.update, opt, params, grads, lrs)
    _assert_same(mine, states, want, eager)


def _traced(opt, param):
    """`opt.update` for `param`'s shape traced as capture traces it: (graph module, names)."""
    names = list(opt.init_state(param))

    def update(p, g, step, lr, *state):
        new, new_state = opt.update(p, g, dict(zip(names, state, strict=True)), step, lr, 0.25)
        return (new, *(new_state[k] for k in names))

    examples = [torch.empty_like(param), torch.empty_like(param), torch.zeros(())]
    examples += [torch.zeros((), dtype=torch.float64)]
    examples += [torch.empty_like(v) for v in opt.init_state(param).values()]
    table = decompositions(python_only=True)
    return make_fx(update, decomposition_table=table, tracing_mode="fake")(*examples), names


def _assert_in_opset(graph):
    assert not [n for n in graph.nodes if n.op == "get_attr"], "constants in the update"
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        entry = lookup(node.target)
        assert entry is not None, f"{node.target} is not in the opset"
        assert entry.bad_call(len(node.args), node.kwargs) is None, node.format_node()
        first = next((a.meta["val"] for a in node.all_input_nodes if "val" in a.meta), None)
        if isinstance(first, torch.Tensor):
            assert entry.accepts(first.dtype), f"{node.target} on {first.dtype}"


@pytest.mark.parametrize(("name", "opt", "make"), CASES, ids=IDS)
def test_traced_update_is_in_the_opset_and_runs_as_torch(name, opt, make):
    opt = dataclasses.replace(opt, weight_decay=0.25)
    params, grads, factors = _data(seed=2, shapes=[(4, 6)])
    lrs = [opt.lr * f for f in factors]
    graph, names = _traced(opt, params[0])
    _assert_in_opset(graph.graph)

    def run(p, g, state, step, lr, _decay):
        new, *values = graph(p, g, step, lr, *(state[k] for k in names))
        return new, dict(zip(names, values, strict=True))

    tensors = [params[0].clone().requires_grad_()]
    eager = make(tensors)
    for group in eager.param_groups:
        group["weight_decay"] = 0.25
    want = _torch_steps(eager, tensors, grads, lrs)
    mine, states = _portable_steps(run, opt, params, grads, lrs)
    _assert_same(mine, states, want, eager)


# --- Lion: the paper's Algorithm 2, written out eagerly ------------------------------------------


def _lion_reference(params, grads, lrs, beta1, beta2, wd):
    """Chen et al. 2023, Algorithm 2 (decoupled weight decay), with Python-float scalars."""
    params = [p.clone() for p in params]
    moments = [torch.zeros_like(p) for p in params]
    for t, lr in enumerate(lrs):
        for i, (p, m, g) in enumerate(zip(params, moments, grads[t], strict=True)):
            c = beta1 * m + (1 - beta1) * g  # update = interp(g, m, beta1)
            params[i] = p * (1 - lr * wd) - lr * torch.sign(c)
            moments[i] = beta2 * m + (1 - beta2) * g
    return params, moments


@pytest.mark.parametrize(
    "opt", [Lion(), Lion(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.5)], ids=["default", "decay"]
)
def test_lion_matches_the_papers_algorithm(opt):
    params, grads, factors = _data(seed=3)
    lrs = [opt.lr * f for f in factors]
    want, moments = _lion_reference(params, grads, lrs, *opt.betas, opt.weight_decay)
    mine, states = _portable_steps(opt.update, opt, params, grads, lrs)
    for a, b, s, m in zip(mine, want, states, moments, strict=True):
        assert torch.equal(a, b) and torch.equal(s["exp_avg"], m)
    # without decay, the first step moves every element by lr (up to rounding), whatever the
    # gradient's size
    if opt.weight_decay == 0:
        first, _ = opt.update(params[1], grads[0][1], opt.init_state(params[1]), torch.zeros(()))
        moved = (first - params[1]).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, opt.lr), rtol=0, atol=1e-6)


def test_traced_lion_is_in_the_opset_and_runs_as_the_paper():
    opt = Lion(lr=1e-3)
    params, grads, factors = _data(seed=7, shapes=[(4, 6)])
    lrs = [opt.lr * f for f in factors]
    graph, names = _traced(opt, params[0])
    _assert_in_opset(graph.graph)

    def run(p, g, state, step, lr, _decay):
        new, *values = graph(p, g, step, lr, *(state[k] for k in names))
        return new, dict(zip(names, values, strict=True))

    want, moments = _lion_reference(params, grads, lrs, *opt.betas, 0.25)
    mine, states = _portable_steps(run, opt, params, grads, lrs)
    assert torch.equal(mine[0], want[0]) and torch.equal(states[0]["exp_avg"], moments[0])


def test_lion_eager_optimizer_steps_as_update_and_reads_back():
    opt = Lion(lr=1e-2, weight_decay=0.1, groups=(ParamGroup(names=("b",), lr=3e-2),))
    params, grads, _ = _data(seed=4, shapes=[(3, 4), (4,)])
    named = {"w": params[0].clone().requires_grad_(), "b": params[1].clone().requires_grad_()}
    eager = to_torch(opt, named)
    for t in range(STEPS):
        for p, g in zip(named.values(), grads[t], strict=True):
            p.grad = g.clone()
        eager.step()
    for i, (lr, p) in enumerate([(1e-2, named["w"]), (3e-2, named["b"])]):
        want, _ = _lion_reference(
            [params[i]], [[g[i]] for g in grads], [lr] * STEPS, 0.9, 0.99, 0.1
        )
        assert torch.equal(p.detach(), want[0])
    copy = {k: v.detach().clone().requires_grad_() for k, v in named.items()}
    back = from_torch(to_torch(opt, copy), copy)
    assert isinstance(back, Lion) and back.betas == opt.betas and back.lr == opt.lr
    assert [back.group_hyper(back.group_of(n)) for n in named] == [(1e-2, 0.1), (3e-2, 0.1)]


# --- the kernel mirrors: a float64 lr tensor rounds as torch's Python float ----------------------


LRS = [1e-3, 3e-4 * 0.37, 0.1 / 3, 2.0**-20 * 3.3, 0.0123456789]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scalar_tensors_round_as_the_python_floats_torch_passes(dtype):
    g = torch.Generator().manual_seed(5)
    n = 1037 if dtype == torch.float32 else 1024  # bfloat16: see VECTOR_SHAPES
    x, y = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    z = (torch.rand(n, generator=g) + 0.1).to(dtype)
    for lr in LRS:
        t = torch.tensor(lr, dtype=torch.float64)
        assert torch.equal(optim._mul(x, 1 - t * 0.1), x.mul(1 - lr * 0.1))
        assert torch.equal(optim._div(x, t), x.div(lr))
        assert torch.equal(optim._add_scaled(x, y, -t), x.add(y, alpha=-lr))
        assert torch.equal(optim._addcdiv(x, y, z, -t), x.addcdiv(y, z, value=-lr))
    for w in [0.0, 1e-3, 0.1, 0.4999, 0.5, 0.574, 0.9, 1.0]:
        assert torch.equal(optim._lerp(x, y, torch.tensor(w, dtype=torch.float64)), x.lerp(y, w))


def test_python_pow_is_not_torch_sqrt():
    # Python's t ** 0.5 (C pow) differs from sqrt(t) at t = 2921, 3541, ...: torch.optim
    # computes bias_correction2 ** 0.5 and Adafactor's 1 / step ** 0.5 with Python's pow.
    # (on 0-d tensors, as the optimizers use it: ATen's vectorized pow is another function)
    steps = [torch.tensor(float(v), dtype=torch.float64) for v in range(1, 4000)]
    assert [float(t.pow(0.5)) for t in steps] != [float(t) ** 0.5 for t in steps]
    for exponent in (0.5, -0.8, -0.5):
        assert [float(optim._pow(t, exponent)) for t in steps] == [
            float(t) ** exponent for t in steps
        ]
    assert [float(optim._pow(0.999, t)) for t in steps] == [0.999 ** float(t) for t in steps]


# --- parameter groups ---------------------------------------------------------------------------

NAMES = [
    "wte.weight",
    "wpe.weight",
    "h.0.ln_1.weight",
    "h.0.attn.c_attn.weight",
    "h.0.attn.c_attn.bias",
    "h.10.mlp.fc.weight",
    "norm.weight",
    "head.weight",
]


@pytest.mark.parametrize(
    "pattern",
    [r"bias", r"^h\.0\.", r"weight$", r"h\.\d+\.mlp", r"(ln_|norm)", r"^head\.weight$", "c_attn"],
)
def test_a_pattern_finds_names_as_re_search(pattern):
    group = ParamGroup(pattern=pattern, lr_scale=0.5)
    for name in NAMES:
        assert group.matches(name) == (re.search(pattern, name) is not None), name


def test_first_matching_group_wins_and_the_rest_are_the_default_group():
    opt = AdamW(
        lr=1e-3,
        weight_decay=0.1,
        groups=(
            ParamGroup(names=("head.weight",), lr=5e-3),
            ParamGroup(pattern=r"^h\.0\.", lr_scale=0.5),
            *no_decay_groups(),
        ),
    )
    groups = {n: opt.group_of(n) for n in NAMES}
    assert groups == {
        "wte.weight": 3,
        "wpe.weight": 3,
        "h.0.ln_1.weight": 2,  # the h.0 group comes first
        "h.0.attn.c_attn.weight": 2,
        "h.0.attn.c_attn.bias": 2,
        "h.10.mlp.fc.weight": 0,
        "norm.weight": 3,
        "head.weight": 1,
    }
    assert [opt.group_hyper(i) for i in range(4)] == [
        (1e-3, 0.1),
        (5e-3, 0.1),
        (5e-4, 0.1),
        (1e-3, 0.0),
    ]
    with pytest.raises(CaptureError, match="has no parameter group 4"):
        opt.group_hyper(4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pattern": r"(a)\1"}, "is not a pattern portable matches safely"),
        ({"pattern": r"(?=x)y"}, "is not a pattern portable matches safely"),
        ({"pattern": r"a)|(b"}, "is not a pattern portable matches safely"),
        ({"pattern": "(unclosed"}, "is not a pattern portable matches safely"),
        ({"pattern": 3}, r"ParamGroup\(pattern=3\) is not a regular expression"),
        ({}, "by pattern or by names, got neither"),
        ({"pattern": "x", "names": ("y",)}, "got both"),
        ({"names": "fc.weight"}, "is not a tuple of non-empty parameter names"),
        ({"names": ("",)}, "is not a tuple of non-empty parameter names"),
        ({"pattern": "x", "lr": 1e-3, "lr_scale": 2.0}, "gives the group's lr twice"),
        ({"pattern": "x", "lr": -1.0}, r"ParamGroup\(lr=-1.0\) is not a finite number"),
        ({"pattern": "x", "lr_scale": math.inf}, r"lr_scale=inf\) is not a finite number"),
        ({"pattern": "x", "weight_decay": math.nan}, r"weight_decay=nan\)"),
    ],
)
def test_bad_groups_are_refused_with_a_fix(kwargs, message):
    with pytest.raises(CaptureError, match=message) as info:
        ParamGroup(**kwargs)
    assert "fix:" in str(info.value)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.fc1 = torch.nn.Linear(4, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.fc2 = torch.nn.Linear(6, 3)


def _three_groups(model, cls=torch.optim.AdamW, **kwargs):
    return cls(
        [
            {"params": [model.fc1.weight, model.fc2.weight], "lr": 2e-3, "weight_decay": 0.1},
            {"params": [model.fc1.bias, model.fc2.bias, *model.norm.parameters()]},
            {"params": list(model.embed.parameters()), "lr": 5e-4, "weight_decay": 0.3},
        ],
        lr=1e-3,
        weight_decay=0.0,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.AdamW, {"amsgrad": True}),
        (torch.optim.Adam, {"betas": (0.8, 0.9)}),
        (torch.optim.SGD, {"momentum": 0.9}),
        (torch.optim.Adafactor, {}),
    ],
)
def test_torch_groups_become_named_groups_and_step_the_same(cls, kwargs):
    torch.manual_seed(0)
    model = _Model()
    named = dict(model.named_parameters())
    eager = _three_groups(model, cls, **kwargs)
    opt = from_torch(eager, named)
    where = {"fc1.weight": 1, "fc2.weight": 1, "embed.weight": 3}
    for name in named:
        index = opt.group_of(name)
        assert index == where.get(name, 2), name
        group = eager.param_groups[index - 1]
        assert opt.group_hyper(index) == (group["lr"], group["weight_decay"])
    # to_torch of the portable optimizer steps as the original, on a copy of the model
    copy = {n: p.detach().clone().requires_grad_() for n, p in named.items()}
    again = to_torch(opt, copy)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for name, p in named.items():
            p.grad = torch.randn(p.shape, generator=g)
            copy[name].grad = p.grad.clone()
        eager.step()
        again.step()
    for name, p in named.items():
        assert torch.equal(p.detach(), copy[name].detach()), name


def test_a_scheduled_optimizer_reads_its_base_lr():
    model = _Model()
    eager = _three_groups(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(eager, lambda step: 0.1 * (step + 1))
    eager.step()  # no gradients: no state, but torch wants a step before the scheduler's
    scheduler.step()
    assert eager.param_groups[0]["lr"] != 2e-3  # the scheduler moved it
    opt = from_torch(eager, dict(model.named_parameters()))
    assert opt.lr == 2e-3 and opt.group_hyper(3) == (5e-4, 0.3)
    with pytest.raises(CaptureError, match="LambdaLR is a learning-rate scheduler") as info:
        as_optimizer(scheduler)
    assert "schedule=" in str(info.value)


def test_torch_optimizer_refusals_name_the_problem():
    model = _Model()
    named = dict(model.named_parameters())
    eager = _three_groups(model)
    eager.param_groups[2]["betas"] = (0.5, 0.9)
    eager.param_groups[1]["eps"] = 1e-5
    with pytest.raises(CaptureError, match="parameter groups differ in betas, eps") as info:
        from_torch(eager, named)
    assert "fix: give every group the same betas, eps" in str(info.value)
    mixed = _three_groups(model, torch.optim.Adam)
    mixed.param_groups[0]["decoupled_weight_decay"] = True
    with pytest.raises(CaptureError, match="groups differ in decoupled_weight_decay"):
        from_torch(mixed, named)
    with pytest.raises(CaptureError, match="naming their parameters needs the model's"):
        from_torch(_three_groups(model))
    with pytest.raises(CaptureError, match="AdamW holds 5 of the model's 7 trainable"):
        from_torch(
            torch.optim.AdamW(
                list(model.fc1.parameters()) + [*model.fc2.parameters(), model.norm.weight]
            ),
            named,
        )
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    stepped.step()
    with pytest.raises(CaptureError, match="SGD has state from earlier steps"):
        from_torch(stepped, named)
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *_: None)
    with pytest.raises(CaptureError, match="SGD has step hooks"):
        from_torch(hooked, named)
    with pytest.raises(CaptureError, match="optimizer RMSprop is not supported"):
        from_torch(torch.optim.RMSprop(model.parameters()), named)
    with pytest.raises(CaptureError, match=r"Adam\(maximize=True\) is not supported"):
        from_torch(torch.optim.Adam(model.parameters(), maximize=True), named)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: torch.optim.AdamW(p, fused=True), r"AdamW\(fused=True\)"),
        (lambda p: torch.optim.SGD(p, fused=True), r"SGD\(fused=True\)"),
        (lambda p: torch.optim.Adam(p, capturable=True), r"Adam\(capturable=True\)"),
        (lambda p: torch.optim.AdamW(p, differentiable=True), r"AdamW\(differentiable=True\)"),
        (lambda p: torch.optim.Adafactor(p, foreach=True), r"Adafactor\(foreach=True\)"),
    ],
)
def test_flags_that_round_differently_are_refused(make, message):
    model = _Model()
    with pytest.raises(CaptureError, match=message) as info:
        from_torch(make(model.parameters()), dict(model.named_parameters()))
    assert "=False (the default for-loop implementation)" in str(info.value)


@pytest.mark.parametrize(
    ("opt", "make"),
    [
        (
            SGD(lr=0.1, momentum=0.9, weight_decay=0.1),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=True),
        ),
        (
            SGD(lr=0.1, momentum=0.9, nesterov=True),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, differentiable=True),
        ),
        (
            Adam(lr=1e-2, weight_decay=0.1, amsgrad=True),
            lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=True),
        ),
        (
            AdamW(lr=1e-2, weight_decay=0.1),
            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
        ),
    ],
    ids=["sgd-foreach", "sgd-differentiable", "adam-foreach", "adamw-foreach"],
)
def test_accepted_flags_give_the_for_loops_bits(opt, make):
    params, grads, factors = _data(seed=6)
    lrs = [opt.lr * f for f in factors]
    tensors = [p.clone() for p in params]  # differentiable: leaves without requires_grad
    eager = make(tensors)
    assert type(from_torch(eager)) is type(opt)
    want = _torch_steps(eager, tensors, grads, lrs)
    mine, states = _portable_steps(opt.update, opt, params, grads, lrs)
    _assert_same(mine, states, want, eager)


def test_torch_adam_maps_by_its_weight_decay():
    p = [torch.zeros(3, requires_grad=True)]
    assert type(from_torch(torch.optim.Adam(p))) is AdamW  # no decay: the same steps
    assert type(from_torch(torch.optim.Adam(p, weight_decay=0.1))) is Adam
    decoupled = from_torch(torch.optim.Adam(p, weight_decay=0.1, decoupled_weight_decay=True))
    assert type(decoupled) is AdamW and decoupled.weight_decay == 0.1
    assert from_torch(torch.optim.Adafactor(p, eps=(1e-30, 1e-3))).eps == (1e-30, 1e-3)


def test_to_torch_needs_names_for_groups():
    opt = SGD(groups=no_decay_groups())
    with pytest.raises(CaptureError, match="to_torch was given unnamed tensors"):
        to_torch(opt, [torch.zeros(2, requires_grad=True)])
    plain = to_torch(SGD(lr=0.5), [torch.zeros(2, requires_grad=True)])
    assert isinstance(plain, torch.optim.SGD) and plain.param_groups[0]["lr"] == 0.5


def test_as_optimizer_refuses_other_objects():
    assert as_optimizer(opt := Lion()) is opt
    with pytest.raises(CaptureError, match="got str") as info:
        as_optimizer("adam")
    assert "fix:" in str(info.value)


# --- Adafactor's factored state -------------------------------------------------------------------


def test_adafactor_state_is_factored_over_the_last_two_dims():
    opt = Adafactor()
    assert {k: tuple(v.shape) for k, v in opt.init_state(torch.zeros(7)).items()} == {
        "variance": (7,)
    }
    state = opt.init_state(torch.zeros(2, 3, 4))
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "row_var": (2, 3, 1),
        "col_var": (2, 1, 4),
    }
    assert list(state) == [k for k in opt.state_names if k in state]


# --- records --------------------------------------------------------------------------------------

ALL = [
    SGD(lr=0.3, momentum=0.9, nesterov=True),
    Adam(lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1, amsgrad=True),
    AdamW(groups=no_decay_groups()),
    Adafactor(eps=(None, 1e-2), groups=(ParamGroup(names=("a", "b"), lr=1.0, weight_decay=0.5),)),
    Lion(betas=(0.95, 0.98), groups=(ParamGroup(pattern="^x", lr_scale=0.1),)),
]


@pytest.mark.parametrize("opt", ALL, ids=[o.kind for o in ALL])
def test_records_round_trip_through_json(opt):
    record = json.loads(json.dumps(opt.to_dict()))
    back = Optimizer.from_dict(record)
    assert back == opt and type(back) is type(opt)
    assert [back.group_of(n) for n in ("a", "x.bias", "fc.bias")] == [
        opt.group_of(n) for n in ("a", "x.bias", "fc.bias")
    ]


def test_records_written_before_groups_load():
    old_adamw = {
        "kind": "adamw",
        "lr": 0.001,
        "betas": [0.9, 0.999],
        "eps": 1e-08,
        "weight_decay": 0.01,
    }
    old_sgd = {
        "kind": "sgd",
        "lr": 0.01,
        "momentum": 0.9,
        "dampening": 0.0,
        "weight_decay": 0.0,
        "nesterov": False,
    }
    assert Optimizer.from_dict(old_adamw) == AdamW()
    assert Optimizer.from_dict(old_sgd) == SGD(momentum=0.9)
    assert Optimizer.from_dict(dict(old_adamw, betas=(0.9, 0.999))).groups == ()


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ([("kind", "sgd")], "unknown optimizer kind None"),
        ({"kind": "rmsprop"}, "unknown optimizer kind 'rmsprop'"),
        ({"kind": ["sgd"]}, r"unknown optimizer kind \['sgd'\]"),
        ({"kind": "sgd", "lr": 0.1, "__class__": "x"}, "unknown field.*'__class__'"),
        ({"kind": "sgd", "lr": "0.1"}, r"SGD\(lr='0.1'\) is not a finite number"),
        ({"kind": "sgd", "lr": True}, r"SGD\(lr=True\) is not a finite number"),
        ({"kind": "sgd", "lr": math.nan}, r"SGD\(lr=nan\)"),
        ({"kind": "sgd", "lr": 1e400}, r"SGD\(lr=inf\)"),
        ({"kind": "sgd", "lr": 10**400}, r"SGD\(lr=1000.*\) is not a finite number"),
        ({"kind": "lion", "groups": [{"names": ["x"], "kind": "y"}]}, "unknown field.*'kind'"),
        ({"kind": "sgd", "lr": 10**5000}, r"SGD\(lr=<a int>\) is not a finite number"),
        ({"kind": "sgd", "nesterov": 1}, r"SGD\(nesterov=1\) is not True or False"),
        ({"kind": "sgd", "nesterov": True}, "nesterov needs momentum > 0"),
        ({"kind": "adamw", "betas": [0.9]}, r"AdamW\(betas=\[0.9\]\) is not a pair"),
        (
            {"kind": "adamw", "betas": [0.9, 1.0]},
            r"AdamW\(betas=1.0\) is not a finite number in \[0, 1\)",
        ),
        ({"kind": "adam", "amsgrad": "yes"}, r"Adam\(amsgrad='yes'\)"),
        ({"kind": "adafactor", "eps": [1e-30, None]}, r"Adafactor\(eps="),
        (
            {"kind": "adafactor", "d": 0.5},
            r"Adafactor\(d=0.5\) is not a finite number in \[1, inf\]",
        ),
        ({"kind": "adafactor", "beta2_decay": 0.8}, r"beta2_decay=0.8\)"),
        ({"kind": "lion", "betas": [0.9, 1.5]}, r"Lion\(betas=1.5\)"),
        ({"kind": "lion", "groups": {"pattern": "x"}}, r"Lion\(groups=\{'pattern': 'x'\}\)"),
        ({"kind": "lion", "groups": ["x"]}, "a parameter group record is not a mapping but str"),
        ({"kind": "lion", "groups": [{"pattern": "x", "eval": 1}]}, "unknown field.*'eval'"),
        ({"kind": "lion", "groups": [{"pattern": "(a+)+\\1"}]}, "not a pattern portable matches"),
        ({"kind": "lion", "groups": [{"pattern": "a" * 5000}]}, "not a pattern portable matches"),
        ({"kind": "lion", "groups": [{"names": [1, 2]}]}, r"ParamGroup\(names=\[1, 2\]\)"),
        ({"kind": "lion", "groups": [{"names": ["x"], "lr": [1]}]}, r"ParamGroup\(lr=\[1\]\)"),
        ({"kind": "sgd", "lr": "x" * 10_000}, r"SGD\(lr='xxxx.*\.\.\.\) is not"),
    ],
)
def test_hostile_records_raise_typed_errors(record, message):
    with pytest.raises(CaptureError, match=message):
        Optimizer.from_dict(record)
