"""The whole recipe under a plan: AdamW with parameter groups (no decay for biases and norms) +
warmup-cosine + clip_grad_norm 1.0 + bfloat16 + accumulate 4 + selective remat, on the GPT and
Llama examples, partitioned for DP=2, TP=2 and FSDP=2 and run on XLA host devices and on
torch.distributed (gloo processes): every run matches the single-device program.

bfloat16 tolerance: a split batch or a split matmul reduces in another order, and a bfloat16
gradient then differs by an ulp (2^-8 relative); AdamW divides each gradient by its own RMS, so
an element whose gradient is that noisy moves up to lr per step either way. Losses are compared
within LOSS_RTOL, parameters within 2 * lr * steps (tests/spmd_cases.py's bound for noise
elements), the global gradient norm within NORM_RTOL; and the float32 program with the same
recipe is held to spmd_cases' 1e-5 (assert_matches), so a missing or doubled reduction, which
moves every element, is caught there.

CI runs GPT on XLA for every plan, Llama FSDP, the float32 GPT DP check and torch.distributed
DP; PORTABLE_SLOW=full runs the whole matrix.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import portable
from portable.passes.spmd_partition import partition
from tests.spmd_cases import STEPS as SPMD_STEPS
from tests.spmd_cases import assert_matches, plan_for, reference, run_on_gloo

STEPS = SPMD_STEPS  # run_on_gloo trains this many
LR = 1e-3
LOSS_RTOL = 1e-3
NORM_RTOL = 1e-2
PLANS = ("dp", "tp", "fsdp")
FULL = os.environ.get("PORTABLE_SLOW") == "full"


def _cases(*always: tuple[str, ...], every: list[tuple[str, ...]]) -> list:
    """Every case under PORTABLE_SLOW=full, else the `always` ones (the rest skipped)."""
    skip = pytest.mark.skip(reason="PORTABLE_SLOW=full runs it")
    return [
        pytest.param(*c, id="-".join(c), marks=() if FULL or c in always else skip) for c in every
    ]


def _recipe_program(spec, compute: str = "bfloat16", accumulate: int = 4):
    torch.manual_seed(0)
    model = spec.build()
    torch.manual_seed(1)
    batch = [torch.cat([b] * 4) for b in spec.batch()]  # 4 micro-batches x dp 2
    no_decay = re.compile(portable.optim.NO_DECAY_PATTERN)
    decay = [p for n, p in model.named_parameters() if not no_decay.search(n)]
    rest = [p for n, p in model.named_parameters() if no_decay.search(n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR
    )
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8, eta_min=1e-5)
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[2])
    program = portable.capture(
        model,
        tuple(batch),
        loss_fn=spec.loss_fn,
        optimizer=opt,
        schedule=schedule,
        clip_grad_norm=1.0,
        precision=portable.Precision(compute=compute),
        accumulate=accumulate,
        remat="selective",
    )
    flat = [program.weights[i.target] for i in program.signature.state_inputs] + batch
    return program, flat


def _assert_close(want, got_losses, got_outputs) -> None:
    want_losses, want_outputs = want
    torch.testing.assert_close(
        torch.stack(list(got_losses)), torch.stack(want_losses), rtol=LOSS_RTOL, atol=0
    )
    torch.testing.assert_close(
        got_outputs["grad_norm"], want_outputs["grad_norm"], rtol=NORM_RTOL, atol=0
    )
    assert float(got_outputs["lr"]) == pytest.approx(float(want_outputs["lr"]), rel=1e-6)
    bound = 2 * LR * STEPS
    for name, value in want_outputs.items():
        if name.endswith(".updated") and not name.startswith(("optimizer.", "amp.", "rng.")):
            torch.testing.assert_close(got_outputs[name], value, atol=bound, rtol=0, msg=name)


_CACHE: dict = {}


def _single_device(spec, stem: str, compute: str):
    if (stem, compute) not in _CACHE:
        program, flat = _recipe_program(spec, compute)
        _CACHE[stem, compute] = program, flat, reference(program, flat, steps=STEPS)
    return _CACHE[stem, compute]


XLA_CASES = [(stem, plan) for stem in ("gpt", "llama") for plan in PLANS]


@pytest.mark.parametrize(
    ("stem", "plan"),
    _cases(("gpt", "dp"), ("gpt", "tp"), ("gpt", "fsdp"), ("llama", "fsdp"), every=XLA_CASES),
)
def test_the_recipe_on_xla_devices_matches_the_single_device_program(stem, plan, example_spec):
    from portable.backends.xla.spmd import run_spmd

    program, flat, want = _single_device(example_spec(stem), stem, "bfloat16")
    per_rank, report = partition(program.replace(plan=plan_for(stem, plan)))
    if plan == "fsdp":
        assert report.counts.get("reduce_scatter[dp]", 0) > 0  # gradients are not all-reduced
    result = run_spmd(per_rank, flat, steps=STEPS)
    outputs = {o.name: v for o, v in zip(per_rank.signature.outputs, result.outputs, strict=True)}
    _assert_close(want, result.losses, outputs)
    if (stem, plan) == ("gpt", "dp"):  # the once-per-step gradient reductions are bucketed
        from portable.passes.comm_overlap import CommOverlap

        overlapped = CommOverlap().apply(per_rank)
        assert overlapped.report.counts["bucketed"] > 0
        again = run_spmd(overlapped.program, flat, steps=STEPS)
        assert all(torch.equal(a, b) for a, b in zip(again.losses, result.losses, strict=True))
        # one reduction per gradient per step, however many micro-batches: with 4, only the
        # loss normalisers (a mean's global count: one float32 scalar each) are reduced per
        # micro-batch
        single, _ = _recipe_program(example_spec(stem), accumulate=1)
        _, once = partition(single.replace(plan=plan_for(stem, plan)))
        extra = report.counts["all_reduce[dp]"] - once.counts["all_reduce[dp]"]
        extra_bytes = report.counts["bytes[all_reduce:dp]"] - once.counts["bytes[all_reduce:dp]"]
        assert extra_bytes == 4 * extra, (extra, extra_bytes)


@pytest.mark.parametrize("plan", _cases(("dp",), every=[(p,) for p in PLANS]))
def test_the_float32_recipe_matches_within_the_parallelism_tolerance(plan, example_spec):
    from portable.backends.xla.spmd import run_spmd

    program, flat, want = _single_device(example_spec("gpt"), "gpt", "float32")
    per_rank, _ = partition(program.replace(plan=plan_for("gpt", plan)))
    result = run_spmd(per_rank, flat, steps=STEPS)
    outputs = {o.name: v for o, v in zip(per_rank.signature.outputs, result.outputs, strict=True)}
    assert_matches("gpt", want, result.losses, outputs)


@pytest.mark.parametrize("plan", _cases(("dp",), every=[(p,) for p in PLANS]))
def test_the_recipe_on_torch_distributed_matches_the_single_device_program(
    plan, example_spec, tmp_path
):
    program, flat, want = _single_device(example_spec("gpt"), "gpt", "bfloat16")
    per_rank, _ = partition(program.replace(plan=plan_for("gpt", plan)))
    losses, outputs = run_on_gloo(program, flat, per_rank, tmp_path)
    _assert_close((want[0], want[1]), losses, {**want[1], **outputs})
    for name in want[1]:
        if name.endswith(".updated") and not name.startswith(("optimizer.", "amp.", "rng.")):
            assert name in outputs, name


def test_the_recipe_lowers_to_neuron_and_cuda(example_spec, tmp_path):
    import json

    program, _, _ = _single_device(example_spec("gpt"), "gpt", "bfloat16")
    portable.lower(program, "neuron:trn3", tmp_path / "neuron")
    manifest = json.loads((tmp_path / "neuron" / "manifest.json").read_text())
    assert manifest["validation"]["errors"] == 0
    hlo = next((tmp_path / "neuron").rglob("graph.hlo.txt")).read_text()
    assert "bf16[" in hlo and "f64[" not in hlo  # bfloat16 compute; float64 downcast
    per_rank, _ = partition(program.replace(plan=plan_for("gpt", "dp")))
    portable.lower(per_rank, "neuron:trn3", tmp_path / "neuron_dp")
    manifest = json.loads((tmp_path / "neuron_dp" / "manifest.json").read_text())
    assert manifest["validation"]["errors"] == 0
    compiled = portable.lower(program, "cuda:sm_90,sm_100", tmp_path / "cuda")
    assert compiled.files
