"""Signature invariants: every state input and every gradient / updated value names the weight
it is about (`target`), so code reading weights by it (`key`) never indexes with None."""

from __future__ import annotations

import pytest
import torch

from portable.ir.signature import (
    STATE_INPUTS,
    TARGETED_OUTPUTS,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Signature,
    TensorSpec,
)

SPEC = TensorSpec((2,), torch.float32)


@pytest.mark.parametrize("kind", STATE_INPUTS)
def test_a_state_input_needs_a_target(kind):
    with pytest.raises(ValueError, match=f"{kind.value} input 'w' has no target"):
        InputSpec("w", kind, SPEC)
    assert InputSpec("w", kind, SPEC, "fc.weight").key == "fc.weight"


def test_a_user_input_has_no_key():
    spec = InputSpec("x", InputKind.USER_INPUT, SPEC)
    with pytest.raises(ValueError, match="user_input input 'x' has no weight key"):
        _ = spec.key


@pytest.mark.parametrize("kind", TARGETED_OUTPUTS)
def test_a_gradient_or_updated_value_needs_a_target(kind):
    with pytest.raises(ValueError, match=f"{kind.value} output 'g' has no target"):
        OutputSpec("g", kind, SPEC)
    assert OutputSpec("g", kind, SPEC, "fc.weight").key == "fc.weight"
    assert OutputSpec("loss", OutputKind.LOSS, SPEC).target is None


def test_a_document_without_the_target_is_refused_when_read():
    doc = {
        "inputs": [
            {"name": "w", "kind": "parameter", "target": None, "shape": [2], "dtype": "float32"}
        ],
        "outputs": [],
    }
    with pytest.raises(ValueError, match="parameter input 'w' has no target"):
        Signature.from_json(doc)
