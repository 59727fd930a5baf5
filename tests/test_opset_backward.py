"""The opset's backward closure: the training step of every differentiable opset op captures (the
joint graph's backward is opset ops, or decomposes into them) and matches eager PyTorch.

Each op is taken with the inputs of its first float32 case in the `xla` rule table (every opset op
has one: tests/test_xla_rules.py checks that). Its float tensors become parameters, the loss is
the sum of each float result times a fixed random cotangent, and one SGD step is captured and
compared with `torch.optim.SGD` on `cpu`. An op is differentiable when eager autograd gives its
result a gradient function for those inputs; the backward ops themselves (their own backward is
a double backward) are not. The small form takes every third op; PORTABLE_SLOW=full takes all
of them, and on `xla` as well."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import portable
from portable.opset import opset_table
from portable.testing import check_parity

pytest.importorskip("jax")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_xla_rules import CASES  # noqa: E402

from tests.support.opinfo import cotangent_loss  # noqa: E402

FULL = os.environ.get("PORTABLE_SLOW") == "full"
# differentiable ops whose backward needs an op the opset lacks: their training step is refused
# with a typed error (checked), until the op is added
_BACKWARD_GAPS: dict[str, str] = {}
# collectives exist only after spmd-partition, which partitions the captured training step
# (backward included); no user code captures them, so they have no backward of their own
_PASS_INSERTED = {
    f"portable.{name}.default"
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_shard", "wait")
}


def _first_float_cases() -> dict[str, object]:
    chosen: dict[str, object] = {}
    for case in CASES:
        if case.op in chosen or torch.float32 not in case.dtypes or case.meta_only:
            continue
        if case.op.startswith(("aten.", "portable.")) and "_backward" not in case.op:
            if case.op not in _PASS_INSERTED:
                chosen[case.op] = case
    return chosen


_CASES = _first_float_cases()
_NAMES = sorted(_CASES) if FULL else sorted(_CASES)[::3]


class _OneOp(torch.nn.Module):
    """`op(*args, **kwargs)` with the float32 tensors of the call as parameters and the other
    tensors as inputs."""

    def __init__(self, op, call, trainable: set[int] | None = None) -> None:
        super().__init__()
        self.op = op
        leaves, self.spec = pytree.tree_flatten((call.args, call.kwargs))
        self.kinds: list[str] = []
        self.constants: list[object] = []
        self.inputs: list[torch.Tensor] = []
        for i, leaf in enumerate(leaves):
            if _is_float(leaf) and (trainable is None or i in trainable):
                self.register_parameter(f"p{i}", torch.nn.Parameter(leaf.clone()))
                self.kinds.append(f"p{i}")
            elif isinstance(leaf, torch.Tensor):
                self.kinds.append("input")
                self.inputs.append(leaf)
            else:
                self.kinds.append("constant")
            self.constants.append(None if isinstance(leaf, torch.Tensor) else leaf)

    def forward(self, *inputs: torch.Tensor):
        given = iter(inputs)
        leaves = [
            next(given)
            if kind == "input"
            else (getattr(self, kind) if kind.startswith("p") else constant)
            for kind, constant in zip(self.kinds, self.constants, strict=True)
        ]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.op(*args, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _is_float(leaf: object) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float32 and leaf.numel() > 0


def _trainable(op, call) -> _OneOp | None:
    """The module whose parameters are the float tensors eager autograd differentiates the op
    by (one at a time: `nll_loss` takes no gradient for its weight, batch norm none for its
    running statistics), when eager's own backward runs on them; None when there are none."""
    leaves = pytree.tree_leaves((call.args, call.kwargs))
    trainable = set()
    for i, leaf in enumerate(leaves):
        if not _is_float(leaf):
            continue
        module = _OneOp(op, call, {i})
        try:
            out = [o for o in module(*module.inputs) if getattr(o, "grad_fn", None) is not None]
            if out:
                torch.autograd.grad([o.sum() for o in out], list(module.parameters()))
                trainable.add(i)
        except (RuntimeError, NotImplementedError):
            continue  # eager refuses a gradient for this argument
    return _OneOp(op, call, trainable) if trainable else None


@pytest.mark.slow
@pytest.mark.parametrize("name", _NAMES)
def test_the_training_step_of_each_differentiable_op_captures_and_matches_eager(name):
    case = _CASES[name]
    torch.manual_seed(0)
    call = case.make(torch.float32)
    module = _trainable(opset_table()[name].overload, call)
    if module is None:
        pytest.skip(f"{name}: eager has no gradient for its case's inputs")
    inputs = list(module.inputs)
    out = module(*inputs)
    floats = [o.grad_fn is not None for o in out]
    loss_fn = cotangent_loss(out, floats)

    if name in _BACKWARD_GAPS:
        with pytest.raises(portable.PortableError, match="not in the portable opset"):
            portable.capture(
                module, tuple(inputs), loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=0.1)
            )
        return
    program = portable.capture(
        module, tuple(inputs), loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=0.1)
    )
    report = check_parity(
        program,
        tuple(inputs),
        backends=["xla"] if FULL else ["cpu"],
        eager_model=module,
        loss_fn=loss_fn,
    )
    assert report.ok, report.format()
