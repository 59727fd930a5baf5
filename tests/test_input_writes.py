"""Inference programs that write into their inputs, as eager code does: `F.batch_norm` in training
mode updating the running statistics it is passed, `x.add_(1)`, `out[...] = v`. Capture records
each new value as an `updated_input` output; the executable copies it into the caller's tensor;
parity compares the written inputs too; a training step's inputs stay read-only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import portable
from portable import CaptureError
from portable.ir.parser import parse_program
from portable.ir.signature import OutputKind
from portable.testing import check_parity
from portable.testing.runs import backend_run


class RunningStats(torch.nn.Module):
    def forward(self, x, running_mean, running_var, weight, bias):
        return F.batch_norm(x, running_mean, running_var, weight, bias, training=True)


class AddInPlace(torch.nn.Module):
    def forward(self, x, y):
        x.add_(y)
        return (x * 2).sum()


def _stats_inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return (
        torch.randn(4, 3, 5),
        torch.randn(3),
        torch.rand(3) + 0.5,
        torch.randn(3),
        torch.randn(3),
    )


def _copies(inputs):
    return [x.clone() for x in inputs]


@pytest.mark.parametrize(
    "model, inputs",
    [(RunningStats(), _stats_inputs()), (AddInPlace(), (torch.randn(3, 4), torch.randn(4)))],
    ids=["batch_norm", "add_"],
)
def test_cpu_writes_the_inputs_as_eager_does(model, inputs):
    program = portable.capture(model, _copies(inputs))
    written = program.signature.outputs_of(OutputKind.UPDATED_INPUT)
    assert written and all(o.aliases for o in written)
    eager_inputs, got_inputs = _copies(inputs), _copies(inputs)
    want = model(*eager_inputs)
    got = portable.compile(program, backend="cpu")(*got_inputs)
    assert torch.equal(got, want)
    for a, b in zip(eager_inputs, got_inputs, strict=True):
        assert torch.equal(a, b)  # written inputs included: bit-identical to eager's writes


def test_the_updated_running_statistics_are_what_eager_writes():
    inputs = _stats_inputs()
    program = portable.capture(RunningStats(), _copies(inputs))
    names = {o.aliases for o in program.signature.outputs_of(OutputKind.UPDATED_INPUT)}
    assert names == {"running_mean", "running_var"}
    mine = _copies(inputs)
    portable.compile(program, backend="cpu")(*mine)
    assert not torch.equal(mine[1], inputs[1])  # momentum 0.1 moved them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_compares_the_written_inputs(dtype):
    # bfloat16: the xla rule rounds the batch statistics where torch's kernel stores them
    inputs = tuple(x.to(dtype) for x in _stats_inputs())
    program = portable.capture(RunningStats(), _copies(inputs))
    report = check_parity(program, inputs, backends=["xla"])
    assert report.ok, report
    assert "3" in report.format().splitlines()[-1].split()  # output and both running stats
    assert torch.equal(inputs[1], _stats_inputs()[1].to(dtype))  # the caller's are left alone


def test_the_written_inputs_are_quantities_of_a_run():
    inputs = _stats_inputs()
    program = portable.capture(RunningStats(), _copies(inputs))
    quantities = backend_run(portable.compile(program, backend="cpu"), inputs, 1)
    assert set(quantities) == {"output 0", "input running_mean", "input running_var"}
    mine = _copies(inputs)
    RunningStats()(*mine)
    assert torch.equal(quantities["input running_var"], mine[2])


def test_text_round_trip_keeps_the_written_input():
    program = portable.capture(RunningStats(), _copies(_stats_inputs()))
    parsed = parse_program(program.text(), weights=program.weights)
    assert parsed.signature.outputs_of(OutputKind.UPDATED_INPUT) == program.signature.outputs_of(
        OutputKind.UPDATED_INPUT
    )


def test_archive_round_trip_keeps_the_written_input(tmp_path):
    inputs = _stats_inputs()
    program = portable.capture(RunningStats(), _copies(inputs))
    loaded = portable.load(portable.archive.save(program, tmp_path / "bn"))
    a, b = _copies(inputs), _copies(inputs)
    portable.compile(program, backend="cpu")(*a)
    portable.compile(loaded, backend="cpu")(*b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class LinearThenAdd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        x.add_(y)
        return self.fc(x).sum()


def test_a_training_step_may_not_write_its_batch():
    with pytest.raises(CaptureError, match="training step mutates its input 'batch_0' in place"):
        portable.capture(
            LinearThenAdd(),
            (torch.randn(3, 4), torch.randn(4)),
            loss_fn=lambda model, x, y: model(x, y),
            optimizer=portable.optim.SGD(lr=0.1),
        )
