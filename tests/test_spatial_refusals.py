"""The spatial family's typed refusals: the argument combinations a backend does not lower
exactly (bicubic grid sampling, 3-d reflection without align_corners, half-type sampler
gradients on xla; bicubic and half types on onnx) fail before running, naming the op and a fix,
while `cpu` runs them."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import portable

pytest.importorskip("jax")


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _sample(dims, mode, padding, align, dtype=torch.float32):
    x = torch.randn((1, 2, 4, 5) if dims == 2 else (1, 2, 3, 4, 5), dtype=dtype)
    grid = (torch.rand((1, 3, 2, 2) if dims == 2 else (1, 2, 3, 2, 3)) * 2 - 1).to(dtype)
    fn = functools.partial(F.grid_sample, mode=mode, padding_mode=padding, align_corners=align)
    return _Call(fn), (x, grid)


def _refused(backend, module, inputs, match):
    program = portable.capture(module, inputs)
    want = portable.compile(program, backend="cpu")(*inputs)
    assert want is not None  # cpu takes what the others refuse
    with pytest.raises(portable.PortableError, match=match):
        portable.compile(program, backend=backend)(*inputs)


@pytest.mark.parametrize("backend", ["xla", "onnx"])
def test_bicubic_grid_sampling_is_refused(backend):
    module, inputs = _sample(2, "bicubic", "zeros", False)
    _refused(backend, module, inputs, "bicubic grid sampling")


def test_reflection_without_align_corners_in_3d_is_refused_on_xla():
    module, inputs = _sample(3, "bilinear", "reflection", False)
    _refused("xla", module, inputs, "align_corners=False")


def test_half_type_grid_sampling_is_refused_on_onnx():
    module, inputs = _sample(2, "bilinear", "zeros", False, torch.bfloat16)
    _refused("onnx", module, inputs, "bfloat16")


def test_half_type_grid_sampler_gradients_are_refused_on_xla():
    x = torch.randn(1, 2, 4, 5, dtype=torch.bfloat16)
    grid = (torch.rand(1, 3, 2, 2) * 2 - 1).to(torch.bfloat16)
    program = portable.capture(
        _Trainable(x),
        (grid,),
        loss_fn=lambda model, grid: model(grid).float().sum(),
        optimizer=portable.optim.SGD(lr=0.1),
    )
    with pytest.raises(portable.PortableError, match="grid sampler gradients"):
        portable.compile(program, backend="xla")(grid)


class _Trainable(torch.nn.Module):
    def __init__(self, x):
        super().__init__()
        self.x = torch.nn.Parameter(x)

    def forward(self, grid):
        return F.grid_sample(self.x, grid, align_corners=False)
