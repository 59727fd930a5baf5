"""The example models in `examples/` behave in eager mode and capture with `torch.export`.

Each example is loaded by file path (the `examples/` folder is not a package), built through its
`@portable` spec and checked for: deterministic construction, a finite forward pass of the
expected shape, a finite scalar loss whose backward reaches every trainable parameter, and
`torch.export` of both inference and the training loss with fully static shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from portable.capture.decorator import ModelSpec, spec_of
from portable.optim import SGD, AdamW
from tests.support import EXAMPLES_DIR, load_example

# file stem -> (decorated name, inference output shape, optimizer type)
EXAMPLES = {
    "mlp": ("MLP", (8, 4), SGD),
    "gpt": ("GPT", (2, 16, 128), AdamW),
    "llama": ("Llama", (2, 16, 128), AdamW),
    "cnn": ("CNN", (8, 10), SGD),
    "moe": ("MoE", (4, 8, 10), AdamW),
}


def example_spec(stem: str) -> ModelSpec:
    target = getattr(load_example(stem), EXAMPLES[stem][0])
    spec = spec_of(target)
    assert spec is not None, f"{stem}: `{EXAMPLES[stem][0]}` is not decorated with @portable"
    return spec


class LossModule(torch.nn.Module):
    """`loss_fn(model, *batch)` as a module, so `torch.export` can capture the training loss."""

    def __init__(self, spec: ModelSpec, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.loss_fn = spec.loss_fn

    def forward(self, *batch):
        return self.loss_fn(self.model, *batch)


def assert_static_shapes(ep: torch.export.ExportedProgram, stem: str) -> None:
    """No node of the captured graph has a symbolic (data-dependent) size or scalar value."""
    for node in ep.graph.nodes:
        for val in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor):
                sizes = (*val.shape, *val.stride()) if val.layout == torch.strided else val.shape
                symbolic = [s for s in sizes if not isinstance(s, int)]
            else:
                is_sym = isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))
                symbolic = [val] if is_sym else []
            # `_expr` keeps the unbacked symbol (u0) even when a runtime assert pinned its value.
            names = [str(getattr(getattr(s, "node", None), "_expr", s)) for s in symbolic]
            assert not symbolic, f"{stem}: `{node.name}` ({node.target}) has symbolic {names}"


def _assert_same_tensors(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        assert x.dtype == y.dtype and torch.equal(x, y)


params = pytest.mark.parametrize("stem", list(EXAMPLES))


# example files that are not portable's own models, and where they are tested
OTHER_EXAMPLES = {
    "plans": "plans for `portable train --plan` (tests/test_jobs_reshard.py)",
    "hf_llama": "a Hugging Face Llama spec, needs transformers (tests/test_jobs_drill.py)",
}


def test_every_example_file_is_listed():
    files = sorted(p.stem for p in EXAMPLES_DIR.glob("*.py") if not p.stem.startswith("_"))
    assert files == sorted([*EXAMPLES, *OTHER_EXAMPLES])


@params
def test_spec(stem):
    name, _, optimizer_type = EXAMPLES[stem]
    spec = example_spec(stem)
    assert spec.name == name
    assert spec.target is getattr(load_example(stem), name)
    assert spec.trainable and callable(spec.loss_fn)
    assert isinstance(spec.optimizer, optimizer_type)
    model = spec.build()
    assert isinstance(model, torch.nn.Module)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0 < n_params < 1_000_000


@params
def test_build_is_deterministic(stem):
    spec = example_spec(stem)
    a, b = spec.build().state_dict(), spec.build().state_dict()
    assert list(a) == list(b) and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), f"{stem}: `{key}` differs between two builds"
    # Weights come from the seeded RNG: another seed gives different weights.
    c = dataclasses.replace(spec, seed=spec.seed + 1).build().state_dict()
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())
    # Example inputs and batches are seeded too.
    _assert_same_tensors(spec.inputs(), spec.inputs())
    _assert_same_tensors(spec.batch(), spec.batch())


@params
def test_forward(stem):
    spec = example_spec(stem)
    model = spec.build().eval()
    inputs = spec.inputs()
    with torch.no_grad():
        out = model(*inputs)
        again = model(*inputs)
    assert isinstance(out, torch.Tensor)
    assert tuple(out.shape) == EXAMPLES[stem][1]
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert out.abs().sum() > 0
    assert torch.equal(out, again), f"{stem}: forward is not deterministic"


@params
def test_loss_and_backward(stem):
    spec = example_spec(stem)
    model = spec.build().train()
    loss = spec.loss_fn(model, *spec.batch())
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0
    assert loss.is_floating_point() and torch.isfinite(loss)
    loss.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    for n, p in trainable:
        assert p.grad is not None, f"{stem}: no gradient reached `{n}`"
        assert p.grad.shape == p.shape
        assert torch.isfinite(p.grad).all(), f"{stem}: non-finite gradient for `{n}`"
    assert any(p.grad.abs().sum() > 0 for _, p in trainable)


@params
def test_export_inference(stem):
    spec = example_spec(stem)
    model = spec.build().eval()
    inputs = spec.inputs()
    ep = torch.export.export(model, inputs)
    assert_static_shapes(ep, stem)
    with torch.no_grad():
        expected = model(*inputs)
        got = ep.module()(*inputs)
    torch.testing.assert_close(got, expected)


@params
def test_export_training_loss(stem):
    spec = example_spec(stem)
    batch = spec.batch()
    ep = torch.export.export(LossModule(spec, spec.build().train()), batch)
    assert_static_shapes(ep, stem)
    got = ep.module()(*batch)
    expected = spec.loss_fn(spec.build().train(), *batch)
    assert got.ndim == 0
    torch.testing.assert_close(got, expected)
