"""End-to-end parity of the `xla` backend against the `cpu` reference.

Every example (inference, and five training steps with SGD and with AdamW) and Hugging Face
GPT-2, Llama, BERT and Mixtral built from small configs, no downloads (inference, and five
training steps with SGD and with AdamW). Models are tiny so the whole file, XLA compilation
included, runs in a few minutes on two cores.

Tolerances: check_parity's one policy (docs/testing.md, "Tolerance policy"), its defaults
rtol 1e-5, atol 1e-6 plus the rounding allowance the reference measures on itself, for
inference and training alike. AdamW used to need atol lr / 20 here (and BERT and Mixtral trained
with SGD only): it turns the rounding noise of a gradient that is exactly zero in exact
arithmetic (GPT's key bias) into steps of up to lr in a direction the rounding picks, which the
policy's optimizer-noise allowance now accounts for element by element.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import portable
from portable.testing import check_parity
from tests.support import EXAMPLES

STEPS = 5
OPTIMIZERS = {
    "sgd": lambda: portable.optim.SGD(lr=1e-2, momentum=0.9),
    "adamw": lambda: portable.optim.AdamW(lr=1e-3),
}


def _assert_compared(report, program, steps: int = 1) -> None:
    """The report passed and covered what it should: outputs, or every step's loss and every
    parameter."""
    assert report.ok, report.format()
    quantities = {r.quantity for r in report.rows if r.backend == "xla"}
    if program.kind is portable.ProgramKind.INFERENCE:
        want = {f"output {o.name}" for o in program.signature.outputs}
    else:
        want = {f"loss step {i}" for i in range(1, steps + 1)}
        want |= {f"state {name}" for name in program.parameters()}
    assert want <= quantities, sorted(want - quantities)


@pytest.mark.parametrize("stem", EXAMPLES)
def test_example_inference(stem, example_spec):
    spec = example_spec(stem)
    program = portable.capture_spec(spec)
    report = check_parity(program, spec.inputs(), backends=["xla"])
    _assert_compared(report, program)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("stem", EXAMPLES)
def test_example_training(stem, optimizer, example_spec):
    spec = example_spec(stem)
    torch.manual_seed(0)
    program = portable.capture(
        spec.build(), spec.batch(), loss_fn=spec.loss_fn, optimizer=OPTIMIZERS[optimizer]()
    )
    report = check_parity(program, spec.batch(), backends=["xla"], steps=STEPS)
    _assert_compared(report, program, STEPS)


# --------------------------------------------------------------------------- Hugging Face


VOCAB, SEQ = 128, 16  # VOCAB is the conftest's HF_VOCAB
HF_MODELS = ["gpt2", "llama", "bert", "mixtral"]


def _lm_loss(model, ids, targets):
    return F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())


def _inference_inputs(name):
    ids = torch.randint(0, VOCAB, (2, SEQ))
    if name != "bert":
        return (ids,)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, SEQ // 2 :] = 0  # a padded sequence: attention gets a mask
    return ids, mask


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_inference(name, hf_model):
    torch.manual_seed(0)
    model = hf_model(name).eval()
    inputs = _inference_inputs(name)
    program = portable.capture(model, inputs)
    report = check_parity(program, inputs, backends=["xla"])
    _assert_compared(report, program)


HF_TRAINING = [(n, o) for n in HF_MODELS for o in OPTIMIZERS]


@pytest.mark.hf
@pytest.mark.parametrize("name, optimizer", HF_TRAINING)
def test_hf_training(name, optimizer, hf_model):
    torch.manual_seed(0)
    model = hf_model(name)
    batch = (torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ)))
    program = portable.capture(model, batch, loss_fn=_lm_loss, optimizer=OPTIMIZERS[optimizer]())
    report = check_parity(program, batch, backends=["xla"], steps=STEPS)
    _assert_compared(report, program, STEPS)
