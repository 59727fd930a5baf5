"""The pipeline split pass (portable/passes/pipeline_split.py) on the GPT and Llama examples.

A training step captured with `accumulate=M` is cut into per-stage forward / backward /
zero-bubble / update programs. What is pinned here:

- run in one process (`run_stages`), the stages reproduce the single-device step: the same
  losses (1e-6) and every state tensor (1e-5) over several steps, for 2, 3 and 4 stages, for
  automatic balancing and explicit split points, one stage or several per rank;
- run as ranks would (each stage keeps only its own state, tied gradients summed across the
  stages that hold the parameter), they still do;
- the stage structure: one activation forward and one gradient back across every cut, the
  GPT head's gradient (tied to the embedding) summed over the first and last stage, each layer's
  parameters held by its stage only, layers balanced evenly;
- the zero-bubble halves (`backward_input`, then `backward_weight` from its stash) compute what
  `backward` computes;
- what the pass refuses, as PlanError naming the problem and the fix.

The models are small (4 layers, 64 wide, batch 8 x 16 tokens, 4 micro-batches) and each is
captured once per module. PORTABLE_SLOW=full runs the slow test's 8-layer, 8-stage form.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import portable
from portable import Mesh, Pipeline, Plan, PlanError
from portable.ir.program import Program, ProgramKind
from portable.ir.signature import InputKind
from portable.passes.pipeline_reference import run_stages
from portable.passes.pipeline_split import (
    PipelineStages,
    StagePrograms,
    balance,
    layer_modules,
    split_stages,
)
from tests.support.examples import load_example

FULL = os.environ.get("PORTABLE_SLOW") == "full"
ACCUMULATE = 4  # micro-batches per step
BATCH, SEQ, WIDTH, LAYERS = 8, 16, 64, 4
STEPS = 2
LOSS_ATOL = 1e-6
STATE_ATOL = 1e-5


def _next_token_loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor):
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


@dataclasses.dataclass
class Captured:
    """One model's training step, its batch and its single-device trajectory (computed once)."""

    step: Program
    batch: tuple[torch.Tensor, ...]
    accumulate: int
    splits: dict = dataclasses.field(default_factory=dict)
    _reference: list[tuple[torch.Tensor, dict, dict]] | None = None

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        names = [spec.name for spec in self.step.signature.user_inputs]
        return dict(zip(names, self.batch, strict=True))

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.step.weights.items()}

    def split(self, pp: int, **pipeline) -> PipelineStages:
        """The stages under Plan(Mesh({"pp": pp}), pipeline=Pipeline(**pipeline)), cut once."""
        key = (pp, tuple(sorted(pipeline.items())))
        if key not in self.splits:
            pipeline.setdefault("microbatches", self.accumulate)
            plan = Plan(Mesh({"pp": pp}), pipeline=Pipeline(**pipeline))
            self.splits[key] = split_stages(self.step.replace(plan=plan))
        return self.splits[key]

    def reference(self, steps: int) -> list[tuple[torch.Tensor, dict, dict]]:
        """(loss, metrics, state) after each of `steps` single-device steps."""
        if self._reference is None or len(self._reference) < steps:
            exe = portable.compile(self.step, backend="cpu")
            exe.state = self.weights()
            self._reference = []
            for _ in range(steps):
                result = exe(*self.batch)
                self._reference.append((result.loss, dict(result.metrics), dict(result.state)))
        return self._reference[:steps]


def _capture(make: Callable[[], torch.nn.Module], batch=BATCH, seq=SEQ, **recipe) -> Captured:
    torch.manual_seed(0)
    model = make()
    vocab = model.lm_head.weight.shape[0]
    inputs = (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))
    recipe.setdefault("accumulate", ACCUMULATE)
    step = portable.capture(
        model,
        inputs,
        loss_fn=_next_token_loss,
        optimizer=portable.optim.AdamW(lr=1e-3),
        **recipe,
    )
    return Captured(step, inputs, recipe["accumulate"])


def _gpt(n_layer: int = LAYERS) -> torch.nn.Module:
    gpt = load_example("gpt")
    return gpt.GPT(gpt.GPTConfig(n_layer=n_layer, n_embd=WIDTH))


def _llama(n_layer: int = LAYERS) -> torch.nn.Module:
    llama = load_example("llama")
    return llama.Llama(llama.LlamaConfig(n_layer=n_layer, dim=WIDTH))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for these tiny tensors: on a 2-core machine shared with other work a
    second thread only spins (ten times slower here), and the results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gpt() -> Captured:
    return _capture(_gpt)


@pytest.fixture(scope="module")
def llama() -> Captured:
    return _capture(_llama)


# --- helpers -----------------------------------------------------------------------------------


def _call(program: Program, env: dict[str, torch.Tensor], exe=None) -> dict[str, torch.Tensor]:
    """Run a stage program on the values its inputs are labelled with (a weight key, a batch
    input's name, `act:` / `res:` / `grad:` / `stash:` / `acc:` names); outputs by name."""
    labels = program.metadata["pipeline"]["inputs"]
    exe = exe or portable.compile(program, backend="cpu")
    outs = exe(*[env[labels[spec.name]] for spec in program.signature.inputs])
    outs = outs if isinstance(outs, tuple) else (outs,)
    return dict(zip([spec.name for spec in program.signature.outputs], outs, strict=True))


def _labels(program: Program) -> set[str]:
    return set(program.metadata["pipeline"]["inputs"].values())


def _output_names(program: Program) -> list[str]:
    return [spec.name for spec in program.signature.outputs]


def _layers(stage: StagePrograms) -> list[int]:
    """The numbers of the `blocks.N` layers whose ops run on `stage`."""
    found = {int(m.group(1)) for path in stage.modules if (m := re.match(r"blocks\.(\d+)", path))}
    return sorted(found)


def _micro_batches(model: Captured) -> list[dict[str, torch.Tensor]]:
    # micro-batch i is rows i, i + M, ... (as the accumulated step slices them)
    m = model.accumulate
    return [{k: v[i::m] for k, v in model.inputs.items()} for i in range(m)]


def _assert_state_close(expected: dict, actual: dict, keys) -> None:
    worst = max(keys, key=lambda k: _diff(expected[k], actual[k]))
    assert _diff(expected[worst], actual[worst]) <= STATE_ATOL, (
        f"{worst}: off by {_diff(expected[worst], actual[worst]):.3g}"
    )


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype == torch.bool:
        return float((a != b).any())
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _assert_matches_the_step(model: Captured, stages: PipelineStages, steps: int) -> None:
    """`run_stages` over `steps` steps against the single-device program's trajectory."""
    state = model.weights()
    for k, (loss, metrics, expected) in enumerate(model.reference(steps)):
        outputs, state = run_stages(stages, state, model.inputs)
        got = outputs[stages.loss_name]
        assert abs(got.item() - loss.item()) <= LOSS_ATOL, f"step {k}: {got} != {loss}"
        for name, value in metrics.items():
            torch.testing.assert_close(outputs[name], value, rtol=0, atol=0)
        assert set(state) == set(expected)
        _assert_state_close(expected, state, expected)


def _run_as_ranks(
    model: Captured, stages: PipelineStages, states: list[dict[str, torch.Tensor]], exes
) -> torch.Tensor:
    """One step with each stage holding only its own state (what separate ranks hold): forward
    micro-batch after micro-batch, backward in reverse, tied gradients summed over the stages
    that hold the parameter, each stage's update writing its own copy. Returns the loss."""
    micro = _micro_batches(model)
    saved, loss = {}, None
    for i, batch in enumerate(micro):
        carried: dict[str, torch.Tensor] = {}
        for s in stages.stages:
            env = {**states[s.index], **batch, **carried}
            outs = _call(s.forward, env, exes[s.index, "forward"])
            carried = {"act:" + k[4:]: v for k, v in outs.items() if k.startswith("out:")}
            saved[s.index, i] = outs
        part = outs[stages.loss_name]
        loss = part if loss is None else loss + part
    summed: dict[tuple[int, str], torch.Tensor] = {}
    for i, batch in enumerate(micro):
        back: dict[str, torch.Tensor] = {}
        for s in reversed(stages.stages):
            env = {**states[s.index], **batch, **saved[s.index, i], **back}
            outs = _call(s.backward, env, exes[s.index, "backward"])
            back = {k: outs[k] for k in s.grads_sent}
            for name in s.param_grads:
                prev = summed.get((s.index, name))
                summed[s.index, name] = outs[name] if prev is None else prev + outs[name]
    for tied in stages.tied:  # the all-reduce over the stages holding the parameter
        total = sum(summed[s, tied.name] for s in tied.stages)
        for s in tied.stages:
            summed[s, tied.name] = total
    target = {out.name: out.target for out in stages.outputs}
    for s in stages.stages:
        env = {**states[s.index], **{f"acc:{n}": summed[s.index, n] for n in s.param_grads}}
        for name, value in _call(s.update, env, exes[s.index, "update"]).items():
            if target.get(name) in states[s.index]:
                states[s.index][target[name]] = value
    assert loss is not None
    return loss


def _assert_ranks_match_the_step(model: Captured, stages: PipelineStages, steps: int) -> None:
    weights = model.weights()
    states = [{k: weights[k].clone() for k in s.state} for s in stages.stages]
    exes = {
        (s.index, part): portable.compile(getattr(s, part), backend="cpu")
        for s in stages.stages
        for part in ("forward", "backward", "update")
    }
    for k, (loss, _, _) in enumerate(model.reference(steps)):
        got = _run_as_ranks(model, stages, states, exes)
        assert abs(got.item() - loss.item()) <= LOSS_ATOL, f"step {k}: {got} != {loss}"
    expected = model.reference(steps)[-1][2]
    for s in stages.stages:
        _assert_state_close(expected, states[s.index], states[s.index])


# --- the stages reproduce the step -------------------------------------------------------------

_CASES = [
    pytest.param("gpt", 2, {}, id="gpt-pp2"),
    pytest.param("gpt", 4, {}, id="gpt-pp4"),
    pytest.param("gpt", 2, {"split_points": ("blocks.1",)}, id="gpt-pp2-at-blocks.1"),
    pytest.param(
        "gpt", 2, {"schedule": "interleaved-1f1b", "virtual_stages": 2}, id="gpt-pp2x2-interleaved"
    ),
    pytest.param("llama", 2, {}, id="llama-pp2"),
    pytest.param("llama", 4, {}, id="llama-pp4"),
    pytest.param(
        "llama", 3, {"split_points": ("blocks.1", "blocks.3")}, id="llama-pp3-at-blocks.1,3"
    ),
]


@pytest.mark.parametrize("model, pp, pipeline", _CASES)
def test_run_stages_matches_the_step(model, pp, pipeline, request):
    captured: Captured = request.getfixturevalue(model)
    _assert_matches_the_step(captured, captured.split(pp, **pipeline), STEPS)


def test_stages_as_separate_ranks_match_the_step(gpt):
    # each stage holds its own copy of the tied head / embedding; the summed gradient keeps the
    # copies identical
    _assert_ranks_match_the_step(gpt, gpt.split(4), STEPS)


def test_an_embedding_only_first_stage_updates_its_tied_weight(gpt):
    stages = gpt.split(2, split_points=("blocks.0",))
    _assert_ranks_match_the_step(gpt, stages, STEPS)


# --- stage structure ---------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_one_activation_crosses_each_cut(model, pp, request):
    captured: Captured = request.getfixturevalue(model)
    split = captured.split(pp)
    stages = split.stages
    assert [s.index for s in stages] == list(range(pp)) and split.ranks == pp
    first, last = stages[0], stages[-1]
    assert first.receives == () and first.grads_sent == ()
    assert last.sends == ()
    for s in stages[1:]:
        assert len(s.receives) == 1 and len(s.grads_sent) == 1, s.index
    for s in stages[:-1]:
        assert len(s.sends) == 1, s.index
    for before, after in itertools.pairwise(stages):
        (sent,) = before.sends
        (received,) = after.receives
        name = sent.removeprefix("out:")
        assert received == f"act:{name}" and after.grads_sent == (f"grad:{name}",)
        assert f"grad:{name}" in _labels(before.backward)  # the gradient comes back to it
        # the residual stream of one micro-batch crosses
        spec = before.forward.signature.outputs[_output_names(before.forward).index(sent)].spec
        assert tuple(spec.shape) == (BATCH // ACCUMULATE, SEQ, WIDTH)
        assert spec.dtype == torch.float32
    # the loss: computed by the last stage's forward only
    assert split.owner[split.loss_name] == pp - 1
    assert [split.loss_name in _output_names(s.forward) for s in stages] == [False] * (pp - 1) + [
        True
    ]
    # every program is an ordinary program taking all its values as user inputs
    for s in stages:
        for part in ("forward", "backward", "backward_input", "backward_weight", "update"):
            program = getattr(s, part)
            assert program.kind is ProgramKind.INFERENCE
            assert all(i.kind is InputKind.USER_INPUT for i in program.signature.inputs)
    # every output of the step is computed by some stage
    assert set(split.owner) == {out.name for out in captured.step.signature.outputs}


@pytest.mark.parametrize("pp", [2, 4])
def test_the_tied_head_gradient_is_summed_over_first_and_last_stage(gpt, pp):
    split = gpt.split(pp)
    (tied,) = split.tied
    assert tied.target == "lm_head.weight" and tied.stages == (0, pp - 1)
    for s in split.stages:
        holds = s.index in tied.stages
        assert (tied.name in s.param_grads) is holds, s.index
        assert ("lm_head.weight" in s.state) is holds, s.index
        assert ("lm_head.weight.updated" in _output_names(s.update)) is holds, s.index
        assert ("lm_head.weight" in s.grad_targets) is holds, s.index


def test_an_untied_head_has_no_tied_gradient(llama):
    split = llama.split(2)
    assert split.tied == ()
    assert "lm_head.weight" in split.stages[-1].state
    assert "lm_head.weight" not in split.stages[0].state
    assert "embed.weight" in split.stages[0].state
    assert "embed.weight" not in split.stages[-1].state


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_automatic_balancing_spreads_layers_evenly(model, pp, request):
    captured: Captured = request.getfixturevalue(model)
    stages = captured.split(pp).stages
    per = LAYERS // pp  # 4 layers over 2 stages: the cut is at blocks.2
    assert [_layers(s) for s in stages] == [list(range(i * per, (i + 1) * per)) for i in range(pp)]
    embedding = "wte" if model == "gpt" else "embed"
    final_norm = "ln_f" if model == "gpt" else "norm"
    assert stages[0].modules[0] == embedding
    assert {final_norm, "lm_head"} <= set(stages[-1].modules)
    # each layer's parameters (and their optimizer state) live on its stage only
    params = [s.target for s in captured.step.signature.inputs_of(InputKind.PARAMETER)]
    for key in params:
        match = re.match(r"blocks\.(\d+)\.", key)
        if match is None:
            continue
        want = int(match.group(1)) // per
        assert [s.index for s in stages if key in s.state] == [want], key
        assert [s.index for s in stages if f"optimizer.{key}.exp_avg" in s.state] == [want], key
        assert [s.index for s in stages if key in s.grad_targets] == [want], key
    # every parameter's gradient is computed somewhere; every weight is held somewhere
    assert set(params) == {t for s in stages for t in s.grad_targets}
    assert set(captured.step.weights) == {k for s in stages for k in s.state}


def test_explicit_split_points_place_the_cuts(gpt, llama):
    assert [_layers(s) for s in gpt.split(2, split_points=("blocks.1",)).stages] == [
        [0],
        [1, 2, 3],
    ]
    assert [_layers(s) for s in llama.split(3, split_points=("blocks.1", "blocks.3")).stages] == [
        [0],
        [1, 2],
        [3],
    ]


def test_interleaved_stages_go_round_the_ranks(gpt):
    split = gpt.split(2, schedule="interleaved-1f1b", virtual_stages=2)
    assert len(split.stages) == 4 and split.ranks == 2
    assert [s.index for s in split.stages_of_rank(0)] == [0, 2]
    assert [s.index for s in split.stages_of_rank(1)] == [1, 3]
    assert [_layers(s) for s in split.stages] == [[0], [1], [2], [3]]
    assert split.tied[0].stages == (0, 3)


# --- zero bubble -------------------------------------------------------------------------------


@pytest.mark.parametrize("model, pp", [("gpt", 4), ("llama", 2)])
def test_zero_bubble_halves_compose_to_the_backward(model, pp, request):
    captured: Captured = request.getfixturevalue(model)
    split = captured.split(pp, schedule="zero-bubble")
    state = captured.weights()
    micro = _micro_batches(captured)[0]
    saved, carried = {}, {}
    for s in split.stages:
        saved[s.index] = _call(s.forward, {**state, **micro, **carried})
        carried = {"act:" + k[4:]: v for k, v in saved[s.index].items() if k.startswith("out:")}
    back: dict[str, torch.Tensor] = {}
    for s in reversed(split.stages):
        env = {**state, **micro, **saved[s.index], **back}
        whole = _call(s.backward, env)
        first = _call(s.backward_input, env)
        # the input half: the gradients the previous stage waits for, then a stash
        names = _output_names(s.backward_input)
        assert tuple(names[: len(s.grads_sent)]) == s.grads_sent
        assert all(n.startswith("stash:") for n in names[len(s.grads_sent) :]), names
        # the weight half: from the stash (and weights / the batch), the parameters' gradients
        labels = _labels(s.backward_weight)
        assert not any(label.startswith(("grad:", "res:", "act:")) for label in labels), labels
        assert tuple(_output_names(s.backward_weight)) == s.param_grads
        second = _call(s.backward_weight, {**state, **micro, **first})
        for name in s.grads_sent:
            torch.testing.assert_close(first[name], whole[name], rtol=0, atol=0)
        for name in s.param_grads:
            torch.testing.assert_close(second[name], whole[name], rtol=0, atol=1e-7)
        back = {k: whole[k] for k in s.grads_sent}
    assert back == {}


# --- refusals ----------------------------------------------------------------------------------


def _refusal(model: Captured, plan: Plan) -> PlanError:
    with pytest.raises(PlanError) as info:
        split_stages(model.step.replace(plan=plan))
    return info.value


def test_a_split_point_naming_no_module(gpt):
    plan = Plan(Mesh({"pp": 2}), pipeline=Pipeline(microbatches=4, split_points=("blocks.9",)))
    err = _refusal(gpt, plan)
    assert "pipeline split point 'blocks.9' names no module the forward pass runs" in err.what
    assert "blocks.0, blocks.1, blocks.2, blocks.3" in str(err.fix)


def test_split_points_out_of_order(gpt):
    pipeline = Pipeline(microbatches=4, split_points=("blocks.3", "blocks.1"))
    err = _refusal(gpt, Plan(Mesh({"pp": 3}), pipeline=pipeline))
    assert "not in forward order: 'blocks.1' runs before 'blocks.3'" in err.what
    assert "order the forward pass runs them" in str(err.fix)


def test_a_cut_inside_a_layer(gpt):
    pipeline = Pipeline(microbatches=4, split_points=("blocks.1.attn",))
    err = _refusal(gpt, Plan(Mesh({"pp": 2}), pipeline=pipeline))
    assert "between the model's repeated layers" in str(err.fix)


def test_micro_batches_must_be_the_accumulation(gpt):
    err = _refusal(gpt, Plan(Mesh({"pp": 2}), pipeline=Pipeline(microbatches=2)))
    assert (
        "the pipeline runs 2 micro-batches per step but the step was captured with accumulate=4"
        in err.what
    )
    assert "accumulate=2" in str(err.fix)


def test_more_stages_than_layers(gpt):
    err = _refusal(gpt, Plan(Mesh({"pp": 5}), pipeline=Pipeline("pp", None, "gpipe", 4)))
    assert "the pipeline has 5 stages but the model has 4 repeated layers" in err.what
    assert "blocks.0, blocks.1, blocks.2, blocks.3" in err.what
    assert "split_points" in str(err.fix)


def test_a_plan_without_a_pipeline(gpt):
    err = _refusal(gpt, Plan(Mesh({"dp": 2}), batch_axes=("dp",)))
    assert "split_stages needs a plan with a pipeline" in err.what


def test_an_inference_program():
    program = portable.capture(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(PlanError) as info:
        split_stages(program.replace(plan=Plan(Mesh({"pp": 2}), pipeline=Pipeline(microbatches=2))))
    assert "this program is an inference program" in info.value.what
    assert "loss_fn=" in str(info.value.fix)


def test_clip_grad_norm_is_refused_naming_the_norm():
    clipped = _capture(lambda: _gpt(2), batch=4, seq=8, accumulate=2, clip_grad_norm=1.0)
    err = _refusal(clipped, Plan(Mesh({"pp": 2}), pipeline=Pipeline(microbatches=2)))
    assert "gradient norm" in err.what
    assert "clip_grad_norm" in str(err.fix)


# --- the balancing helpers ---------------------------------------------------------------------


def _largest(costs: list[float], starts: list[int]) -> float:
    bounds = [*starts, len(costs)]
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def test_balance_examples():
    assert balance([1, 1, 1, 1], 2) == [0, 2]
    assert balance([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert balance([3, 1, 1, 1], 2) == [0, 1]
    assert balance([1, 1, 1, 5], 2) == [0, 3]
    assert balance([1, 2, 3, 4, 5, 6, 7, 8], 1) == [0]
    assert balance([7], 1) == [0]
    # an embedding-heavy first layer and a head-heavy last one
    assert balance([8, 1, 1, 1, 1, 8], 3) == [0, 1, 5]


def test_balance_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        parts = rng.randint(1, n)
        costs = [float(rng.randint(0, 9)) for _ in range(n)]
        starts = balance(costs, parts)
        assert len(starts) == parts and starts[0] == 0
        assert all(a < b for a, b in itertools.pairwise(starts)), (costs, parts, starts)
        best = min(
            _largest(costs, [0, *cuts]) for cuts in itertools.combinations(range(1, n), parts - 1)
        )
        assert _largest(costs, starts) == best, (costs, parts, starts)


def test_balance_needs_a_layer_per_stage():
    with pytest.raises(PlanError, match=r"3 stages need at least 3 layers; the model has 2"):
        balance([1.0, 2.0], 3)


def test_layer_modules():
    paths = ["wte", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.mlp.fc", "ln_f"]
    assert layer_modules(paths) == ["blocks.0", "blocks.1"]
    hf = ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.1", "model.layers.10"]
    assert layer_modules(hf) == ["model.layers.0", "model.layers.1", "model.layers.10"]
    # the module list with the most numbered children wins
    mixed = ["heads.0", "blocks.0", "blocks.1", "blocks.2", "heads.1"]
    assert layer_modules(mixed) == ["blocks.0", "blocks.1", "blocks.2"]
    assert layer_modules(["wte", "lm_head", "<root>"]) == []
    assert layer_modules([]) == []


# --- slow: deeper pipelines --------------------------------------------------------------------


@pytest.mark.slow
def test_deeper_pipelines_as_separate_ranks(request):
    """Separate-rank runs over three steps: the Llama fixture at 4 stages; under
    PORTABLE_SLOW=full, 8-layer GPT and Llama steps of 8 micro-batches at 8 stages (one layer
    each) and at 4 ranks x 2 virtual stages."""
    if not FULL:
        llama: Captured = request.getfixturevalue("llama")
        _assert_ranks_match_the_step(llama, llama.split(4), 3)
        return
    for make in (_gpt, _llama):
        captured = _capture(lambda make=make: make(8), batch=16, accumulate=8)
        for pp, pipeline in [(8, {}), (4, {"schedule": "interleaved-1f1b", "virtual_stages": 2})]:
            split = captured.split(pp, **pipeline)
            assert [_layers(s) for s in split.stages] == [[i] for i in range(8)]
            _assert_ranks_match_the_step(captured, split, 3)
            _assert_matches_the_step(captured, split, 3)
