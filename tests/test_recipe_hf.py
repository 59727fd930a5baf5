"""The training recipe on Hugging Face GPT-2 and Llama against the eager loop (split from
tests/test_recipe.py, whose module doc states the tolerances, so the two files run in parallel)."""

from __future__ import annotations

import pytest
import torch

import portable
from tests.support.recipe_reference import run_eager, run_program
from tests.test_recipe import (
    BF16_LOSS_RTOL,
    BF16_TIGHT,
    STEPS,
    _adamw_hf,
    _both,
    _hf,
    _identical,
    _loss_rtol,
    _runs,
)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_models_match_the_eager_recipe(name, hf_model):
    """float32: cpu bit-identical for Llama (within 1e-6 for GPT-2, whose attention and
    layer_norm run as portable's kernels); xla within 1e-6; bfloat16 within BF16_LOSS_RTOL."""
    model, batch, loss_fn = _hf(hf_model, name)
    kw = {"make": _adamw_hf, "clip_grad_norm": 1.0}
    got, want = _runs(model, batch, loss_fn, backends=("cpu", "xla"), accumulate=2, **kw)
    assert _identical(got["cpu"], want) if name == "llama" else _loss_rtol(got["cpu"], want) <= 1e-6
    assert _loss_rtol(got["xla"], want) <= 1e-6
    got, want = _both(model, batch, loss_fn, compute=torch.bfloat16, **kw)
    assert _loss_rtol(got, want) <= BF16_LOSS_RTOL


def test_the_bfloat16_tolerance_is_tight(hf_model):
    """Against eager bfloat16 autocast on GPT-2, the program's bfloat16 recipe is within
    BF16_TIGHT, and the same program computing in float32 or float16 is not."""
    model, batch, loss_fn = _hf(hf_model, "gpt2")
    want = run_eager(model, batch, loss_fn, _adamw_hf, steps=STEPS, compute=torch.bfloat16)
    gaps = {}
    for compute in ("bfloat16", "float32", "float16"):
        program = portable.capture(
            model,
            batch,
            loss_fn=loss_fn,
            optimizer=_adamw_hf(model),
            precision=portable.Precision(compute=compute),
        )
        got = run_program(portable.compile(program, backend="cpu"), batch, STEPS)
        gaps[compute] = _loss_rtol(got, want)
    assert gaps["bfloat16"] <= BF16_TIGHT, gaps
    assert gaps["float32"] > 2 * BF16_TIGHT and gaps["float16"] > 2 * BF16_TIGHT, gaps


def test_dropout_trains_with_the_program_generator_on_every_backend(hf_model):
    """Stock GPT-2 with its dropouts on (embedding, attention, residual): the step's masks
    come from the program's generator, so cpu, xla and the eager loop under the same
    CounterDropout agree; the offset advances per micro-batch and is checkpointable state."""
    torch.manual_seed(0)
    model = hf_model("gpt2", n_layer=1, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    _, batch, loss_fn = _hf(hf_model, "gpt2")
    program = portable.capture(
        model, batch, loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=0.1), accumulate=2, seed=7
    )
    want = run_eager(
        model,
        batch,
        loss_fn,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        steps=3,
        accumulate=2,
        dropout_seed=7,
    )
    for backend in ("cpu", "xla"):
        exe = portable.compile(program, backend=backend)
        got = run_program(exe, batch, 3)
        assert _loss_rtol(got, want) <= 1e-6, backend
        assert int(exe.state["rng.offset"]) == 6 and int(exe.state["rng.seed"]) == 7
    exe = portable.compile(program, backend="cpu")
    exe.state["rng.seed"] = torch.tensor(8)  # the seed is state: reseeding is writing it
    moved = run_program(exe, batch, 1)
    assert float(moved.losses[0]) != float(want.losses[0])  # another seed, other masks
