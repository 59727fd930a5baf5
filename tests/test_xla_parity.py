"""End-to-end parity of the `xla` backend against the `cpu` reference.

Every example (inference, and five training steps with SGD and with AdamW) and Hugging Face
GPT-2, Llama, BERT and Mixtral built from small configs, no downloads (inference, and five
training steps: SGD for all four, AdamW for GPT-2 and Llama). Models are tiny so the whole file, XLA compilation included, runs in about a minute on
two cores.

Tolerances (|xla - cpu| <= atol + rtol * |cpu|, elementwise):
- inference: rtol 1e-5, atol 1e-6 (outputs are O(1); atol covers values that cancel to ~0);
- training, SGD: rtol 1e-4, atol 1e-6 on the loss of every step and every parameter and state;
- training, AdamW: rtol 1e-4, atol 5e-5 = lr / 20. AdamW divides each gradient element by its
  running RMS (+ eps 1e-8), so an element whose gradient is rounding noise moves by up to
  lr * |g| / (|g| + eps) per step in a direction set by that noise. GPT's key bias is such a
  parameter (softmax ignores a per-key constant, so its exact gradient is 0): two `cpu` runs whose
  initial weights differ by 1e-7 relative already differ there by 1.5e-5 after five steps, as
  much as xla and cpu do (1.4e-5). BERT and Mixtral train with SGD only for the same reason:
  a one-layer Mixtral has weights whose first AdamW step differs by 2.5e-4 between two such `cpu`
  runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import portable
from portable.testing import check_parity

EXAMPLES = ["mlp", "gpt", "llama", "cnn", "moe"]
STEPS = 5
OPTIMIZERS = {
    "sgd": lambda: portable.optim.SGD(lr=1e-2, momentum=0.9),
    "adamw": lambda: portable.optim.AdamW(lr=1e-3),
}
INFERENCE_TOL = {"rtol": 1e-5, "atol": 1e-6}
TRAINING_TOL = {"sgd": {"rtol": 1e-4, "atol": 1e-6}, "adamw": {"rtol": 1e-4, "atol": 5e-5}}


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
    report = check_parity(program, spec.inputs(), backends=["xla"], **INFERENCE_TOL)
    _assert_compared(report, program)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("stem", EXAMPLES)
def test_example_training(stem, optimizer, example_spec):
    spec = example_spec(stem)
    torch.manual_seed(0)
    program = portable.capture(
        spec.build(), spec.batch(), loss_fn=spec.loss_fn, optimizer=OPTIMIZERS[optimizer]()
    )
    report = check_parity(
        program, spec.batch(), backends=["xla"], steps=STEPS, **TRAINING_TOL[optimizer]
    )
    _assert_compared(report, program, STEPS)


# --------------------------------------------------------------------------- Hugging Face


def _transformers():
    return pytest.importorskip("transformers")


VOCAB, SEQ = 128, 16
_SMALL = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def _gpt2(t):
    cfg = t.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        use_cache=False,
        **_SMALL,
    )
    return t.GPT2LMHeadModel(cfg)


_LLAMA_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 64,
    "use_cache": False,
}


def _llama(t):
    return t.LlamaForCausalLM(t.LlamaConfig(**_LLAMA_SIZES, **_SMALL))


def _mixtral(t):
    cfg = t.MixtralConfig(
        **{**_LLAMA_SIZES, "num_hidden_layers": 1},  # one MoE block: capture time grows with depth
        **_SMALL,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        attention_dropout=0.0,
        # static-shape dispatch (gather each token's expert weights); the default grouped form
        # sorts tokens by expert, which has data-dependent sizes
        experts_implementation="batched_mm",
    )
    return t.MixtralForCausalLM(cfg)


def _bert(t):
    cfg = t.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        **_SMALL,
    )
    return t.BertForMaskedLM(cfg)


HF_MODELS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "mixtral": _mixtral}


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
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_inference(name):
    torch.manual_seed(0)
    model = HF_MODELS[name](_transformers()).eval()
    inputs = _inference_inputs(name)
    program = portable.capture(model, inputs)
    report = check_parity(program, inputs, backends=["xla"], **INFERENCE_TOL)
    _assert_compared(report, program)


# The acceptance pair (GPT-2, Llama) trains with both optimizers; BERT and Mixtral with SGD
# (see the module docstring on AdamW and exactly-zero gradients).
HF_TRAINING = [(n, "sgd") for n in HF_MODELS] + [("gpt2", "adamw"), ("llama", "adamw")]


@pytest.mark.hf
@pytest.mark.parametrize("name, optimizer", HF_TRAINING)
def test_hf_training(name, optimizer):
    torch.manual_seed(0)
    model = HF_MODELS[name](_transformers())
    batch = (torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ)))
    program = portable.capture(model, batch, loss_fn=_lm_loss, optimizer=OPTIMIZERS[optimizer]())
    report = check_parity(program, batch, backends=["xla"], steps=STEPS, **TRAINING_TOL[optimizer])
    _assert_compared(report, program, STEPS)
